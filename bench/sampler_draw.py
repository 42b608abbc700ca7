"""Time the sampler's draw of a decode step, torch against the Triton kernels.

    PYTHONPATH=. python3 bench/sampler_draw.py [--json out.json] [--rows R ...] [--vocab V ...]
        [--filters none top-p ...]

`ops/sampling.py: sample` with every row sampled (temperature 0.8), float32 logits [R, V], R
the rows a step samples (a tree samples every node: batch x nodes, e.g. 64 for SmolLM2's
6/8/64 tree at batch 1, 4,096 at batch 64), under each filter setting of `FILTERS`. Columns:
torch (no Triton) and Triton (`sample` as shipped); for filtered rows also each way to the
filters' floor before the Gumbel-max kernel: `sort_ms` the torch sort per row (what
`sample` runs below FILTER_SEARCH_MIN_ROWS rows), `search_ms` the search kernel
(ops/triton_filter.py; above). Each shape is checked first: the share of rows whose draw
equals torch's (`agree`; the Gumbel kernel's logs may round otherwise than torch's at a
near-tie, so `ok` wants 99%). Each call is replayed from a CUDA graph (median ms,
`triton.testing.do_bench`); the peaks are the call's memory beyond its inputs. Prints JSON
lines, then a table. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.script_checks import require_cuda  # noqa: E402
from specserve.bench.gpu_timing import graph_ms, warm_up_clocks  # noqa: E402
from specserve.config.kernels import REFERENCE, Kernels  # noqa: E402
from specserve.ops.sampling import (  # noqa: E402
    SAMPLE_BLOCK_ELEMENTS,
    SamplingTensors,
    noise_keys,
    sample,
)
from specserve.ops.triton_filter import filter_floor, filter_floor_reference  # noqa: E402
from specserve.ops.triton_gumbel import gumbel_argmax  # noqa: E402

ROWS, VOCABS = [1, 64, 256, 1024, 16384], [49152, 128256]
# name -> (top_k, top_p, min_p): what chat clients send most, each filter alone and together
FILTERS = {
    "none": (-1, 1.0, 0.0),
    "top-p": (-1, 0.9, 0.0),
    "top-k": (50, 1.0, 0.0),
    "min-p": (-1, 1.0, 0.05),
    "top-k+top-p": (50, 0.9, 0.0),
}
TRITON = Kernels(sampling_reductions=True, filter_search=True)  # (as a GPU engine runs)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def sort_then_kernel_draw(logits, st: SamplingTensors, positions) -> torch.Tensor:
    """The torch sort's floor, then the kernel's draw (in blocks of rows, as the sort's
    temporaries need)."""
    keys = noise_keys(st.seeds, positions)
    block = max(1, SAMPLE_BLOCK_ELEMENTS // logits.shape[-1])
    parts = []
    for start in range(0, len(logits), block):
        part = slice(start, start + block)
        rows = st.take(part)
        floor = filter_floor_reference(
            logits[part], rows.temperatures, rows.top_ks, rows.top_ps, rows.min_ps
        )
        parts.append(gumbel_argmax(logits[part], rows.temperatures, keys[part], floor))
    return torch.cat(parts)


def search_then_kernel_draw(logits, st: SamplingTensors, positions) -> torch.Tensor:
    """The search kernel's floor, then the kernel's draw."""
    floor = filter_floor(logits, st.temperatures, st.top_ks, st.top_ps, st.min_ps)
    return gumbel_argmax(logits, st.temperatures, noise_keys(st.seeds, positions), floor)


def case(rows: int, vocab: int, filters: str) -> dict:
    top_k, top_p, min_p = FILTERS[filters]
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = 4.0 * torch.randn(rows, vocab, device="cuda", generator=g)
    st = SamplingTensors(
        temperatures=torch.full((rows,), 0.8, device="cuda"),
        top_ks=torch.full((rows,), top_k, dtype=torch.int64, device="cuda"),
        top_ps=torch.full((rows,), top_p, device="cuda"),
        min_ps=torch.full((rows,), min_p, device="cuda"),
        seeds=torch.randint(0, 2**31, (rows,), device="cuda", generator=g),
        all_greedy=False,
        needs_filter=filters != "none",
    )
    positions = torch.arange(rows, device="cuda") + 500
    plain = sample(logits, st, positions, REFERENCE)
    fast = sample(logits, st, positions, TRITON)
    agree = (plain == fast).float().mean().item()
    out = {"filters": filters, "rows": rows, "vocab": vocab, "agree": agree, "ok": agree >= 0.99}
    out["torch_peak_mib"] = peak_mib(lambda: sample(logits, st, positions, REFERENCE))
    out["triton_peak_mib"] = peak_mib(lambda: sample(logits, st, positions, TRITON))
    out["torch_ms"] = graph_ms(lambda: sample(logits, st, positions, REFERENCE))
    out["triton_ms"] = graph_ms(lambda: sample(logits, st, positions, TRITON))
    out["speedup"] = out["torch_ms"] / out["triton_ms"]
    if st.needs_filter:
        out["sort_ms"] = graph_ms(lambda: sort_then_kernel_draw(logits, st, positions))
        out["search_ms"] = graph_ms(lambda: search_then_kernel_draw(logits, st, positions))
        out["search_over_sort"] = out["sort_ms"] / out["search_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--vocab", type=int, nargs="+", default=VOCABS)
    ap.add_argument("--filters", nargs="+", default=list(FILTERS), choices=list(FILTERS))
    args = ap.parse_args()
    require_cuda(__file__)
    warm_up_clocks()
    results = []
    for filters in args.filters:
        for vocab in args.vocab:
            for rows in args.rows:
                try:
                    r = case(rows, vocab, filters)
                except torch.OutOfMemoryError:
                    r = {"filters": filters, "rows": rows, "vocab": vocab, "ok": None}
                    r["error"] = "out of memory"
                torch.cuda.empty_cache()
                print(json.dumps(r), flush=True)
                results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(
        "\n| filters | V | rows | torch ms | Triton ms | speedup | sort + draw ms "
        "| search + draw ms | search / sort | torch peak MiB | Triton peak MiB | agree |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        head = f"| {r['filters']} | {r['vocab']} | {r['rows']} |"
        if "error" in r:
            print(f"{head} {r['error']} | | | | | | | | |")
            continue
        filtered = ["", "", ""]
        if "sort_ms" in r:
            filtered = [
                f"{r['sort_ms']:.3f}",
                f"{r['search_ms']:.3f}",
                f"{r['search_over_sort']:.2f}",
            ]
        print(
            f"{head} {r['torch_ms']:.3f} | {r['triton_ms']:.3f} | {r['speedup']:.1f} | "
            f"{' | '.join(filtered)} | {r['torch_peak_mib']:.0f} | "
            f"{r['triton_peak_mib']:.0f} | {r['agree']:.4f} |"
        )
    sys.exit(0 if all(r["ok"] is not False for r in results) else 1)


if __name__ == "__main__":
    main()
