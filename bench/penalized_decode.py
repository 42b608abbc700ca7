"""What penalties cost in decode throughput: the same batch decoded plainly with and without
`repetition_penalty` / `frequency_penalty` (greedy, EOS ignored), one engine, bf16, the SmolLM2
shape with random weights (no model file needed). Also how many decode steps were launched
ahead of the previous step's results (a penalized batch that paced the loop would add none).

    python3 bench/penalized_decode.py [--batch-size 1 16] [--output-len 128] [--repeats 2]
        [--output-json OUT.json] [engine flags; defaults: --model-path smollm2-135m
        --load-format dummy --dtype bfloat16]

With PYTHONPATH naming another checkout, that version is timed: two side by side in one call.
Prints every row as JSON, then a table of decode tok/s and the ratio penalized / plain.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# (appended: a checkout named on PYTHONPATH comes first, so another version can be timed)
sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.script_checks import check_output_file, engine_errors  # noqa: E402

PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.2}


def best_tok_s(engine, prompts: list[list[int]], params: dict, repeats: int) -> float:
    """The best decode tok/s of `repeats` timed runs, after one untimed run (captures)."""
    engine.generate(input_ids=prompts, sampling_params=params)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        best = max(best, sum(len(o["output_ids"]) for o in outs) / seconds)
    return best


def main() -> None:
    from specserve import Engine
    from specserve.bench.args import positive_int
    from specserve.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    args = p.parse_args()
    check_output_file(p, "--output-json", args.output_json)
    kwargs = {
        "model_path": "smollm2-135m",
        "load_format": "dummy",
        "dtype": "bfloat16",
        "skip_tokenizer_init": True,
        **engine_kwargs(args),
    }
    rows = []
    with engine_errors(), Engine(**kwargs) as engine:
        for bs in args.batch_size:
            # (distinct prompts with repeats in them: a repetition penalty has work to do)
            prompts = [[100 + i, 200 + i, 300 + i] * 10 for i in range(bs)]
            plain = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
            row = {"batch_size": bs}
            for name, params in (("plain", plain), ("penalized", {**plain, **PENALTIES})):
                row[f"{name}_tok_s"] = round(best_tok_s(engine, prompts, params, args.repeats), 1)
            row["penalized_over_plain"] = round(row["penalized_tok_s"] / row["plain_tok_s"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        launched_ahead = engine.stats()["num_decode_steps_launched_ahead"]
    print(json.dumps({"decode_steps_launched_ahead": launched_ahead}))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))
    print("\n| batch | plain tok/s | penalized tok/s | penalized / plain |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['batch_size']} | {r['plain_tok_s']:,.0f} | {r['penalized_tok_s']:,.0f} "
            f"| {r['penalized_over_plain']:.2f} |"
        )


if __name__ == "__main__":
    main()
