"""Linear layers at speculative-decoding sizes (a tree verify of ~48 tokens, a draft depth of 8)
on a small model: cuBLAS with the separate elementwise kernels against the skinny Triton GEMM
with RMSNorm / SiLU-and-mul / residual fused in, per shape over a sweep of `dot` configs and
then through the model's own layer code (fused modes 1 and 2). Everything replays from CUDA
graphs with L2 flushed before each replay, so weights come from HBM as in a real step.

    python3 bench/layer_stack.py [--preset smollm2-135m] [--ms 8,48] [--json out.jsonl] [--out DIR]

1. per shape (qkv with its norm, o with its residual, gate_up with its norm, down with SiLU-mul
   and residual, lm_head with fp32 logits): one graph runs the op over `--copies` distinct
   weights (like the layers of a step); µs per op for the torch way (the elementwise kernel
   and F.linear, as fused mode 1 runs them) and for each config of the skinny GEMM.
2. the model (random weights, attention replaced by 'return q'; rotary + KV write as in the
   engine) in one graph: plain torch, mode 1 and mode 2 (the skinny GEMM's heuristic
   configs); max relative error of the logits against plain torch.
`--out DIR` writes the per-shape winners as linear_tuned.json (entries to paste into
`TUNED` in specserve/ops/triton_linear.py).
JSON lines as it goes; tables last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from linear_kernels import (  # noqa: E402
    DTYPE,
    _StubContext,
    build_model,
    emit,
    max_rel_err,
    mode_kernels,
)

from bench.script_checks import require_cuda  # noqa: E402
from specserve.bench.gpu_timing import captured  # noqa: E402


def bench_us(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton

    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def dot_configs(m: int):
    from specserve.ops.triton_linear import LinearConfig

    bm = min(64, max(16, 1 << (m - 1).bit_length()))
    out = []
    for bn in (16, 32, 64):
        for bk, stages in ((64, 3), (64, 4), (128, 3)):
            out.append(LinearConfig("dot", bn, bk, 1, 4, stages, bm))
    out.append(LinearConfig("dot", 16, 64, 1, 2, 3, bm))
    out.append(LinearConfig("dot", 16, 64, 2, 4, 3, bm))
    out.append(LinearConfig("dot", 32, 64, 2, 4, 3, bm))
    return out


def shape_ops(cfg, m: int, copies: int):
    """name -> (n, k, torch_fn(i), skinny_fn(i, config)) for the model's fused linear ops."""
    import torch.nn.functional as F

    from specserve.ops.triton_linear import skinny_linear
    from specserve.ops.triton_norm import add_rmsnorm, silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(7)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(DTYPE)

    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv_n = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    x, res, nw = randn(m, h), randn(m, h), randn(h, scale=0.1) + 1
    gu = randn(m, 2 * inter)
    attn_out = randn(m, cfg.num_heads * cfg.head_dim)
    ops = {}

    def add(name, n, k, torch_fn, skinny_fn):
        ws = [randn(n, k, scale=0.02) for _ in range(copies)]
        ops[name] = (n, k, lambda c=None: [torch_fn(w) for w in ws],
                     lambda c: [skinny_fn(w, c) for w in ws])  # fmt: skip

    # mode 1: the norm before qkv / gate_up is add_rmsnorm (the residual add rides in it)
    add("qkv+norm", qkv_n, h, lambda w: F.linear(add_rmsnorm(res, x, nw, 1e-5)[1], w),
        lambda w, c: skinny_linear(x, w, norm_weight=nw, eps=1e-5, config=c))  # fmt: skip
    add("o+residual", h, cfg.num_heads * cfg.head_dim, lambda w: F.linear(attn_out, w),
        lambda w, c: skinny_linear(attn_out, w, residual=res, config=c))  # fmt: skip
    add("gate_up+norm", 2 * inter, h, lambda w: F.linear(add_rmsnorm(res, x, nw, 1e-5)[1], w),
        lambda w, c: skinny_linear(x, w, norm_weight=nw, eps=1e-5, config=c))  # fmt: skip
    add("down+silu+residual", h, inter, lambda w: F.linear(silu_and_mul(gu), w),
        lambda w, c: skinny_linear(gu, w, silu_mul=True, residual=res, config=c))  # fmt: skip
    lm = randn(cfg.vocab_size, h, scale=0.02)
    ops["lm_head"] = (cfg.vocab_size, h, lambda c=None: [F.linear(x, lm).float()],
                      lambda c: [skinny_linear(x, lm, out_dtype=torch.float32, config=c)])  # fmt: skip
    return ops


