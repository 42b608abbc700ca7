"""Where the engine loop's host time goes at a batch size: cProfile around `EngineCore.step`
(it runs in the engine's own thread, so profiling the caller would see only a wait) over one
static batch of chat prompts, after the warm-up `bench one-batch` does. Prints the top
functions by own time and by cumulative time, and writes them as JSON. At large batches of a
small model a decode step is bound by the host, not the device: this is how to find what.

  python bench/host_profile.py --batch-size 64 [--output-json OUT.json] [engine flags...]
  e.g. --speculative-adaptive, --no-default-draft, --speculative-num-steps 3
  --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
  On a CPU, --without-step-compute with a small model (e.g. an HF folder with the target's
  vocabulary and a random EAGLE head) profiles the same bookkeeping a GPU's host runs.

Profiling slows Python code about twofold: compare shares between runs, not absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.script_checks import check_output_file, engine_errors  # noqa: E402


def profile_batch(
    engine, batch_size: int, output_len: int, top: int, without_step_compute: bool = False
) -> dict:
    from specserve.bench.one_batch import chat_batch, same_lengths, warm_up

    prompts, sp = chat_batch(engine, batch_size, output_len)
    others, _ = chat_batch(engine, batch_size, output_len, offset=batch_size)
    warm_up(engine, same_lengths(others, prompts), sp)
    core = engine.core
    profiler = cProfile.Profile()
    step, steps = core.step, [0]

    def profiled_step(*args, **kwargs):
        steps[0] += 1
        profiler.enable()
        try:
            return step(*args, **kwargs)
        finally:
            profiler.disable()

    core.step = profiled_step
    compute = core.worker.step.run
    if without_step_compute:
        # what a CUDA graph replays on a GPU runs eagerly on a CPU, where it would bury the
        # host's own work: leave it out of the profile
        def unprofiled_compute(*args, **kwargs):
            profiler.disable()
            try:
                return compute(*args, **kwargs)
            finally:
                profiler.enable()

        core.worker.step.run = unprofiled_compute
    try:
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - start
    finally:
        core.step = step
        core.worker.step.run = compute
    stats = pstats.Stats(profiler)
    rows = [
        {
            "function": f"{path}:{line}({name})",
            "calls": calls,
            "own_s": own,
            "cumulative_s": cumulative,
        }
        for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items()
    ]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "batch_size": batch_size,
        "engine_steps": steps[0],
        "wall_s": wall,
        "tokens": tokens,
        "profiled_s": sum(r["own_s"] for r in rows),
        "by_own_time": sorted(rows, key=lambda r: -r["own_s"])[:top],
        "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_s"])[:top],
    }


def print_table(result: dict) -> None:
    steps = max(result["engine_steps"], 1)
    print(
        f"batch {result['batch_size']}: {result['tokens']} tokens in {result['wall_s']:.3f} s "
        f"(profiled), {steps} engine steps, {result['profiled_s'] * 1e3 / steps:.3f} ms "
        "profiled per step"
    )
    for key in ("by_own_time", "by_cumulative_time"):
        print(f"\n{key.replace('_', ' ')} | calls | own ms/step | cumulative ms/step")
        print("--- | --- | --- | ---")
        for r in result[key]:
            print(
                f"{r['function']} | {r['calls']} | {r['own_s'] * 1e3 / steps:.3f} | "
                f"{r['cumulative_s'] * 1e3 / steps:.3f}"
            )


def main() -> None:
    from specserve.bench.args import positive_int
    from specserve.cli import add_engine_args, engine_kwargs
    from specserve.engine import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=positive_int, default=64, help="(default: %(default)s)")
    p.add_argument("--output-len", type=positive_int, default=128, help="(default: %(default)s)")
    p.add_argument(
        "--top", type=positive_int, default=30, help="functions to list per table (default: 30)"
    )
    p.add_argument("--output-json", default=None)
    p.add_argument(
        "--without-step-compute",
        action="store_true",
        help="leave the decode step's own compute (a graph replay on a GPU) out of the "
        "profile: the host's bookkeeping alone, measurable on a CPU with a small model",
    )
    add_engine_args(p)
    args = p.parse_args()
    check_output_file(p, "--output-json", args.output_json)
    with engine_errors(), Engine(**engine_kwargs(args)) as engine:
        if engine.tokenizer is None:
            # the profiled batch is chat prompts, as `bench one-batch --chat` sends
            p.error(
                f"argument --model-path: {args.model_path} has no tokenizer here "
                f"({engine._no_tokenizer()}); chat prompts need one (a GGUF or an HF folder "
                "with tokenizer files, without --skip-tokenizer-init)"
            )
        result = profile_batch(
            engine, args.batch_size, args.output_len, args.top, args.without_step_compute
        )
    print_table(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
