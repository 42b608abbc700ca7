"""What a server's first requests of each sampling mode meet: one engine (the SmolLM2 shape
with random weights and the bundled draft's 6/8/64 tree, bf16: no model file needed) serves
a batch of each sampling mode at each batch size, twice. Each row gives the batch's seconds,
the CUDA graphs captured meanwhile (a capture stalls the step that meets it; greedy and
plain sampled steps are captured at engine start), the graph shapes left to eager steps for
lack of device memory, and the requests that failed (there should be none).

    python3 bench/first_requests_by_sampling_mode.py [--batch-size 1 8 64 200]
        [--output-len 32] [--output-json OUT.json] [engine flags, which override the above]

Prints the engine's start (seconds, decode graphs captured, KV tokens and why), every row as
JSON, then a table. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.script_checks import check_output_file, engine_errors  # noqa: E402

DRAFT = Path(__file__).resolve().parents[1] / "specserve/data/drafts/smollm2-135m-eagle"
MODES = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 1.0},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "penalized": {"temperature": 0.0, "frequency_penalty": 0.5},
}


def bundled_tree_engine(args: argparse.Namespace) -> dict:
    from specserve.cli import engine_kwargs

    return {
        "model_path": "smollm2-135m",
        "load_format": "dummy",
        "dtype": "bfloat16",
        "skip_tokenizer_init": True,
        "speculative_algorithm": "EAGLE",
        "speculative_draft_model_path": str(DRAFT),
        "speculative_num_steps": 6,
        "speculative_eagle_topk": 8,
        "speculative_num_draft_tokens": 64,
        "speculative_token_map": str(DRAFT / "token_map.json"),
        **engine_kwargs(args),
    }


def main() -> None:
    from specserve import Engine
    from specserve.bench.args import positive_int
    from specserve.cli import add_engine_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=positive_int, nargs="+", default=[1, 8, 64, 200])
    ap.add_argument("--output-len", type=positive_int, default=32)
    ap.add_argument("--output-json")
    add_engine_args(ap)
    args = ap.parse_args()
    check_output_file(ap, "--output-json", args.output_json)

    start = time.perf_counter()
    rows = []
    with engine_errors(), Engine(**bundled_tree_engine(args)) as engine:
        up = time.perf_counter() - start
        stats = engine.stats()
        kv = next(
            d for d in engine.resolved_args()["decisions"] if d["field"] == "max_total_tokens"
        )
        head = {
            "start_s": round(up, 1),
            "decode_graphs_at_start": len(getattr(engine.core.worker.graphs, "graphs", ())),
            "max_total_tokens": kv["value"],
            "why": kv["reason"],
        }
        print(json.dumps(head), flush=True)
        for visit in ("first", "again"):
            for mode, params in MODES.items():
                for bs in args.batch_size:
                    prompts = [[5 + i, 17, 99, 123, 7] for i in range(bs)]
                    sp = {**params, "max_new_tokens": args.output_len, "ignore_eos": True}
                    before = engine.stats()
                    t0 = time.perf_counter()
                    outs = engine.generate(input_ids=prompts, sampling_params=sp)
                    seconds = time.perf_counter() - t0
                    stats = engine.stats()
                    failed = [
                        o["meta_info"]["finish_reason"]
                        for o in outs
                        if o["meta_info"]["finish_reason"]["type"] not in ("stop", "length")
                    ]
                    row = {
                        "visit": visit,
                        "mode": mode,
                        "batch": bs,
                        "seconds": round(seconds, 3),
                        "captures": stats["num_graph_captures"] - before["num_graph_captures"],
                        "shapes_without_memory": stats["num_graph_shapes_without_memory"],
                        "failed": len(failed),
                        "first_failure": failed[0] if failed else None,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"engine": head, "rows": rows}, indent=1))
    print(
        f"\nengine start {head['start_s']} s, {head['decode_graphs_at_start']} decode graphs; "
        f"KV {head['max_total_tokens']} tokens ({head['why']})\n"
    )
    print("| visit | mode | batch | seconds | captures | shapes without memory | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['visit']} | {r['mode']} | {r['batch']} | {r['seconds']:.2f} | "
            f"{r['captures']} | {r['shapes_without_memory']} | {r['failed']} |"
        )


if __name__ == "__main__":
    main()
