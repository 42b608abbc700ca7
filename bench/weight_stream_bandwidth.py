"""How fast each matmul streams its weights at decode widths, against the GPU's read ceiling.

    python3 bench/weight_stream_bandwidth.py [--ms 1,2,4,8,16,32,64] [--fused] [--json out.json]

For the Llama-3-8B linear shapes (bf16) at M = 1 .. 64 rows: cuBLAS (F.linear; lm_head as the
engine runs it, torch.mm writing float32), the skinny Triton GEMM (`ops/triton_linear.py`,
its own per-M config, split-K where it pays) and the batch-invariant GEMM
(`ops/triton_invariant_linear.py`, deterministic inference). Each is replayed from one CUDA
graph over enough distinct copies of the weight to overflow L2 (as a decode step walks its
layers), timed with CUDA events; reported as bytes/s of the weight read and as a fraction of
the read ceiling measured here (torch.sum over a 4 GiB tensor, and a 4 GiB copy counting
read + write). Also checked per kernel: the error against an fp32 reference, and for the
batch-invariant GEMM that row 0 has the same bits at M as alone (it must).
--fused adds each shape with the work the engine does around it (the RMSNorm before qkv and
gate_up, the SiLU-and-mul before down, the residual add after o and down): cuBLAS beside the
fused norm kernels, the batch-invariant GEMM with that work in its prologue / epilogue, and the
batch-invariant GEMM beside the same norm kernels.
Last: the step's matmuls (32 layers x qkv, o, gate_up, down + lm_head) per method and M, as
time per step and the tok/s that time alone would allow at batch M. JSON, then tables.

    python3 bench/weight_stream_bandwidth.py --tune [--tune-ms 1,16,64] [--shapes qkv,o]

sweeps the batch-invariant GEMM's tile per weight shape (one tile for every M: the score is
the sum over --tune-ms of each time over the best time at that M) and prints the winners as
`INVARIANT_GEMM_TILES` entries for specserve/config/kernels.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.script_checks import require_cuda  # noqa: E402
from specserve.bench.gpu_timing import warm_up_clocks  # noqa: E402
from specserve.ops.triton_invariant_linear import InvariantConfig, invariant_linear  # noqa: E402
from specserve.ops.triton_linear import skinny_linear  # noqa: E402

SHAPES = [  # (name, N, K, layers per step)
    ("qkv", 6144, 4096, 32),
    ("o", 4096, 4096, 32),
    ("gate_up", 28672, 4096, 32),
    ("down", 4096, 14336, 32),
    ("lm_head", 128256, 4096, 1),
]
DTYPE = torch.bfloat16
METHODS = (
    "cublas",
    "skinny",
    "invariant",
    "cublas+fusions",
    "invariant+fused",
    "invariant+norm_kernels",
)
STREAM_BYTES = 1 << 30  # weight copies per graph: at least this much (L2 is 50-60 MiB)


def methods(name: str):
    fp32 = name == "lm_head"  # logits are written in float32 on every path

    def cublas(x, w):
        return torch.mm(x, w.t(), torch.float32) if fp32 else F.linear(x, w)

    def skinny(x, w):
        return skinny_linear(x, w, out_dtype=torch.float32 if fp32 else None)

    def invariant(x, w):
        return invariant_linear(x, w, out_dtype=torch.float32 if fp32 else None)

    return {"cublas": cublas, "skinny": skinny, "invariant": invariant}


def fused_methods(name: str, m: int, n: int, k: int):
    """Each shape with the work the engine fuses around it (model/layers.py): RMSNorm before
    qkv and gate_up, SiLU-and-mul before down (its input is [M, 2K]), the residual add after o
    and down, float32 logits. fn(x, w) -> y, x of `x_width(k)` columns; per method: the engine's
    F.linear path (cuBLAS beside the fused norm kernels, the residual in the GEMM), the
    batch-invariant GEMM with the work in its prologue / epilogue, and the batch-invariant GEMM
    beside the same norm kernels as cuBLAS."""
    from specserve.ops.triton_norm import rmsnorm, silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(1)
    norm = torch.rand(k, device="cuda", dtype=DTYPE, generator=g) + 0.5
    residual = torch.randn(m, n, device="cuda", dtype=DTYPE, generator=g)
    fp32 = torch.float32 if name == "lm_head" else None
    uses_norm, uses_silu, uses_res = (
        name in ("qkv", "gate_up"),
        name == "down",
        name in ("o", "down"),
    )

    def pre(x):  # the elementwise kernel before the GEMM on the unfused paths
        if uses_norm:
            return rmsnorm(x, norm, 1e-5)
        return silu_and_mul(x) if uses_silu else x

    def cublas(x, w):
        x = pre(x)
        if fp32:
            return torch.mm(x, w.t(), torch.float32)
        return torch.addmm(residual, x, w.t()) if uses_res else F.linear(x, w)

    def invariant_fused(x, w):
        return invariant_linear(
            x, w, norm_weight=norm if uses_norm else None, eps=1e-5, silu_mul=uses_silu,
            residual=residual if uses_res else None, out_dtype=fp32,
        )  # fmt: skip

    def invariant_beside(x, w):
        return invariant_linear(pre(x), w, residual=residual if uses_res else None, out_dtype=fp32)

    return {
        "cublas+fusions": cublas,
        "invariant+fused": invariant_fused,
        "invariant+norm_kernels": invariant_beside,
    }


def x_width(name: str, k: int) -> int:
    return 2 * k if name == "down" else k  # (SiLU-and-mul halves it)


def events_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def read_ceiling(reps: int) -> dict:
    big = torch.ones(2 << 30, dtype=DTYPE, device="cuda")  # 4 GiB
    dst = torch.empty_like(big)
    nbytes = big.numel() * big.element_size()
    sum_ms = events_ms(lambda: big.sum(dtype=torch.float32), reps)
    copy_ms = events_ms(lambda: dst.copy_(big), reps)
    return {
        "sum_read_GBps": nbytes / sum_ms / 1e6,
        "copy_read_write_GBps": 2 * nbytes / copy_ms / 1e6,
    }


def graph_of(fn, xs, ws):
    """One CUDA graph calling fn over every weight copy in turn (warmed up first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x, w in zip(xs, ws):
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x, w) for x, w in zip(xs, ws)]
    return graph, outs


