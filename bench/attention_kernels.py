"""Time TritonAttentionBackend against TorchAttentionBackend on Llama-3-8B attention shapes.

    .venv/bin/python bench/attention_kernels.py [--json out.json] [--page-size 16] [--quick]

Cases (32 query heads, 8 KV heads, head_dim 128, bf16, one layer, K/V write included):
- decode: batch 1/16/64 x context 1k/4k/16k;
- tree verify: 64 tree nodes (custom mask) per request over a cached context;
- chain verify: 3 nodes per request at batch 64 / 128 (what a chain of 2 verifies at load);
- extend: a 64-token causal chunk over a cached context.
GB/s counts the bytes that must move at least once: the visible K/V (gathered from the cache),
q, the new k/v and the output. Needs CUDA; times with triton.testing.do_bench (median).
`triton_us` is the eager backend call (Python launch overhead included: ~5 launches);
`graph_us` replays it from a CUDA graph, i.e. GPU time as a graph-captured engine sees it.
`--tune` instead sweeps kernel configs and split counts (graph-timed) on a few shapes.
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

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16


def build(batch: int, ctx: int, q_len: int, tree: bool, page_size: int, seed: int = 0):
    """Each request: `ctx` cached tokens plus q_len new ones, scattered over random pages."""
    from specserve.kv.pool import KVCache
    from specserve.ops.attention import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    kv_len = ctx + q_len
    pages_per_req = -(-kv_len // page_size)
    num_pages = batch * pages_per_req + 1
    perm = torch.randperm(num_pages, generator=g)
    pos = torch.arange(kv_len)
    slots, locs, masks = [], [], []
    for b in range(batch):
        pages = perm[b * pages_per_req : (b + 1) * pages_per_req]
        s = pages[pos // page_size] * page_size + pos % page_size
        slots.append(s)
        locs.append(s[ctx:])
        if tree:  # random tree, parent[i] < i, ancestor-or-self mask
            m = torch.eye(q_len, dtype=torch.bool)
            for i in range(1, q_len):
                p = int(torch.randint(-1, i, (1,), generator=g))
                if p >= 0:
                    m[i] |= m[p]
            masks.append(m.flatten())
    qo = [b * q_len for b in range(batch + 1)]
    kv = [b * kv_len for b in range(batch + 1)]
    extra = [q_len] * batch
    mptr = [b * q_len * q_len for b in range(batch + 1)]

    def dev(x):
        return torch.as_tensor(x, dtype=torch.int64).cuda()

    meta = AttentionMetadata(
        qo_indptr=dev(qo),
        kv_indptr=dev(kv),
        kv_indices=dev(torch.cat(slots)),
        extra_lens=dev(extra),
        out_cache_loc=dev(torch.cat(locs)),
        custom_mask=torch.cat(masks).cuda() if tree else None,
        mask_indptr=dev(mptr) if tree else None,
        host_qo_indptr=qo,
        host_kv_indptr=kv,
        host_extra_lens=extra,
        host_mask_indptr=mptr if tree else None,
    )
    cache = KVCache(1, num_pages * page_size, KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    cache.k[0].normal_()
    cache.v[0].normal_()
    t = batch * q_len
    q = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    kv_bytes = batch * kv_len * KV_HEADS * HEAD_DIM * 2 * cache.k[0].element_size()
    io_bytes = (2 * q.numel() + k.numel() + v.numel()) * q.element_size()
    return q, k, v, cache, meta, kv_bytes + io_bytes


def run_case(name, batch, ctx, q_len, tree, page_size, with_torch) -> dict:
    from triton.testing import do_bench

    from specserve.ops.attention import TorchAttentionBackend
    from specserve.ops.triton_attention import TritonAttentionBackend

    q, k, v, cache, meta, nbytes = build(batch, ctx, q_len, tree, page_size)
    tri, ref = TritonAttentionBackend(), TorchAttentionBackend()
    out_t = tri.forward(0, q, k, v, cache, meta)
    out_r = ref.forward(0, q, k, v, cache, meta)
    err = (out_t.float() - out_r.float()).abs().max().item()
    t_ms = do_bench(lambda: tri.forward(0, q, k, v, cache, meta), return_mode="median")
    g_ms = graph_ms(lambda: tri.forward(0, q, k, v, cache, meta))
    r_ms = None
    if with_torch:
        r_ms = do_bench(lambda: ref.forward(0, q, k, v, cache, meta), rep=50, return_mode="median")
    return {
        "case": name,
        "batch": batch,
        "context": ctx,
        "q_len": q_len,
        "triton_us": round(t_ms * 1e3, 1),
        "graph_us": round(g_ms * 1e3, 1),
        "torch_us": None if r_ms is None else round(r_ms * 1e3, 1),
        "speedup": None if r_ms is None else round(r_ms / t_ms, 1),
        "triton_GBps": round(nbytes / (t_ms * 1e-3) / 1e9, 1),
        "graph_GBps": round(nbytes / (g_ms * 1e-3) / 1e9, 1),
        "max_abs_err": err,
        "num_kv_splits": tri._plan.num_splits if tri._plan else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="contexts 1k/4k only")
    ap.add_argument("--no-torch", action="store_true", help="skip the (slow) reference timings")
    ap.add_argument("--tune", action="store_true", help="sweep kernel configs instead")
    ap.add_argument(
        "--tune-only",
        nargs="+",
        choices=["decode", "chain", "tree", "extend", "prefill"],
        help="with --tune: only these shapes",
    )
    args = ap.parse_args()
    require_cuda(__file__, "Triton kernels")
    warm_up_clocks()
    if args.tune:
        tune(
            args.page_size, set(args.tune_only or ["decode", "chain", "tree", "extend", "prefill"])
        )
        return

    contexts = [1024, 4096] if args.quick else [1024, 4096, 16384]
    cases = [("decode", b, c, 1, False) for b in (1, 16, 64) for c in contexts]
    cases += [("tree_verify64", b, c, 64, True) for b in (1, 16) for c in contexts]
    cases += [("extend64", b, c, 64, False) for b in (1, 16) for c in contexts]
    cases += [("chain_verify3", b, c, 3, True) for b in (64, 128) for c in contexts[:2]]

    results = []
    for name, batch, ctx, q_len, tree in cases:
        row = run_case(name, batch, ctx, q_len, tree, args.page_size, not args.no_torch)
        results.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()

    info = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "page_size": args.page_size,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16"},
    }
    print(json.dumps({"info": info, "results": results}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    cols = ["case", "batch", "context", "triton_us", "graph_us", "torch_us", "speedup"]
    cols += ["triton_GBps", "graph_GBps", "num_kv_splits", "max_abs_err"]
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def tune(page_size: int, only: set[str]) -> None:
    """Graph-timed sweep of split counts and tile configs; prints one line per variant.
    only: the shape names swept (decode, chain, tree, extend, prefill)."""
    from specserve.ops.triton_attention import TritonAttentionBackend
    from specserve.ops.triton_kernels import decode_attention, extend_attention

    def line(tag, cfg, ms, nbytes):
        print(f"{tag:34s} {str(cfg):70s} {ms * 1e3:9.1f} us {nbytes / ms / 1e6:8.1f} GB/s")

    def try_graph_ms(fn) -> float:
        try:
            return graph_ms(fn)
        except Exception as e:  # e.g. a tile config that does not fit in shared memory
            print(f"  failed: {type(e).__name__}: {str(e)[:100]}")
            return float("inf")

    decode_cfgs = [
        {"block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_n": 64, "num_warps": 4, "num_stages": 4},
        {"block_n": 128, "num_warps": 4, "num_stages": 3},
        {"block_n": 64, "num_warps": 2, "num_stages": 3},
        {"block_n": 32, "num_warps": 4, "num_stages": 4},
    ]
    for batch, ctx in [(1, 16384), (1, 4096), (16, 16384), (64, 4096)] if "decode" in only else []:
        q, k, v, cache, meta, nbytes = build(batch, ctx, 1, False, page_size)
        auto = TritonAttentionBackend()
        auto.forward(0, q, k, v, cache, meta)
        print(f"decode b={batch} ctx={ctx}: auto plan {auto._plan}")
        out = torch.empty_like(q)
        for splits in sorted({1, 8, 32, auto._plan.num_splits}):
            per = -(-(ctx + 1) // splits)
            for cfg in decode_cfgs:
                args = (q, cache.k[0], cache.v[0], meta.kv_indptr, meta.kv_indices, out)
                ms = try_graph_ms(partial(decode_attention, *args, splits, per, cfg))
                line(f"decode b={batch} ctx={ctx} S={splits}", cfg, ms, nbytes)

    extend_cfgs = [
        # short verifies fill few rows of a tile: 3 nodes x a GQA group of 4 is 12 rows
        {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 4},
        {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 3},
        {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3},
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
        {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3},
    ]
    shapes = [("chain", 64, 1024, 3, True), ("chain", 128, 1024, 3, True)]
    shapes += [("chain", 16, 1024, 3, True), ("chain", 64, 1024, 4, True)]
    shapes += [("tree", 16, 4096, 64, True), ("extend", 16, 4096, 64, False)]
    shapes += [("prefill", 1, 0, 4096, False), ("tree", 1, 16384, 64, True)]
    for name, batch, ctx, q_len, tree in [s for s in shapes if s[0] in only]:
        q, k, v, cache, meta, nbytes = build(batch, ctx, q_len, tree, page_size)
        auto = TritonAttentionBackend()
        auto.forward(0, q, k, v, cache, meta)
        print(f"{name} b={batch} ctx={ctx} q={q_len}: auto plan {auto._plan}")
        out = torch.empty_like(q)
        split_opts = {1, auto._plan.num_splits} | ({8, 16} if batch == 1 and ctx else set())
        split_opts = sorted(split_opts | ({2, 4} if name == "chain" else set()))
        for splits in split_opts:
            per = -(-ctx // splits) if ctx else 0
            for cfg in extend_cfgs:
                args = (q, cache.k[0], cache.v[0], out, meta.qo_indptr, meta.kv_indptr)
                args += (meta.kv_indices, meta.extra_lens, meta.custom_mask, meta.mask_indptr)
                ms = try_graph_ms(partial(extend_attention, *args, batch, q_len, splits, per, cfg))
                flops = 4 * batch * q_len * HEADS * HEAD_DIM * (ctx + q_len / 2)
                tflops = flops / ms / 1e9
                line(f"{name} b={batch} ctx={ctx} S={splits} {tflops:5.0f}TF", cfg, ms, nbytes)


if __name__ == "__main__":
    main()
