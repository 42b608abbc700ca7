"""Skinny Triton GEMM against torch's F.linear on Llama-3-8B and SmolLM2-135M shapes (bf16).

    python3 bench/linear_kernels.py [--json out.jsonl] [--quick] [--no-stack]
    python3 bench/linear_kernels.py --tune [--tune-ms 1,4,16] [--tune-shapes 8b,smol] [--out DIR]

Default run (< 2 minutes on an H200):
1. every linear shape x M in {1, 2, 4, 8, 16, 32}: F.linear and `skinny_linear` timed with
   triton.testing.do_bench (median; L2 flushed before each call, so W comes from HBM),
   random non-zero inputs, max relative error of each against an fp32 reference; GB/s counts
   W + x + y bytes.
2. the 8B matmul stack (32 x qkv, o, gate_up, down + lm_head), each way, replayed from one
   CUDA graph: matmul time per decode step and its tok/s equivalent (torch: 4.07-4.39 ms
   at M = 1 on an H200, by machine).
3. the real model code (specserve.model.llama, 8B preset, random weights, attention replaced
   by a stub) in one CUDA graph per kernel mode (`MODE_NAMES`).
JSON lines as it goes; tables last.

--tune sweeps kernel configs per (M bucket, N, K) and prints the best as `TUNED` entries
for specserve/ops/triton_linear.py (and writes them as JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.script_checks import require_cuda  # noqa: E402
from specserve.bench.gpu_timing import captured  # noqa: E402

SHAPES = [  # (name, N, K)
    ("8b.qkv", 6144, 4096),
    ("8b.o", 4096, 4096),
    ("8b.gate_up", 28672, 4096),
    ("8b.down", 4096, 14336),
    ("8b.lm_head", 128256, 4096),
    ("smol.qkv", 960, 576),
    ("smol.gate_up", 3072, 576),
    ("smol.down", 576, 1536),
    ("smol.lm_head", 49152, 576),
]
MS = [1, 2, 4, 8, 16, 32]
DTYPE = torch.bfloat16
ERR_LIMIT = 1e-2  # max |y - ref| / max |ref|; bf16 output rounding alone is ~4e-3


def emit(rec: dict, sink) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if sink is not None:
        sink.write(line + "\n")


def max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def bench_ms(fn, args) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def kernels(args, sink) -> list[dict]:
    import torch.nn.functional as F

    from specserve.ops.triton_linear import pick_config, skinny_linear

    rows = []
    for si, (name, n, k) in enumerate(SHAPES):
        g = torch.Generator(device="cuda").manual_seed(si)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(DTYPE)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(DTYPE)
            ref = x.float() @ w.float().T
            y_t, y_s = F.linear(x, w), skinny_linear(x, w)
            err_t, err_s = max_rel_err(y_t, ref), max_rel_err(y_s, ref)
            t_torch = bench_ms(lambda x=x, w=w: F.linear(x, w), args)
            t_skinny = bench_ms(lambda x=x, w=w: skinny_linear(x, w), args)
            nbytes = (n * k + m * k + m * n) * 2
            cfg = pick_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
            rec = dict(
                kind="linear", shape=name, M=m, N=n, K=k,
                torch_us=round(t_torch * 1e3, 2), triton_us=round(t_skinny * 1e3, 2),
                torch_GBps=round(nbytes / t_torch / 1e6, 1),
                triton_GBps=round(nbytes / t_skinny / 1e6, 1),
                speedup=round(t_torch / t_skinny, 3),
                err_torch=round(err_t, 5), err_triton=round(err_s, 5),
                ok=err_s < ERR_LIMIT, config=cfg.__dict__,
            )  # fmt: skip
            emit(rec, sink)
            rows.append(rec)
    return rows


def matmul_stack(args, sink, weights, m: int) -> list[dict]:
    """32 x (qkv, o, gate_up, down) + lm_head on fixed inputs, one CUDA graph per way."""
    import torch.nn.functional as F

    from specserve.ops.triton_linear import skinny_linear

    g = torch.Generator(device="cuda").manual_seed(123)
    inputs = {k: torch.randn(m, k, device="cuda", generator=g).to(DTYPE) for k in (4096, 14336)}
    ways = {
        "torch": F.linear,
        "triton": skinny_linear,
        # programmatic dependent launch: each matmul starts loading its weight while the
        # previous one finishes (Hopper and later)
        "triton_pdl": lambda x, w: skinny_linear(x, w, pdl=True),
    }
    rows = []
    for way, lin in ways.items():

        def step(lin=lin):
            outs = []
            for layer in weights["layers"]:
                for w in layer:
                    outs.append(lin(inputs[w.shape[1]], w))
            outs.append(lin(inputs[4096], weights["lm_head"]))
            return outs

        graph, _ = captured(step)
        ms = bench_ms(graph.replay, args)
        nbytes = sum(w.numel() * 2 for layer in weights["layers"] for w in layer)
        nbytes += weights["lm_head"].numel() * 2
        rec = dict(
            kind="matmul_stack", way=way, M=m, ms=round(ms, 4),
            weight_TBps=round(nbytes / ms / 1e9, 3), tok_s=round(m * 1e3 / ms, 1),
        )  # fmt: skip
        emit(rec, sink)
        rows.append(rec)
        del graph
    return rows


class _StubContext:
    """The model's own code path minus attention: rotary + K/V write run as in the engine
    (the fused kernel when Triton is there), attention itself is replaced by 'return q'."""

    capture_layers = frozenset()
    kernels = None  # set per measured mode

    def __init__(self, cfg, m: int):
        from types import SimpleNamespace

        from specserve.kv.pool import KVCache

        self.kv_cache = KVCache(cfg.num_layers, m, cfg.num_kv_heads, cfg.head_dim, DTYPE, "cuda")
        self.meta = SimpleNamespace(out_cache_loc=torch.arange(m, device="cuda"))
        try:
            import specserve.ops.triton_rope  # noqa: F401

            self.fused_rope_write = True
        except ImportError:
            self.fused_rope_write = False

    packed = None

    @property
    def write_slots(self) -> torch.Tensor:
        return self.meta.out_cache_loc

    def attention(self, layer_id, q, k, v):
        return q


def build_model(preset: str = "llama3-8b"):
    from specserve.model.config import PRESETS
    from specserve.model.llama import LlamaForCausalLM
    from specserve.model.loader import random_init_
    from specserve.model.rope import rope_inv_freq

    cfg = PRESETS[preset]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cuda").to(DTYPE)
    for mod in model.modules():
        if hasattr(mod, "inv_freq"):
            mod.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).cuda()
    random_init_(model, seed=0)
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval().requires_grad_(False)


# the model-code modes measured: torch ops; F.linear + fused elementwise kernels; the skinny
# GEMM with norm / SiLU-mul / residual fused in, at every hidden size; the same launched with
# programmatic dependent launch
MODE_NAMES = {
    0: "plain torch",
    1: "F.linear + fused elementwise",
    2: "skinny GEMM, fused",
    3: "skinny GEMM, fused, programmatic launch",
}


def mode_kernels(mode: int, max_tokens: int = 1):
    """The Kernels of a MODE_NAMES entry (the skinny GEMM up to max_tokens rows)."""
    from specserve.config import Kernels

    return Kernels(
        skinny_gemm=mode >= 2,
        skinny_gemm_max_tokens=max_tokens,
        skinny_gemm_max_hidden=1 << 20,  # every width: the 8B shape is what is measured
        programmatic_launch=mode == 3,
        fused_norms=mode >= 1,
        fp32_logits=True,
    )


def model_stack(args, sink, model, m: int) -> list[dict]:
    from specserve.model.layers import fused_mode

    ids = torch.randint(0, model.config.vocab_size, (m,), device="cuda")
    pos = torch.arange(100, 100 + m, device="cuda")
    ctx = _StubContext(model.config, m)
    rows, logits = [], {}
    for mode in MODE_NAMES:
        ctx.kernels = kernels = mode_kernels(mode)

        def step(kernels=kernels):
            out = model(ids, pos, ctx)
            return model.compute_logits(out.hidden, kernels)

        with torch.inference_mode():
            x = torch.zeros(m, model.config.hidden_size, device="cuda", dtype=DTYPE)
            got = fused_mode(x, kernels)
            graph, out = captured(step)
            logits[mode] = out.clone()
        ms = bench_ms(graph.replay, args)
        err = max_rel_err(logits[mode], logits[0]) if mode else 0.0
        rec = dict(
                kind="model_stack", mode=mode, active_mode=got, M=m, ms=round(ms, 4),
                tok_s=round(m * 1e3 / ms, 1), max_rel_err_vs_mode0=round(err, 5),
                same_argmax=float((logits[mode].argmax(-1) == logits[0].argmax(-1)).float().mean()),
            )  # fmt: skip
        emit(rec, sink)
        rows.append(rec)
        del graph
    return rows


# ---------------------------------------------------------------------------------------------
# tuning


def candidates(m: int, n: int, k: int, sms: int):
    """The heuristic's pick first, then a small grid around it (a few dozen compiles)."""
    import triton

    from specserve.ops.triton_linear import LinearConfig, pick_config

    out = [pick_config(m, n, k, sms)]
    if m == 1:
        for bn, bk, w in [
            (2, 512, 1),
            (4, 512, 2),
            (4, 1024, 4),
            (8, 512, 4),
            (8, 1024, 8),
            (16, 512, 8),
        ]:
            if bk > max(16, triton.next_power_of_2(k)):
                continue
            out.append(LinearConfig("fma", bn, bk, 1, w, 1))
            if triton.cdiv(n, bn) < sms and k >= 8 * bk:
                out.append(LinearConfig("fma", bn, bk, 4, w, 1))
    bm = min(64, max(16, triton.next_power_of_2(m)))
    # At one row the tensor cores only carry W through a cp.async pipeline: deeper pipelines
    # (more W bytes in flight per SM) and wider tiles are what may beat cuBLAS there.
    if m == 1:
        stages = [(256, 4), (128, 4), (128, 6), (256, 6), (128, 8)]
        tiles_n = (32, 64, 128)
    else:
        stages = [(256, 4), (256, 3), (128, 4), (128, 6)]
        tiles_n = (16, 32, 64)
    for bn in tiles_n:
        for bk, st in stages:
            if st * (bn + bm) * bk * 2 > 200 * 1024:
                continue
            for warps in (4, 8) if m == 1 and bn >= 64 else (4,):
                out.append(LinearConfig("dot", bn, bk, 1, warps, st, bm))
                if triton.cdiv(n, bn) * triton.cdiv(m, bm) < sms and k >= 8 * bk:
                    for sp in (2,) if m == 1 else (2, 4):
                        out.append(LinearConfig("dot", bn, bk, sp, warps, st, bm))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def tune(args, sink) -> None:
    import torch.nn.functional as F

    from specserve.ops.triton_linear import m_bucket, skinny_linear

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [s for s in SHAPES if s[0].split(".")[0] in args.tune_shapes]
    best_all = []
    t0 = time.time()
    for si, (name, n, k) in enumerate(shapes):
        g = torch.Generator(device="cuda").manual_seed(si)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(DTYPE)
        for m in args.tune_ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(DTYPE)
            ref = x.float() @ w.float().T
            t_torch = bench_ms(lambda x=x, w=w: F.linear(x, w), args)
            results = []
            for cfg in candidates(m, n, k, sms):
                try:
                    y = skinny_linear(x, w, config=cfg)
                    err = max_rel_err(y, ref)
                    t = bench_ms(lambda x=x, w=w, c=cfg: skinny_linear(x, w, config=c), args)
                except Exception as e:  # a config that does not compile / fit: skip it
                    emit(dict(kind="tune_fail", shape=name, M=m, config=cfg.__dict__,
                              error=repr(e)[:200]), sink)  # fmt: skip
                    continue
                if err >= ERR_LIMIT:
                    emit(
                        dict(kind="tune_wrong", shape=name, M=m, config=cfg.__dict__, err=err), sink
                    )
                    continue
                results.append((t, cfg))
            if not results:
                emit(dict(kind="tune_none", shape=name, M=m), sink)
                continue
            results.sort(key=lambda r: r[0])
            t_best, best = results[0]
            default = candidates(m, n, k, sms)[0]
            t_default = next((t for t, c in results if c == default), float("nan"))
            nbytes = (n * k + m * k + m * n) * 2
            rec = dict(
                kind="tune", shape=name, M=m, N=n, K=k, m_bucket=m_bucket(m),
                torch_us=round(t_torch * 1e3, 2), default_us=round(t_default * 1e3, 2),
                best_us=round(t_best * 1e3, 2), best_GBps=round(nbytes / t_best / 1e6, 1),
                best=best.__dict__,
                top5=[(round(t * 1e3, 2), c.__dict__) for t, c in results[:5]],
            )  # fmt: skip
            emit(rec, sink)
            best_all.append(rec)
    print(
        f"\n# tuned in {time.time() - t0:.0f} s; paste into TUNED in specserve/ops/triton_linear.py"
    )
    print("TUNED = {")
    for r in best_all:
        b = r["best"]
        extra = f", prefetch={b['prefetch']}" if b["kind"] == "fma" else f", block_m={b['block_m']}"
        print(
            f'    ({r["m_bucket"]}, {r["N"]}, {r["K"]}): LinearConfig("{b["kind"]}", '
            f"{b['block_n']}, {b['block_k']}, split_k={b['split_k']}, num_warps={b['num_warps']}, "
            f"num_stages={b['num_stages']}{extra}),  # {r['shape']} M={r['M']}: {r['best_us']} us "
            f"({r['best_GBps']} GB/s), default {r['default_us']}, torch {r['torch_us']}"
        )
    print("}")
    if args.out:
        path = Path(args.out) / "linear_tuned.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                [dict(m=r["m_bucket"], n=r["N"], k=r["K"], **r["best"]) for r in best_all], indent=1
            )
        )
        print(f"# written {path}")


