"""Whether prefetching the next matmul's weight into L2, while a layer's small kernels run,
takes time off a batch-1 decode step at the Llama-3-8B shape.

At batch 1 a step streams 15 GB of weights, but between the matmuls come kernels that read
almost nothing (RMSNorm, attention over a short context, SiLU-and-mul): the memory bus
idles for their whole length, 0.4-0.7 ms of a 4.8 ms step. A bulk L2 prefetch
(`cp.async.bulk.prefetch.L2.global`, sm_90) issued just before them lets the bus fetch the
head of the next weight meanwhile; the matmul then reads that head from L2.

The step is built from the engine's own kernels (add_rmsnorm, silu_and_mul: ops/triton_norm.py;
cuBLAS matmuls; SDPA over a per-layer KV cache as the attention) over 32 layers of distinct
weights, captured in one CUDA graph per variant, replayed in turns (A, B, C, A, B, C, ...)
and timed with CUDA events:
- `base`: the step as the engine runs it;
- `prefetch-N`: the same, each small kernel preceded by a prefetch of the next weight's
  first N MiB (one extra launch, which returns once the prefetches are issued);
- `matmuls-only`: the matmuls alone, the floor the small kernels' time sits on.
Every variant's logits are checked to be bit-identical to `base` (a prefetch is a hint).

    python3 bench/l2_prefetch_decoder.py [--mib 8,16,32] [--context 512] [--rounds 5]

Prints JSON, then a table. Needs an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.script_checks import NOT_HERE_EXIT, require_cuda  # noqa: E402
from specserve.ops.triton_norm import add_rmsnorm, silu_and_mul  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 4096, 32, 8, 128, 14336, 128256, 32
PREFETCH_CHUNK = 16384  # bytes per bulk prefetch instruction (a multiple of 16)


@triton.jit
def _l2_prefetch_kernel(base, n_chunks, BLOCK: tl.constexpr):
    # One bulk prefetch of 16 KiB per lane; the kernel ends once they are issued, the copies
    # into L2 go on without it.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ptrs = base + offs.to(tl.int64) * 16384
    live = (offs < n_chunks).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], 16384; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, live],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def l2_prefetch(weight: torch.Tensor, nbytes: int) -> None:
    """Ask L2 for the first `nbytes` of `weight` (contiguous), without waiting for them."""
    flat = weight.view(-1).view(torch.uint8)
    n_chunks = min(nbytes, flat.numel()) // PREFETCH_CHUNK
    if n_chunks:
        block = 128
        _l2_prefetch_kernel[(triton.cdiv(n_chunks, block),)](
            flat, n_chunks, BLOCK=block, num_warps=4
        )


class Layer:
    def __init__(self, context: int, gen: torch.Generator):
        def rand(*shape, scale=0.02):
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

        q_out = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv = rand(q_out, HIDDEN)
        self.o = rand(HIDDEN, HEADS * HEAD_DIM)
        self.gate_up = rand(2 * FFN, HIDDEN)
        self.down = rand(HIDDEN, FFN)
        self.norm1 = 1 + rand(HIDDEN, scale=0.1)
        self.norm2 = 1 + rand(HIDDEN, scale=0.1)
        self.k = rand(1, KV_HEADS, context, HEAD_DIM, scale=1.0)
        self.v = rand(1, KV_HEADS, context, HEAD_DIM, scale=1.0)


def step(x, layers, final_norm, lm_head, prefetch_bytes: int | None, matmuls_only=False):
    """One decode step at M = 1; returns float32 logits. Each small kernel is preceded by a
    prefetch of the weight after it (prefetch_bytes); matmuls_only leaves the small kernels
    out."""

    def prefetch(weight: torch.Tensor) -> None:
        if prefetch_bytes:
            l2_prefetch(weight, prefetch_bytes)

    def norm(x, residual, weight):  # -> (residual, normed)
        return (residual, x) if matmuls_only else add_rmsnorm(x, residual, weight, 1e-5)

    residual = torch.zeros_like(x)
    h = x
    for layer in layers:
        prefetch(layer.qkv)
        residual, normed = norm(h, residual, layer.norm1)
        q = F.linear(normed, layer.qkv)[:, : HEADS * HEAD_DIM]
        if not matmuls_only:
            prefetch(layer.o)
            q = q.reshape(1, HEADS, 1, HEAD_DIM)
            q = F.scaled_dot_product_attention(q, layer.k, layer.v, enable_gqa=True)
        o = F.linear(q.reshape(1, HEADS * HEAD_DIM), layer.o)
        prefetch(layer.gate_up)
        residual, normed = norm(o, residual, layer.norm2)
        gu = F.linear(normed, layer.gate_up)
        prefetch(layer.down)
        act = gu[:, :FFN].contiguous() if matmuls_only else silu_and_mul(gu)
        h = F.linear(act, layer.down)
    prefetch(lm_head)
    if not matmuls_only:
        _, h = add_rmsnorm(h, residual, final_norm, 1e-5)
    return torch.mm(h, lm_head.t(), torch.float32)


def captured(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_ms(graph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--mib", default="4,8,16,32", help="prefetch sizes to try, MiB, comma-separated"
    )
    ap.add_argument("--context", type=int, default=512, help="tokens of KV each layer attends")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, variants in turns")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args()
    require_cuda(__file__, "an sm_90 GPU: bulk L2 prefetch")
    if torch.cuda.get_device_capability()[0] < 9:
        print(
            "error: bench/l2_prefetch_decoder.py needs an sm_90 GPU (bulk L2 prefetch)",
            file=sys.stderr,
        )
        sys.exit(NOT_HERE_EXIT)

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [Layer(args.context, gen) for _ in range(LAYERS)]
    lm_head = (torch.randn(VOCAB, HIDDEN, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    final_norm = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)

    variants = {"base": dict(prefetch_bytes=None)}
    for mib in (int(v) for v in args.mib.split(",") if v):
        variants[f"prefetch-{mib}"] = dict(prefetch_bytes=mib << 20)
    variants["matmuls-only"] = dict(prefetch_bytes=None, matmuls_only=True)

    graphs, outs = {}, {}
    for name, kw in variants.items():
        graphs[name], outs[name] = captured(
            lambda kw=kw: step(x, layers, final_norm, lm_head, **kw)
        )
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    identical = {
        name: bool(torch.equal(outs[name], outs["base"]))
        for name in variants
        if name != "matmuls-only"
    }

    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, g in graphs.items():
            times[name].append(replay_ms(g, args.reps))
    weight_bytes = (
        LAYERS
        * sum(
            t.numel() * 2 for t in (layers[0].qkv, layers[0].o, layers[0].gate_up, layers[0].down)
        )
        + lm_head.numel() * 2
    )
    base = statistics.median(times["base"])
    rows = []
    for name in variants:
        ms = statistics.median(times[name])
        rows.append(
            {
                "variant": name,
                "ms_per_step": round(ms, 4),
                "runs_ms": [round(t, 4) for t in times[name]],
                "tok_s": round(1e3 / ms, 1),
                "vs_base": round(base / ms, 4),
                "weight_tb_s": round(weight_bytes / ms / 1e9, 3),
                "logits_identical_to_base": identical.get(name),
            }
        )
    report = {
        "device": torch.cuda.get_device_name(),
        "context": args.context,
        "weight_gb": round(weight_bytes / 1e9, 2),
        "rows": rows,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print("\n| variant | ms / step | tok/s | vs base | weight TB/s | logits = base |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        same = "" if r["logits_identical_to_base"] is None else r["logits_identical_to_base"]
        print(
            f"| {r['variant']} | {r['ms_per_step']:.3f} | {r['tok_s']:.1f} | "
            f"{r['vs_base']:.3f} | {r['weight_tb_s']:.2f} | {same} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
