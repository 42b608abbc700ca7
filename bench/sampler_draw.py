"""Time the sampler's draw of a decode step, torch against the Triton Gumbel-max kernel.

    PYTHONPATH=. python3 bench/sampler_draw.py [--json out.json] [--rows R ...] [--vocab V ...]

`ops/sampling.py: sample` with every row sampled (temperature 0.8, no filter), float32 logits
[R, V], R the rows a step samples (a tree samples every node: batch x nodes, e.g. 64 for
SmolLM2's 6/8/64 tree at batch 1, 4,096 at batch 64). Each shape is checked first: the
kernel's draws equal torch's except at near-ties (at most 1% of rows). Each call is replayed
from a CUDA graph (median ms, `triton.testing.do_bench`); `torch_peak_mib` / `triton_peak_mib`
are the call's peak memory beyond its inputs. Prints JSON lines, then a table. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.gpu_timing import graph_ms, warm_up_clocks  # noqa: E402
from specserve.config.kernels import REFERENCE, Kernels  # noqa: E402
from specserve.ops.sampling import SamplingTensors, sample  # noqa: E402

ROWS, VOCABS = [64, 1024, 4096, 16384], [49152, 128256]
TRITON = Kernels(sampling_reductions=True)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def case(rows: int, vocab: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = 4.0 * torch.randn(rows, vocab, device="cuda", generator=g)
    st = SamplingTensors(
        temperatures=torch.full((rows,), 0.8, device="cuda"),
        top_ks=torch.full((rows,), -1, dtype=torch.int64, device="cuda"),
        top_ps=torch.ones(rows, device="cuda"),
        min_ps=torch.zeros(rows, device="cuda"),
        seeds=torch.randint(0, 2**31, (rows,), device="cuda", generator=g),
        all_greedy=False,
        needs_filter=False,
    )
    positions = torch.arange(rows, device="cuda") + 500
    plain = sample(logits, st, positions, REFERENCE)
    fast = sample(logits, st, positions, TRITON)
    agree = (plain == fast).float().mean().item()
    out = {"rows": rows, "vocab": vocab, "agree": agree, "ok": agree >= 0.99}
    out["torch_peak_mib"] = peak_mib(lambda: sample(logits, st, positions, REFERENCE))
    out["triton_peak_mib"] = peak_mib(lambda: sample(logits, st, positions, TRITON))
    out["torch_ms"] = graph_ms(lambda: sample(logits, st, positions, REFERENCE))
    out["triton_ms"] = graph_ms(lambda: sample(logits, st, positions, TRITON))
    out["speedup"] = out["torch_ms"] / out["triton_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--vocab", type=int, nargs="+", default=VOCABS)
    args = ap.parse_args()
    warm_up_clocks()
    results = []
    for vocab in args.vocab:
        for rows in args.rows:
            try:
                r = case(rows, vocab)
            except torch.OutOfMemoryError:
                r = {"rows": rows, "vocab": vocab, "ok": None, "error": "out of memory"}
            torch.cuda.empty_cache()
            print(json.dumps(r), flush=True)
            results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(
        "\n| V | rows | torch ms | Triton ms | speedup | torch peak MiB | Triton peak MiB | agree |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['vocab']} | {r['rows']} | {r['error']} | | | | | |")
            continue
        print(
            f"| {r['vocab']} | {r['rows']} | {r['torch_ms']:.3f} | {r['triton_ms']:.3f} | "
            f"{r['speedup']:.1f} | {r['torch_peak_mib']:.0f} | {r['triton_peak_mib']:.0f} | "
            f"{r['agree']:.4f} |"
        )
    sys.exit(0 if all(r["ok"] is not False for r in results) else 1)


if __name__ == "__main__":
    main()