def bench_shape(name, n, k, ms, reps, ceiling, fused=False) -> list[dict]:
    wbytes = n * k * 2
    copies = max(2, -(-STREAM_BYTES // wbytes))
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [
        torch.randn(n, k, device="cuda", dtype=DTYPE, generator=g) * k**-0.5 for _ in range(copies)
    ]
    rows = []
    for m in ms:
        xs = [torch.randn(m, k, device="cuda", dtype=DTYPE, generator=g) for _ in range(copies)]
        ref = xs[0].float() @ ws[0].float().t()
        out_dtype = torch.float32 if name == "lm_head" else None
        alone = invariant_linear(xs[0][:1], ws[0], out_dtype=out_dtype)
        for method, fn in methods(name).items():
            graph, outs = graph_of(fn, xs, ws)
            graph.replay()
            torch.cuda.synchronize()
            err = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
            t_ms = events_ms(graph.replay, reps) / copies
            gbps = wbytes / t_ms / 1e6
            row = {
                "shape": name, "N": n, "K": k, "M": m, "method": method,
                "us": 1e3 * t_ms, "weight_GBps": gbps,
                "fraction_of_read_ceiling": gbps / ceiling, "max_rel_err": err,
            }  # fmt: skip
            if method == "invariant":
                row["row0_same_bits_as_alone"] = bool(torch.equal(outs[0][:1], alone))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del graph, outs
        if fused:
            wide = [
                torch.randn(m, x_width(name, k), device="cuda", dtype=DTYPE, generator=g)
                for _ in range(copies)
            ]
            for method, fn in fused_methods(name, m, n, k).items():
                graph, outs = graph_of(fn, wide, ws)
                t_ms = events_ms(graph.replay, reps) / copies
                gbps = wbytes / t_ms / 1e6
                row = {
                    "shape": name, "N": n, "K": k, "M": m, "method": method,
                    "us": 1e3 * t_ms, "weight_GBps": gbps,
                    "fraction_of_read_ceiling": gbps / ceiling,
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
                del graph, outs
            del wide
        del xs
    del ws
    torch.cuda.empty_cache()
    return rows


def tune_candidates(n: int, k: int) -> list[InvariantConfig]:
    out = []
    for bn in (16, 32, 64):
        for bk in (128, 256, 512):
            for stages in (2, 3, 4, 5):
                if stages * (bn + 16) * bk * 2 > 160 * 1024:  # W and x tiles in shared memory
                    continue
                for warps in (4, 8) if bn * bk >= 64 * 256 else (4,):
                    out.append(InvariantConfig(bn, bk, warps, stages))
    return out


def tune_shape(name, n, k, ms, reps) -> dict:
    """Time every candidate tile at every M; the winner is the best summed relative time."""
    wbytes = n * k * 2
    copies = max(2, -(-STREAM_BYTES // wbytes))
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=DTYPE, generator=g) for _ in range(copies)]
    out_dtype = torch.float32 if name == "lm_head" else None
    times: dict[InvariantConfig, dict[int, float]] = {}
    for m in ms:
        xs = [torch.randn(m, k, device="cuda", dtype=DTYPE, generator=g) for _ in range(copies)]
        for cfg in tune_candidates(n, k):

            def fn(x, w, cfg=cfg):
                return invariant_linear(x, w, out_dtype=out_dtype, config=cfg)

            try:
                graph, _ = graph_of(fn, xs, ws)
                times.setdefault(cfg, {})[m] = events_ms(graph.replay, reps) / copies
            except Exception as e:  # out of shared memory or registers: not a candidate
                print(f"# {name} M={m} {cfg}: {type(e).__name__}", flush=True)
                times.setdefault(cfg, {})[m] = float("inf")
    best_at = {m: min(t[m] for t in times.values()) for m in ms}
    score = {cfg: sum(t[m] / best_at[m] for m in ms) for cfg, t in times.items()}
    win = min(score, key=score.get)
    rec = {
        "shape": name, "N": n, "K": k, "score": score[win],
        "config": (win.block_n, win.block_k, win.num_warps, win.num_stages),
        "us": {m: 1e3 * times[win][m] for m in ms},
        "weight_GBps": {m: wbytes / times[win][m] / 1e6 for m in ms},
        "best_us_any_config": {m: 1e3 * best_at[m] for m in ms},
    }  # fmt: skip
    print(json.dumps(rec), flush=True)
    return rec


def step_totals(rows: list[dict], ms: list[int]) -> list[dict]:
    """The 8B step's matmuls per method and M: time and the tok/s it alone allows."""
    layers = {name: count for name, _, _, count in SHAPES}
    out = []
    for m in ms:
        for method in METHODS:
            sel = [r for r in rows if r["M"] == m and r["method"] == method]
            if len(sel) != len(SHAPES):
                continue
            step_ms = sum(r["us"] * layers[r["shape"]] for r in sel) / 1e3
            out.append({"M": m, "method": method, "step_ms": step_ms, "tok_s": m * 1e3 / step_ms})
    return out


def table(rows: list[dict], keys: list[str]) -> None:
    print(" | ".join(keys))
    print(" | ".join("---" for _ in keys))
    for r in rows:
        cells = [r.get(k, "") for k in keys]
        print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in cells))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ms", default="1,2,4,8,16,32,64", help="rows (tokens) per matmul")
    p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    p.add_argument("--reps", type=int, default=20, help="graph replays timed per case")
    p.add_argument("--json", help="also write everything to this file")
    p.add_argument(
        "--fused",
        action="store_true",
        help="also each shape with the norm / SiLU-and-mul / residual / fp32 work the engine "
        "fuses around it, per path",
    )
    p.add_argument("--tune", action="store_true", help="sweep the batch-invariant GEMM's tiles")
    p.add_argument("--tune-ms", default="1,16,64", help="rows the tile must serve (--tune)")
    args = p.parse_args()
    require_cuda(__file__)
    ms = [int(v) for v in args.ms.split(",")]
    wanted = set(args.shapes.split(","))
    warm_up_clocks()
    if args.tune:
        tune_ms = [int(v) for v in args.tune_ms.split(",")]
        recs = [tune_shape(nm, n, k, tune_ms, args.reps) for nm, n, k, _ in SHAPES if nm in wanted]
        if args.json:
            Path(args.json).write_text(json.dumps(recs, indent=2))
        print("\nINVARIANT_GEMM_TILES entries for specserve/config/kernels.py:")
        for r in recs:
            print(f"    ({r['N']}, {r['K']}): {tuple(r['config'])},  # {r['shape']}")
        return 0
    ceil = read_ceiling(args.reps)
    torch.cuda.empty_cache()  # the 8 GiB of the ceiling's tensors
    print(json.dumps({"read_ceiling": ceil, "device": torch.cuda.get_device_name()}), flush=True)
    ceiling = max(ceil.values())
    rows = []
    for name, n, k, _ in SHAPES:
        if name in wanted:
            rows += bench_shape(name, n, k, ms, args.reps, ceiling, args.fused)
    totals = step_totals(rows, ms)
    result = {"device": torch.cuda.get_device_name(), "read_ceiling": ceil, "kernels": rows,
              "step_matmuls": totals}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    print(f"\nread ceiling: {ceiling / 1e3:.2f} TB/s ({ceil})\n")
    keys = ["shape", "M", "method", "us", "weight_GBps", "fraction_of_read_ceiling", "max_rel_err",
            "row0_same_bits_as_alone"]  # fmt: skip
    table(rows, keys)
    print()
    table(totals, ["M", "method", "step_ms", "tok_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