def per_shape(args, sink, cfg, m: int) -> list[dict]:
    from specserve.ops.triton_linear import pick_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (n, k, torch_fn, skinny_fn) in shape_ops(cfg, m, args.copies).items():
        copies = 1 if name == "lm_head" else args.copies
        t_torch = bench_us(captured(torch_fn)[0].replay) / copies
        heuristic = pick_config(m, n, k, sms)
        results = []
        for c in [heuristic] + dot_configs(m):
            try:
                t = bench_us(captured(lambda c=c, f=skinny_fn: f(c))[0].replay) / copies
            except Exception as e:  # a config that does not compile or fit: say so, go on
                emit(dict(kind="config_failed", shape=name, M=m, config=c.__dict__,
                          error=repr(e)[:200]), sink)  # fmt: skip
                continue
            results.append((t, c))
        if not results:
            emit(dict(kind="shape_failed", shape=name, M=m), sink)
            continue
        t_heur = results[0][0] if results[0][1] == heuristic else float("nan")
        results.sort(key=lambda r: r[0])
        t_best, best = results[0]
        rec = dict(
            kind="shape", shape=name, M=m, N=n, K=k, torch_us=round(t_torch, 2),
            heuristic_us=round(t_heur, 2), best_us=round(t_best, 2), best=best.__dict__,
            top3=[(round(t, 2), c.__dict__) for t, c in results[:3]],
        )  # fmt: skip
        emit(rec, sink)
        rows.append(rec)
    return rows


def model_stack(args, sink, model, m: int) -> list[dict]:
    ids = torch.randint(0, model.config.vocab_size, (m,), device="cuda")
    pos = torch.arange(100, 100 + m, device="cuda")
    ctx = _StubContext(model.config, m)
    ways = [("plain torch", 0), ("mode 1: F.linear + fused elementwise", 1),
            ("mode 2: skinny GEMM", 2)]  # fmt: skip
    rows, ref = [], None
    for label, mode in ways:
        ctx.kernels = kernels = mode_kernels(mode, max_tokens=max(m, 1))

        def step(kernels=kernels):
            return model.compute_logits(model(ids, pos, ctx).hidden, kernels)

        with torch.inference_mode():
            graph, out = captured(step)
            logits = out.float().clone()
        us = bench_us(graph.replay)
        if ref is None:
            ref = logits
        rec = dict(
            kind="model", way=label, M=m, us=round(us, 1),
            max_rel_err_vs_torch=round(max_rel_err(logits, ref), 5),
            same_argmax=round(float((logits.argmax(-1) == ref.argmax(-1)).float().mean()), 3),
        )  # fmt: skip
        emit(rec, sink)
        rows.append(rec)
        del graph
    return rows


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--ms", default="8,48", help="token counts (rows of x)")
    p.add_argument("--copies", type=int, default=30, help="distinct weights per shape graph")
    p.add_argument("--json", help="also write the JSON lines here")
    p.add_argument("--out", help="folder for linear_tuned.json (per-shape winners)")
    args = p.parse_args()
    require_cuda(__file__)
    from specserve.ops.triton_linear import LinearConfig, m_bucket

    ms = [int(v) for v in args.ms.split(",")]
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115
    t0 = time.time()
    model = build_model(args.preset)
    shape_rows, model_rows, tuned_json = [], [], []
    try:
        for m in ms:
            rows = per_shape(args, sink, model.config, m)
            shape_rows += rows
            for r in rows:
                c = LinearConfig(**r["best"])
                tuned_json.append(dict(m=m_bucket(m), n=r["N"], k=r["K"], **c.__dict__))
            model_rows += model_stack(args, sink, model, m)
            print(f"# M={m} done at {time.time() - t0:.0f} s", flush=True)
    finally:
        if sink is not None:
            sink.close()
    if args.out:
        path = Path(args.out) / "linear_tuned.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(tuned_json, indent=1))
    print("\n| shape | M | N | K | torch µs | skinny heuristic µs | skinny best µs | best config |")
    print("|---|---|---|---|---|---|---|---|")
    for r in shape_rows:
        b = r["best"]
        cs = f"bn{b['block_n']} bk{b['block_k']} s{b['split_k']} w{b['num_warps']} st{b['num_stages']}"
        print(f"| {r['shape']} | {r['M']} | {r['N']} | {r['K']} | {r['torch_us']} | "
              f"{r['heuristic_us']} | {r['best_us']} | {cs} |")  # fmt: skip
    print(
        f"\n| {args.preset} layers + lm_head, no attention (CUDA graph) | M | µs | rel err | same argmax |"
    )
    print("|---|---|---|---|---|")
    for r in model_rows:
        print(f"| {r['way']} | {r['M']} | {r['us']} | {r['max_rel_err_vs_torch']:.1e} | "
              f"{r['same_argmax']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
