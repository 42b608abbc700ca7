"""Time the split-row Triton top-k / argmax (specserve.ops.triton_topk) against torch.

    PYTHONPATH=. python3 bench/topk_kernels.py [--json out.json] [--sweep]

Shapes: T in {1, 8, 64, 512} x V in {49152, 128256} x k in {1, 4, 8}, random bf16 logits.
Each shape is first checked (ids exactly against a stable sort of the logits, i.e. the tie
rule "lower column first"; log-probs against torch within 1e-5); the script exits 1 if any
check fails. `torch_us`/`triton_us` are eager calls timed with triton.testing.do_bench
(median, Python launch overhead included); `*_graph_us` replay the call from a CUDA graph,
as the engine's captured decode step sees it. k = 1 shapes also time row_argmax against
`logits.argmax(-1)`. `--sweep` instead graph-times chunk/block plans per shape.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.script_checks import require_cuda  # noqa: E402
from specserve.bench.gpu_timing import graph_ms, warm_up_clocks  # noqa: E402

ROWS, VOCABS, KS = [1, 8, 64, 512], [49152, 128256], [1, 4, 8]


def check(logits: torch.Tensor, k: int) -> list[str]:
    """Problems found (empty when the kernels agree with torch)."""
    from specserve.ops.triton_topk import (
        row_argmax,
        row_argmax_reference,
        row_topk_logprobs,
        row_topk_logprobs_reference,
    )

    problems = []
    logp, ids = row_topk_logprobs(logits, k)
    xf = logits.float()
    want_ids = torch.sort(xf, dim=-1, descending=True, stable=True).indices[:, :k]
    if not torch.equal(ids, want_ids):
        bad = (ids != want_ids).any(-1).sum().item()
        problems.append(f"topk ids differ from the stable-sort order in {bad} rows")
    ref_logp, _ = row_topk_logprobs_reference(logits, k)
    err = (logp - ref_logp).abs().max().item()
    if not torch.allclose(logp, ref_logp, rtol=1e-5, atol=1e-5):
        problems.append(f"topk log-probs differ from torch by up to {err:.3g}")
    if k == 1 and not torch.equal(row_argmax(logits), row_argmax_reference(logits)):
        problems.append("argmax differs from torch")
    return problems


def time_pair(fn_torch, fn_triton) -> dict:
    from triton.testing import do_bench

    t_ms = do_bench(fn_torch, return_mode="median")
    k_ms = do_bench(fn_triton, return_mode="median")
    tg_ms, kg_ms = graph_ms(fn_torch), graph_ms(fn_triton)
    return {
        "torch_us": round(t_ms * 1e3, 1),
        "triton_us": round(k_ms * 1e3, 1),
        "speedup": round(t_ms / k_ms, 2),
        "torch_graph_us": round(tg_ms * 1e3, 1),
        "triton_graph_us": round(kg_ms * 1e3, 1),
        "graph_speedup": round(tg_ms / kg_ms, 2),
    }


def run(rows_list, vocabs, ks) -> tuple[list[dict], bool]:
    from specserve.ops.triton_topk import (
        plan_chunks,
        row_argmax,
        row_argmax_reference,
        row_topk_logprobs,
        row_topk_logprobs_reference,
    )

    results, ok = [], True
    for vocab in vocabs:
        for rows in rows_list:
            g = torch.Generator(device="cuda").manual_seed(rows * 7 + vocab)
            logits = (2.0 * torch.randn(rows, vocab, device="cuda", generator=g)).bfloat16()
            for k in ks:
                chunk, block = plan_chunks(rows, vocab, k)
                problems = check(logits, k)
                ok &= not problems
                for p in problems:
                    print(f"FAIL T={rows} V={vocab} k={k}: {p}", file=sys.stderr)
                ops = [("topk_logprobs", row_topk_logprobs_reference, row_topk_logprobs)]
                if k == 1:
                    ops.append(("argmax", row_argmax_reference, row_argmax))
                for op, ref, fn in ops:
                    args = (logits, k) if op == "topk_logprobs" else (logits,)
                    row = {"op": op, "T": rows, "V": vocab, "k": k, "ok": not problems}
                    row.update(
                        time_pair(lambda ref=ref, a=args: ref(*a), lambda fn=fn, a=args: fn(*a))
                    )
                    row.update(chunk=chunk, block=block)
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    return results, ok


def sweep(rows_list, vocabs, ks) -> None:
    """Graph-time chunk/block plans, then kernel-2 warps (the default plan marked *)."""
    from specserve.ops import triton_topk as tk

    plans = [(c, b) for c in (512, 1024, 2048, 4096, 8192, 16384) for b in (256, 512, 1024, 2048)]
    for vocab in vocabs:
        for rows in rows_list:
            logits = (2.0 * torch.randn(rows, vocab, device="cuda")).bfloat16()
            for k in ks:
                default = tk.plan_chunks(rows, vocab, k)
                for name in ["topk"] + (["argmax"] if k == 1 else []):
                    line = []
                    for chunk, block in plans:
                        if block > chunk or -(-vocab // chunk) > 256:
                            continue
                        if name == "topk":
                            fn = partial(tk.row_topk_logprobs, logits, k, chunk=chunk, block=block)
                        else:
                            fn = partial(tk.row_argmax, logits, chunk=chunk, block=block)
                        mark = "*" if (chunk, block) == default else ""
                        line.append(f"{chunk}/{block}{mark}:{1e3 * graph_ms(fn):.1f}")
                    print(f"{name} T={rows} V={vocab} k={k}  " + "  ".join(line), flush=True)
                if rows > 8:
                    continue
                line = []  # kernel-2 warps at the default plan
                for w2 in (1, 2, 4, 8):
                    lp = torch.empty(rows, k, device="cuda")
                    ids = torch.empty(rows, k, device="cuda", dtype=torch.int64)
                    warps = (max(1, min(8, default[1] // 256)), w2)
                    fn = partial(tk._select, logits, k, True, lp, ids, *default, warps)
                    line.append(f"w2={w2}:{1e3 * graph_ms(fn):.1f}")
                print(f"merge warps T={rows} V={vocab} k={k}  " + "  ".join(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS, help="T values")
    ap.add_argument("--vocab", type=int, nargs="+", default=VOCABS, help="V values")
    ap.add_argument("--k", type=int, nargs="+", default=KS, help="k values")
    ap.add_argument("--sweep", action="store_true", help="graph-time chunk/block plans instead")
    args = ap.parse_args()
    require_cuda(__file__, "Triton kernels")
    import specserve.ops.triton_topk  # noqa: F401  (fail early if the module does not import)

    warm_up_clocks()
    if args.sweep:
        sweep(args.rows, args.vocab, args.k)
        return
    results, ok = run(args.rows, args.vocab, args.k)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    cols = ["op", "T", "V", "k", "torch_us", "triton_us", "speedup"]
    cols += ["torch_graph_us", "triton_graph_us", "graph_speedup", "chunk", "ok"]
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if not ok:
        sys.exit("some correctness checks failed (see FAIL lines above)")


if __name__ == "__main__":
    main()
