"""Deterministic inference: the batch-invariant kernels against their torch references, and
the property itself: a row's bits do not depend on the other rows of its batch, on M, or on
whether a token is decoded alone or verified as a tree node. On a CPU the kernels run in
Triton's interpreter (float32, and bf16 through the upcast path), at small sizes."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the batch-invariant kernels need the triton package")

from specserve.config import EngineConfig, Kernels  # noqa: E402
from specserve.config.kernels import REFERENCE, resolve_kernels  # noqa: E402
from specserve.errors import InvalidArgument  # noqa: E402
from specserve.kv.pool import KVCache  # noqa: E402
from specserve.model.config import ModelConfig  # noqa: E402
from specserve.model.layers import fused_mode  # noqa: E402
from specserve.model.llama import LlamaForCausalLM  # noqa: E402
from specserve.model.runner import ModelRunner  # noqa: E402
from specserve.ops.attention import TorchAttentionBackend  # noqa: E402
from specserve.ops.attention_metadata import Segment, build_metadata  # noqa: E402
from specserve.ops.triton_attention import TritonAttentionBackend  # noqa: E402
from specserve.ops.triton_invariant_linear import (  # noqa: E402
    TUNED,
    InvariantConfig,
    invariant_config,
    invariant_linear,
    linear_reference,
)
from specserve.ops.triton_kernels.rows import row_attention, token_requests  # noqa: E402
from tests.test_triton_attention import LAYER, Req, make_case  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DETERMINISTIC = Kernels(
    batch_invariant_matmul=True, batch_invariant_attention=True, fused_norms=True
)
SMALL = InvariantConfig(block_n=16, block_k=32)  # several N tiles and K steps at test sizes


def rand(shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# the GEMM


FUSIONS = {
    "plain": {},
    "bias_residual": {"bias": True, "residual": True},
    "norm": {"norm": True},
    "silu_mul_residual": {"silu_mul": True, "residual": True},
    "fp32_out": {"out_dtype": torch.float32},
}


def gemm_args(m, n, k, dtype, seed, fusion):
    kx = 2 * k if fusion.get("silu_mul") else k
    kw = {
        "bias": rand((n,), dtype, seed + 1) if fusion.get("bias") else None,
        "norm_weight": rand((k,), dtype, seed + 2, 0.3) + 1 if fusion.get("norm") else None,
        "silu_mul": bool(fusion.get("silu_mul")),
        "residual": rand((m, n), dtype, seed + 3) if fusion.get("residual") else None,
        "out_dtype": fusion.get("out_dtype"),
    }
    return rand((m, kx), dtype, seed), rand((n, k), dtype, seed + 4, k**-0.5), kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fusion", list(FUSIONS), ids=list(FUSIONS))
def test_gemm_matches_torch_reference(dtype, fusion):
    x, w, kw = gemm_args(21, 40, 72, dtype, seed=hash(fusion) % 100, fusion=FUSIONS[fusion])
    out = invariant_linear(x, w, config=SMALL, **kw)
    ref = linear_reference(x, w, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # the interpreter converts fp32 -> bf16 by truncation: a wider bf16 bound
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1.2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fusion", ["plain", "norm", "silu_mul_residual", "fp32_out"])
def test_gemm_row_is_the_same_alone_and_in_any_batch(dtype, fusion):
    # Row 0 computed alone, then beside other rows in batches of 2 .. 40 (across the 16-row
    # tile boundary): identical bits, while the other rows change from batch to batch.
    _, w, _ = gemm_args(1, 40, 72, dtype, 0, FUSIONS[fusion])
    x0, _, kw0 = gemm_args(1, 40, 72, dtype, 5, FUSIONS[fusion])
    alone = invariant_linear(x0, w, config=SMALL, **kw0)
    for m in (2, 7, 16, 17, 40):
        xs, _, kw = gemm_args(m, 40, 72, dtype, 100 + m, FUSIONS[fusion])
        xs[m // 2] = x0[0]
        if kw["residual"] is not None:
            kw["residual"][m // 2] = kw0["residual"][0]
        kw.update({k: kw0[k] for k in ("bias", "norm_weight")})
        out = invariant_linear(xs, w, config=SMALL, **kw)
        assert torch.equal(out[m // 2], alone[0]), f"row differs at M={m}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 tensor cores)")
@pytest.mark.parametrize(
    "n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
)
def test_gpu_gemm_rows_are_batch_invariant_at_8b_shapes(n, k):
    # bf16 on the tensor cores, the tile the engine picks: a row alone, and at every verify
    # width up to 64 rows, has the same bits; the values are the fp32 product's
    w = rand((n, k), torch.bfloat16, 1, k**-0.5)
    xs = rand((64, k), torch.bfloat16, 2)
    out_dtype = torch.float32 if n == 128256 else None
    full = invariant_linear(xs, w, out_dtype=out_dtype)
    for m in (1, 2, 5, 16, 17, 33):
        assert torch.equal(invariant_linear(xs[:m], w, out_dtype=out_dtype), full[:m]), m
    assert rel_err(full, xs.float() @ w.float().t()) < 1e-2


def test_gemm_config_depends_on_the_weight_only_and_fills_the_gpu():
    # shapes without a tuned tile (SmolLM2's, a 4-SM GPU's), through the heuristic
    for n, k in ((3072, 576), (49152, 576), (2304, 1536), (6144, 4096 + 64)):
        cfg = invariant_config(n, k, 132)
        assert cfg.block_n in (16, 32, 64) and cfg.block_k == 256
        assert -(-n // cfg.block_n) >= 132  # one M tile still gives every SM a program
    assert invariant_config(960, 576, 132).block_n == 16  # too narrow to fill: the narrowest
    assert invariant_config(40, 72, 4).block_k == 128  # K rounded up to a power of two
    # the tuned 8B tiles, the same whatever the GPU reports (never a function of M)
    for (n, k), cfg in TUNED.items():
        assert invariant_config(n, k, 132) == invariant_config(n, k, 78) == cfg
        assert -(-n // cfg.block_n) >= 64  # at least half the SMs busy at one M tile


def test_gemm_rejects_bad_arguments():
    x, w = rand((2, 8)), rand((4, 8))
    with pytest.raises(ValueError, match="columns"):
        invariant_linear(x, rand((4, 6)))
    with pytest.raises(ValueError, match="do not combine"):
        invariant_linear(rand((2, 16)), w, norm_weight=rand((8,)), silu_mul=True)
    with pytest.raises(ValueError, match="unit stride"):
        invariant_linear(x, rand((8, 4)).t())
    assert invariant_linear(x[:0], w).shape == (0, 4)


# ---------------------------------------------------------------------------------------------
# attention


def run_rows(case, chunk: int) -> torch.Tensor:
    meta = case.meta
    case.cache_tri.write(LAYER, meta.out_cache_loc, case.k, case.v)
    k_cache, v_cache = case.cache_tri.layer(LAYER)
    out = torch.empty_like(case.q)
    kv = meta.host_kv_indptr
    row_attention(
        case.q, k_cache, v_cache, out, token_requests(meta.qo_indptr, case.q.shape[0]),
        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.extra_lens, meta.custom_mask,
        meta.mask_indptr, max(b - a for a, b in zip(kv, kv[1:])), chunk=chunk,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "custom_mask"])
@pytest.mark.parametrize("chunk", [64, 256])
def test_row_attention_matches_torch_reference(tree, chunk):
    reqs = [Req(1, 150), Req(5, 20), Req(3, 0), Req(6, 70)]
    case = make_case(reqs, heads=4, kv_heads=2, head_dim=32, page_size=3, tree_mask=tree, seed=3)
    ref = TorchAttentionBackend().forward(LAYER, case.q, case.k, case.v, case.cache_ref, case.meta)
    torch.testing.assert_close(run_rows(case, chunk), ref, atol=1e-5, rtol=1e-5)


def test_backend_batch_invariant_routes_decode_steps_and_prefill_and_matches_reference():
    for tree, decode_step in ((True, True), (False, True), (False, False)):
        reqs = [Req(4, 90), Req(1, 7)] if decode_step else [Req(9, 40), Req(30, 0)]
        case = make_case(reqs, heads=4, kv_heads=2, head_dim=16, tree_mask=tree, seed=4)
        case.meta = dataclasses.replace(case.meta, decode_step=decode_step)
        ref = TorchAttentionBackend().forward(
            LAYER, case.q, case.k, case.v, case.cache_ref, case.meta
        )
        out = TritonAttentionBackend(batch_invariant=True).forward(
            LAYER, case.q, case.k, case.v, case.cache_tri, case.meta
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _attend(backend, q, cache, kv_lists, q_lens, extras, masks, decode_step=True):
    """Attention of queries q over explicit per-request slot lists (KV already cached)."""
    segs = [Segment(torch.as_tensor(s), n, e) for s, n, e in zip(kv_lists, q_lens, extras)]
    mask = torch.cat([m.flatten() for m in masks]).to(DEVICE) if masks else None
    meta = build_metadata(segs, torch.zeros(sum(q_lens), dtype=torch.long), DEVICE, mask)
    meta = dataclasses.replace(meta, decode_step=decode_step)
    return backend.forward(LAYER, q, None, None, cache, meta)


# (the interpreter's dot has no bf16: 16-bit and real head sizes on the GPU only)
ATTENTION_SHAPES = [(torch.float32, 4, 2, 32)] + (
    [(torch.bfloat16, 32, 8, 128), (torch.bfloat16, 9, 3, 64)] if torch.cuda.is_available() else []
)


@pytest.mark.parametrize("dtype,heads,kv_heads,d", ATTENTION_SHAPES)
def test_tree_node_equals_its_one_token_decode_alone_and_in_a_batch(dtype, heads, kv_heads, d):
    # A tree over a 300-position prefix (two 256-position splits): root 0, children 1 and 2,
    # 3 under 2, 4 under 3. Node i's row must be bit-identical to a one-token decode whose KV
    # is the prefix, then i's ancestors, then itself, and to the same tree beside another
    # request (whose longer KV widens the split grid).
    g = torch.Generator().manual_seed(7)
    prefix = 300
    cache = KVCache(2, 1024, kv_heads, d, dtype, DEVICE)
    for buf in (cache.k, cache.v):
        buf[LAYER].copy_(torch.randn(buf[LAYER].shape, generator=g).to(dtype))
    slots = torch.randperm(1024, generator=g)[: prefix + 5 + 600]
    pre, nodes, other = slots[:prefix], slots[prefix : prefix + 5], slots[prefix + 5 :]
    parent = [-1, 0, 0, 2, 3]
    anc = torch.eye(5, dtype=torch.bool)
    for i in range(1, 5):
        anc[i] |= anc[parent[i]]
    q = torch.randn(5, heads, d, generator=g).to(dtype).to(DEVICE)
    backend = TritonAttentionBackend(batch_invariant=True)
    tree = _attend(backend, q, cache, [torch.cat([pre, nodes])], [5], [5], [anc])
    q_other = torch.randn(3, heads, d, generator=g).to(dtype).to(DEVICE)
    batched = _attend(
        backend,
        torch.cat([q_other, q]),
        cache,
        [other, torch.cat([pre, nodes])],
        [3, 5],
        [3, 5],
        [torch.ones(3, 3, dtype=torch.bool), anc],
    )
    assert torch.equal(batched[3:], tree)
    for i in range(5):
        path = nodes[anc[i].nonzero().flatten()]
        one = _attend(backend, q[i : i + 1], cache, [torch.cat([pre, path])], [1], [1], [])
        assert torch.equal(one[0], tree[i]), f"node {i}"
    ref = TorchAttentionBackend().forward(
        LAYER,
        q,
        None,
        None,
        cache,
        build_metadata(
            [Segment(torch.cat([pre, nodes]), 5, 5)],
            torch.zeros(5, dtype=torch.long),
            DEVICE,
            anc.flatten().to(DEVICE),
        ),
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # as tests/test_triton_attention.py
    torch.testing.assert_close(tree.float(), ref.float(), atol=tol, rtol=tol)


def test_prefill_rows_do_not_depend_on_chunking_or_batch():
    # One prompt's last 41 queries: prefilled with the whole prompt, as a chunk after a cached
    # 32-position prefix (half a KV block: the unaligned split of the old loops), and beside
    # another prompt. (The chunk starts a 64-row tile, 32 queries of 2 heads, as in the whole
    # prompt: the interpreter's numpy dot, unlike tensor cores, is not invariant to a row's
    # place in a tile.)
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, d, n, c = 4, 2, 16, 73, 32
    cache = KVCache(2, 512, kv_heads, d, torch.float32, DEVICE)
    for buf in (cache.k, cache.v):
        buf[LAYER].copy_(torch.randn(buf[LAYER].shape, generator=g))
    slots = torch.randperm(512, generator=g)
    mine, other = slots[:n], slots[n : n + 40]
    q = torch.randn(n, heads, d, generator=g).to(DEVICE)

    def prefill(backend, qs, lists, q_lens):
        return _attend(backend, qs, cache, lists, q_lens, q_lens, [], decode_step=False)

    backend = TritonAttentionBackend(batch_invariant=True)
    whole = prefill(backend, q, [mine], [n])
    chunk = prefill(backend, q[c:], [mine], [n - c])
    q2 = torch.randn(40, heads, d, generator=g).to(DEVICE)
    batch = prefill(backend, torch.cat([q2, q[c:]]), [other, mine], [40, n - c])
    assert torch.equal(chunk, whole[c:])
    assert torch.equal(batch[40:], whole[c:])


# ---------------------------------------------------------------------------------------------
# the model: a one-token decode and a tree node compute the same bits


def tiny_model() -> LlamaForCausalLM:
    cfg = ModelConfig(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, qk_norm=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.1))
    return model.to(DEVICE).eval().requires_grad_(False)


def test_model_tree_verify_equals_plain_decoding_bit_for_bit():
    model = tiny_model()
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    other = torch.randint(0, cfg.vocab_size, (25,), generator=g)
    tree_tokens = torch.randint(0, cfg.vocab_size, (4,), generator=g)
    parent, depth = [-1, 0, 0, 2], [0, 1, 1, 2]
    anc = torch.eye(4, dtype=torch.bool)
    for i in range(1, 4):
        anc[i] |= anc[parent[i]]

    def runner(kernels=DETERMINISTIC):
        cache = KVCache(cfg.num_layers, 256, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEVICE)
        if kernels == REFERENCE:
            return ModelRunner(model, cache, TorchAttentionBackend(), REFERENCE)
        return ModelRunner(model, cache, TritonAttentionBackend(batch_invariant=True), kernels)

    def forward(r, ids, positions, segs, out_slots, mask=None, decode_step=True):
        meta = build_metadata(segs, torch.as_tensor(out_slots), DEVICE, mask)
        meta = dataclasses.replace(meta, decode_step=decode_step)
        ids, positions = torch.as_tensor(ids).to(DEVICE), torch.as_tensor(positions).to(DEVICE)
        with torch.inference_mode():
            out = r.forward(ids, positions, meta)
            return model.compute_logits(out.hidden, r.kernels)

    def prefill(r, toks, base):
        n = len(toks)
        s = torch.arange(base, base + n)
        return forward(r, toks, torch.arange(n), [Segment(s, n, n)], s, decode_step=False)

    def decode_path(i, kernels=DETERMINISTIC):
        """Plain decoding of the root-to-node-i path, one token per forward."""
        r = runner(kernels)
        prefill(r, prompt, 0)
        path = anc[i].nonzero().flatten().tolist()
        for j, node in enumerate(path):
            s = torch.arange(0, 40 + j + 1)
            logits = forward(r, [tree_tokens[node]], [40 + j], [Segment(s, 1, 1)], [40 + j])
        return logits[0]

    plain = {i: decode_path(i) for i in range(4)}
    # the kernels compute the model's values (torch reference ops and attention)
    torch.testing.assert_close(plain[3], decode_path(3, REFERENCE), atol=1e-4, rtol=1e-4)
    # the tree as one verify forward, beside another request
    r = runner()
    prefill(r, other, 100)
    prefill(r, prompt, 0)
    mine = torch.arange(0, 44)
    theirs = torch.arange(100, 126)
    logits = forward(
        r,
        [5, *tree_tokens.tolist()],
        [25, *(40 + d for d in depth)],
        [Segment(theirs, 1, 1), Segment(mine, 4, 4)],
        [125, *range(40, 44)],
        mask=torch.cat([torch.ones(1, dtype=torch.bool), anc.flatten()]).to(DEVICE),
    )
    for i in range(4):
        assert torch.equal(logits[1 + i], plain[i]), f"node {i}"
    assert fused_mode(torch.zeros(1, 64), DETERMINISTIC) == 3  # any token count: one GEMM


# ---------------------------------------------------------------------------------------------
# configuration


def test_resolver_on_cuda_turns_on_the_invariant_kernels_with_reasons():
    kernels, decisions = resolve_kernels(True, True, True, False, (2, 11), deterministic=True)
    assert kernels.batch_invariant_matmul and kernels.batch_invariant_attention
    assert kernels.fused_norms and kernels.sampling_reductions
    assert not kernels.skinny_gemm  # one GEMM for every M
    d = {name: (value, why) for name, value, why in decisions}
    assert "fixed order" in d["kernels.batch_invariant_matmul"][1]
    assert d["kernels.skinny_gemm"][0] is False


def test_resolver_default_is_off_and_says_why():
    kernels, decisions = resolve_kernels(True, True, True, False, (2, 11))
    assert not kernels.batch_invariant_matmul and not kernels.batch_invariant_attention
    d = {name: (value, why) for name, value, why in decisions}
    why = d["kernels.batch_invariant_matmul"][1]
    assert "enable_deterministic_inference is off" in why and "speed on an H200" in why
    assert "H200" in d["kernels.batch_invariant_attention"][1]


def test_resolver_routes_few_token_matmuls_of_tuned_shapes_on_the_gpu_they_were_tuned_on():
    from specserve.config.kernels import INVARIANT_GEMM_ROUTED, INVARIANT_GEMM_TILES

    assert resolve_kernels(True, True, True, False, (2, 11), gpu_name="NVIDIA H200 NVL")[
        0
    ].invariant_gemm_shapes
    h200 = resolve_kernels(True, True, True, False, (2, 11), gpu_name="NVIDIA H200")
    kernels, decisions = h200
    assert kernels.invariant_gemm_max_tokens == 16
    assert set(kernels.invariant_gemm_shapes) == set(INVARIANT_GEMM_ROUTED)
    assert set(INVARIANT_GEMM_ROUTED) <= set(INVARIANT_GEMM_TILES)  # routed: with a tuned tile
    assert (6144, 4096) in kernels.invariant_gemm_shapes  # the 8B qkv
    why = {name: why for name, _, why in decisions}["kernels.invariant_gemm_max_tokens"]
    assert "faster than cuBLAS" in why
    for kwargs, reason in (
        (dict(gpu_name="NVIDIA A100-SXM4-80GB"), "tuned on an H200"),
        (dict(gpu_name="NVIDIA GH200 480GB"), "tuned on an H200"),
        (dict(gpu_name="NVIDIA H200", tp_size=2), "tensor parallelism"),
    ):
        kernels, decisions = resolve_kernels(True, True, True, False, (2, 11), **kwargs)
        assert kernels.invariant_gemm_max_tokens == 0 and not kernels.invariant_gemm_shapes
        why = {name: why for name, _, why in decisions}["kernels.invariant_gemm_max_tokens"]
        assert reason in why
    fp32 = resolve_kernels(True, False, True, False, (2, 11), gpu_name="NVIDIA H200")[0]
    assert fp32.invariant_gemm_max_tokens == 0  # the tiles are for 16-bit weights


def test_cpu_runs_the_torch_reference_and_says_so():
    c = EngineConfig(model_path="tiny", enable_deterministic_inference=True).resolve(
        cuda_available=False
    )
    assert c.kernels == REFERENCE
    why = dict((f, r) for f, _, r in c.decisions)["kernels.batch_invariant_matmul"]
    assert "torch reference" in why and "CPU" in why


def test_refuses_combinations_that_cannot_be_batch_invariant_on_cuda():
    for bad in ({"disable_fused_kernels": True}, {"attention_backend": "torch"}):
        cfg = EngineConfig(model_path="tiny", enable_deterministic_inference=True, **bad)
        with pytest.raises(InvalidArgument) as e:
            cfg.resolve(cuda_available=True)
        assert e.value.field == "enable_deterministic_inference"


def test_cli_has_the_flag():
    import argparse

    from specserve.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kwargs = engine_kwargs(p.parse_args(["--enable-deterministic-inference"]))
    assert kwargs["enable_deterministic_inference"] is True
    assert "enable_deterministic_inference" not in engine_kwargs(p.parse_args([]))


# ---------------------------------------------------------------------------------------------
# the engine with the deterministic kernels (interpreter on a CPU; wiring end to end)


@pytest.mark.parametrize("draft", ["standalone", "eagle"])
def test_engine_speculative_equals_plain_and_batch_equals_alone(draft, tmp_path):
    from specserve import Engine
    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
    from tests.engine_utils import TINY, mixed_prompts, spec_args

    sp = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    path = "tiny"
    if draft == "eagle":
        path = write_random_eagle_checkpoint(str(tmp_path / "e"), PRESETS["tiny"], "EAGLE")
    prompts = mixed_prompts(3, 512, seed=5, max_len=12)

    def run(batch, **kw):
        args = dict(TINY, device=str(DEVICE), attention_backend="triton", kernels=DETERMINISTIC)
        with Engine(**args, max_total_tokens=2048, page_size=2, **kw) as e:
            return [o["output_ids"] for o in e.generate(input_ids=batch, sampling_params=sp)]

    plain = run(prompts)
    assert run(prompts, **spec_args(path, 2, 2, 4)) == plain
    assert run(prompts[1:2]) == plain[1:2]