# ---------------------------------------------------------------------------------------------


def print_tables(lin_rows, stack_rows, model_rows) -> None:
    if lin_rows:
        print(
            "\n| shape | M | torch us | triton us | torch GB/s | triton GB/s | speed-up | err triton | config |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in lin_rows:
            c = r["config"]
            cs = f"{c['kind']} bn{c['block_n']} bk{c['block_k']} s{c['split_k']} w{c['num_warps']}"
            flag = "" if r["ok"] else " FAIL"
            print(
                f"| {r['shape']} | {r['M']} | {r['torch_us']} | {r['triton_us']} | "
                f"{r['torch_GBps']} | {r['triton_GBps']} | {r['speedup']}x | "
                f"{r['err_triton']:.1e}{flag} | {cs} |"
            )
        by_m: dict[int, list[float]] = {}
        for r in lin_rows:
            if r["shape"].startswith("8b"):
                by_m.setdefault(r["M"], []).append(r["speedup"])
        print(
            "\n8B shapes, geometric-mean speed-up by M (pick SKINNY_MAX_TOKENS where it stays > 1):"
        )
        for m, s in sorted(by_m.items()):
            gm = 1.0
            for v in s:
                gm *= v
            print(f"  M={m}: {gm ** (1 / len(s)):.3f}x")
    if stack_rows:
        print("\n| 8B matmul stack (CUDA graph) | M | ms / step | weight TB/s | tok/s |")
        print("|---|---|---|---|---|")
        for r in stack_rows:
            print(f"| {r['way']} | {r['M']} | {r['ms']} | {r['weight_TBps']} | {r['tok_s']} |")
    if model_rows:
        print(
            "\n| 8B model code, no attention (CUDA graph) | M | ms / step | tok/s | rel err vs torch | same argmax |"
        )
        print("|---|---|---|---|---|---|")
        for r in model_rows:
            print(
                f"| {r['mode']}: {MODE_NAMES[r['mode']]} (active {r['active_mode']}) | {r['M']} | "
                f"{r['ms']} | {r['tok_s']} | {r['max_rel_err_vs_mode0']:.1e} | {r['same_argmax']:.3f} |"
            )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", help="also write the JSON lines here")
    p.add_argument("--quick", action="store_true", help="M in {1, 16} only, shorter timing")
    p.add_argument("--no-stack", action="store_true", help="skip the 8B stacks")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=40, help="do_bench repetition time, ms")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--tune-ms", default="1,4,16")
    p.add_argument("--tune-shapes", default="8b,smol")
    p.add_argument("--out", help="folder for linear_tuned.json (--tune)")
    args = p.parse_args()
    args.ms = [int(v) for v in args.ms.split(",")]
    args.tune_ms = [int(v) for v in args.tune_ms.split(",")]
    args.tune_shapes = args.tune_shapes.split(",")
    if args.quick:
        args.ms, args.rep = [1, 16], 20
    require_cuda(__file__)
    import triton

    props = torch.cuda.get_device_properties(0)
    print(
        f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}",
        flush=True,
    )
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115
    t0 = time.time()
    try:
        if args.tune:
            tune(args, sink)
            return 0
        lin_rows = kernels(args, sink)
        print(f"# kernels done in {time.time() - t0:.0f} s", flush=True)
        stack_rows, model_rows = [], []
        if not args.no_stack:
            model = build_model()
            weights = {
                "layers": [
                    [
                        layer.self_attn.qkv_proj.weight,
                        layer.self_attn.o_proj.weight,
                        layer.mlp.gate_up_proj.weight,
                        layer.mlp.down_proj.weight,
                    ]
                    for layer in model.model.layers
                ],
                "lm_head": model.lm_head_weight,
            }
            for m in (1, 16):
                stack_rows += matmul_stack(args, sink, weights, m)
            for m in (1, 16):
                model_rows += model_stack(args, sink, model, m)
        print(f"# done in {time.time() - t0:.0f} s", flush=True)
        print_tables(lin_rows, stack_rows, model_rows)
        bad = [r for r in lin_rows if not r["ok"]]
        if bad:
            print(f"\n{len(bad)} cases over the error limit {ERR_LIMIT}")
            return 1
        return 0
    finally:
        if sink is not None:
            sink.close()


if __name__ == "__main__":
    sys.exit(main())
