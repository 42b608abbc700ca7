"""Skinny GEMM (Triton) against F.linear and its fused prologues/epilogues on fresh random
inputs: small shapes under TRITON_INTERPRET=1 on the CPU, the real model shapes on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the skinny GEMM kernels need the triton package")

from specserve.config import Kernels  # noqa: E402
from specserve.ops import triton_linear as tlin  # noqa: E402
from specserve.ops.triton_linear import (  # noqa: E402
    LinearConfig,
    linear_reference,
    pick_config,
    skinny_linear,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# Relative (Frobenius) error allowed against the reference, which rounds each step to the
# dtype. The interpreter converts fp32 -> bf16 by truncation, hence the wider bf16 bound.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.2e-2}

# Llama-3-8B and SmolLM2-135M linear shapes (N, K)
LLAMA8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
SMOLLM = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


SMALL_CONFIGS = [
    LinearConfig("fma", block_n=8, block_k=32, prefetch=False),
    LinearConfig("fma", block_n=16, block_k=16, split_k=4, num_warps=1),
    LinearConfig("dot", block_n=16, block_k=32),
    LinearConfig("dot", block_n=32, block_k=16, split_k=2, block_m=32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "cfg",
    SMALL_CONFIGS + [None],
    ids=lambda c: "auto" if c is None else f"{c.kind}-s{c.split_k}-p{int(c.prefetch)}",
)
def test_plain_bias_residual(cfg, dtype):
    # K = 80: uneven for every BLOCK_K above (masked tail); N = 21: partial last row block
    m, n, k = 2, 21, 80
    x, w = rand((m, k), dtype, 1), rand((n, k), dtype, 2)
    b, r = rand((n,), dtype, 3), rand((m, n), dtype, 4)
    out = skinny_linear(x, w, config=cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, linear_reference(x, w)) < TOL[dtype]
    out = skinny_linear(x, w, b, residual=r, config=cfg)
    assert rel_err(out, linear_reference(x, w, b, residual=r)) < TOL[dtype]


@pytest.mark.parametrize("cfg", SMALL_CONFIGS, ids=lambda c: f"{c.kind}-s{c.split_k}")
def test_fused_norm_and_silu_mul(cfg):
    m, n, k = 2, 24, 48
    x = rand((m, k), torch.float32, 5, scale=3.0)
    w, nw = rand((n, k), torch.float32, 6), rand((k,), torch.float32, 7)
    out = skinny_linear(x, w, norm_weight=nw, eps=1e-5, config=cfg)
    assert rel_err(out, linear_reference(x, w, norm_weight=nw, eps=1e-5)) < 1e-5
    gu = rand((m, 2 * k), torch.float32, 8)
    r = rand((m, n), torch.float32, 9)
    out = skinny_linear(gu, w, silu_mul=True, residual=r, config=cfg)
    assert rel_err(out, linear_reference(gu, w, silu_mul=True, residual=r)) < 1e-5


def test_bf16_prologues_and_fp32_output():
    m, n, k = 1, 20, 64
    x = rand((m, k), torch.bfloat16, 10, scale=3.0)
    w, nw = rand((n, k), torch.bfloat16, 11), rand((k,), torch.bfloat16, 12)
    out = skinny_linear(x, w, norm_weight=nw, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = linear_reference(x, w, norm_weight=nw, out_dtype=torch.float32)
    assert rel_err(out, ref) < 1.2e-2
    gu = rand((m, 2 * k), torch.bfloat16, 13)
    ref = linear_reference(gu, w, silu_mul=True)
    assert rel_err(skinny_linear(gu, w, silu_mul=True), ref) < 1.2e-2


def test_leading_dims_strided_rows_and_empty():
    w = rand((16, 32), torch.float32, 14)
    x = rand((2, 3, 2, 32), torch.float32, 15)[:, :, 1]  # [2, 3, 32], rows strided by 64
    out = skinny_linear(x, w, config=SMALL_CONFIGS[2])
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w))
    assert skinny_linear(x[:0], w).shape == (0, 3, 16)


def test_split_k_tickets_reset_and_deterministic():
    cfg = LinearConfig("dot", block_n=16, block_k=16, split_k=4)
    x, w = rand((2, 64), torch.float32, 16), rand((24, 64), torch.float32, 17)
    a = skinny_linear(x, w, config=cfg)
    b = skinny_linear(x, w, config=cfg)
    assert torch.equal(a, b)
    assert int(tlin._TICKETS[x.device].abs().sum()) == 0  # every tile's counter reset


def test_rejects_bad_arguments():
    w = rand((8, 16), torch.float32, 18)
    with pytest.raises(ValueError, match="columns"):
        skinny_linear(rand((1, 15), torch.float32, 19), w)
    with pytest.raises(ValueError, match="combine"):
        skinny_linear(rand((1, 32), torch.float32, 20), w, norm_weight=w[0], silu_mul=True)
    with pytest.raises(ValueError, match="power of two"):
        LinearConfig("fma", block_n=3, block_k=16)
    with pytest.raises(ValueError, match=">= 16"):
        LinearConfig("dot", block_n=8, block_k=16)


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("nk", list(LLAMA8B.values()) + list(SMOLLM.values()))
def test_pick_config_is_valid_and_fills_the_gpu(nk, m):
    n, k = nk
    cfg = pick_config(m, n, k, num_sms=132)
    assert cfg == pick_config(m, n, k, num_sms=132)  # deterministic
    assert cfg.kind == ("fma" if m == 1 else "dot")
    if cfg.kind == "dot":
        assert cfg.block_m >= min(m, 64) or cfg.block_m == 64
        tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    else:
        tiles = -(-n // cfg.block_n) * m
    assert tiles * cfg.split_k >= 132 or k < 4 * cfg.block_k * cfg.split_k * 2


# ---------------------------------------------------------------------------------------------
# CUDA: real shapes, bf16 / fp16, graph capture


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "m, dtype",
    [(1, torch.bfloat16), (3, torch.bfloat16), (16, torch.bfloat16), (64, torch.bfloat16)]
    + [(1, torch.float16), (16, torch.float16)],
)
@pytest.mark.parametrize("name", [f"8b-{k}" for k in LLAMA8B] + [f"smol-{k}" for k in SMOLLM])
def test_gpu_real_shapes(name, m, dtype):
    n, k = (LLAMA8B if name.startswith("8b") else SMOLLM)[name.split("-", 1)[1]]
    x, w = rand((m, k), dtype, 21), rand((n, k), dtype, 22, scale=0.02)
    out = skinny_linear(x, w)
    ref = x.float() @ w.float().T
    assert rel_err(out, ref) < 8e-3
    assert rel_err(out, torch.nn.functional.linear(x, w)) < 8e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", SMALL_CONFIGS, ids=lambda c: f"{c.kind}-s{c.split_k}")
def test_gpu_fusions_bf16(cfg):
    m, n, k = 5, 1000, 576
    dt = torch.bfloat16
    x, w = rand((m, k), dt, 23, 3.0), rand((n, k), dt, 24, 0.05)
    nw, b, r = rand((k,), dt, 25), rand((n,), dt, 26), rand((m, n), dt, 27)
    gu = rand((m, 2 * k), dt, 28)
    for kw, xin in (
        (dict(norm_weight=nw, eps=1e-5), x),
        (dict(silu_mul=True, residual=r), gu),
        (dict(bias=b, residual=r, out_dtype=torch.float32), x),
    ):
        out = skinny_linear(xin, w, config=cfg, **kw)
        assert rel_err(out, linear_reference(xin, w, **kw)) < 8e-3, kw.keys()


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_capture_and_replay():
    dt = torch.bfloat16
    shapes = [(1, 4096, 4096), (4, 960, 576), (16, 576, 1536)]
    ws = [rand((n, k), dt, 30 + i, 0.02) for i, (_, n, k) in enumerate(shapes)]
    xs = [rand((m, k), dt, 40 + i) for i, (m, _, k) in enumerate(shapes)]
    split = LinearConfig("dot", block_n=16, block_k=64, split_k=4)

    def run():
        outs = [skinny_linear(x, w) for x, w in zip(xs, ws)]
        return outs + [skinny_linear(xs[2], ws[2], config=split)]

    run()  # warm-up: compile, ticket buffer
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for seed in range(3):
        for i, x in enumerate(xs):
            x.copy_(rand(x.shape, dt, 100 + 10 * seed + i))
        graph.replay()
        for out, ref in zip(outs, run()):
            torch.testing.assert_close(out, ref, atol=0, rtol=0)  # same kernels, same order


# ---------------------------------------------------------------------------------------------
# the model's fused paths (specserve.model.llama) against its plain torch path


def _tiny_model(dtype, device, seed=0, **overrides):
    from specserve.model.config import ModelConfig
    from specserve.model.llama import LlamaForCausalLM

    cfg = dict(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, attention_bias=True, qk_norm=True,
    )  # fmt: skip
    cfg.update(overrides)
    model = LlamaForCausalLM(ModelConfig(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms and biases random too
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.1))
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _logits(model, n_tokens, device, kernels, seed=1):
    from specserve.kv.pool import KVCache
    from specserve.model.runner import ModelRunner
    from specserve.ops.attention import TorchAttentionBackend
    from specserve.ops.attention_metadata import Segment, build_metadata

    cfg = model.config
    dtype = next(model.parameters()).dtype
    cache = KVCache(cfg.num_layers, n_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    slots = torch.arange(n_tokens)
    meta = build_metadata([Segment(slots, n_tokens, n_tokens)], slots.to(device), device)
    ids = torch.randint(
        0, cfg.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(seed)
    )
    runner = ModelRunner(model, cache, TorchAttentionBackend(), kernels)
    out = runner.forward(
        ids.to(device), torch.arange(n_tokens, device=device), meta, capture_layers=(1,)
    )
    with torch.inference_mode():
        return model.compute_logits(out.hidden, kernels), out.aux_hidden[0]


# The tiny model's qkv, gate_up and lm_head shapes (N, K); its o (64, 64) and down (64, 80)
# are left out, so mode 4 runs both the tuned GEMM and the F.linear fallback in one layer.
TINY_TUNED = ((128, 64), (160, 64), (96, 64))
TINY_ALL_TUNED = (*TINY_TUNED, (64, 64), (64, 80))


def _kernels(mode: int, max_tokens: int = 8, tuned=TINY_TUNED):
    """mode 0: torch ops; 1: F.linear + fused norms; 2: the skinny GEMM for few tokens;
    4: the batch-invariant GEMM for few tokens of the `tuned` weight shapes."""
    from specserve.config import Kernels

    return Kernels(
        skinny_gemm=mode == 2,
        skinny_gemm_max_tokens=max_tokens,
        fused_norms=mode >= 1,
        invariant_gemm_max_tokens=max_tokens if mode == 4 else 0,
        invariant_gemm_shapes=tuned if mode == 4 else (),
    )


@pytest.mark.parametrize("mode", [1, 2, 4])
@pytest.mark.parametrize("eagle_layer0", [False, True], ids=["norm", "identity_norm"])
def test_model_fused_paths_match_plain_torch_on_cpu(mode, eagle_layer0):
    # The fused paths on the CPU (interpreter, float32) check the wiring: norms fused into
    # qkv / gate_up, residual adds, SiLU-and-mul, add + RMSNorm, fp32 logits. Three layers,
    # layer 1 captured: mode 1 carries an MLP output into layer 1's capture (added there) and
    # into layer 2's first norm (added in the norm's kernel).
    from specserve.model.layers import fused_mode

    model = _tiny_model(torch.float32, DEVICE, num_layers=3)
    if eagle_layer0:  # EAGLE's first draft layer has no input norm
        model.model.layers[0].input_layernorm = torch.nn.Identity()
    ref, ref_aux = _logits(model, 5, DEVICE, _kernels(0))
    assert fused_mode(torch.zeros(5, 64, device=DEVICE), _kernels(mode)) == mode
    out, aux = _logits(model, 5, DEVICE, _kernels(mode))
    assert out.dtype == torch.float32
    torch.testing.assert_close(aux, ref_aux, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tuned", ["some", "all"])
def test_mode_4_arranges_a_layer_for_the_gemm_only_where_every_shape_is_tuned(monkeypatch, tuned):
    # Every matmul shape tuned: residual adds ride in the GEMMs, no add+RMSNorm kernel runs.
    # Some untuned: mode 1's arrangement (add+RMSNorm, the residual carried to the next norm),
    # the tuned matmuls still through the GEMM. Both compute what plain torch does.
    from specserve.model.layers import arrangement_mode
    from specserve.ops import triton_norm

    calls = []
    real = triton_norm.add_rmsnorm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_norm, "add_rmsnorm", spy)
    model = _tiny_model(torch.float32, DEVICE, num_layers=3)
    shapes = TINY_TUNED if tuned == "some" else TINY_ALL_TUNED
    kernels = _kernels(4, tuned=shapes)
    layer = model.model.layers[0]
    x = torch.zeros(5, 64, device=DEVICE)
    assert arrangement_mode(x, kernels, layer.linears) == (1 if tuned == "some" else 4)
    ref, ref_aux = _logits(model, 5, DEVICE, _kernels(0))
    out, aux = _logits(model, 5, DEVICE, kernels)
    torch.testing.assert_close(aux, ref_aux, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert bool(calls) == (tuned == "some")


@pytest.mark.parametrize("mode", [1, 4])
@pytest.mark.parametrize("eagle_layer0", [False, True], ids=["norm", "identity_norm"])
def test_decoder_layer_fused_path_matches_plain_and_keeps_its_input(eagle_layer0, mode):
    # A layer called on its own (a draft head's path, not the target's deferred residual):
    # mode 1 writes the MLP's sum into add_rmsnorm's fresh residual (GEMM with beta = 1), mode
    # 4 adds the residuals in the batch-invariant GEMM's epilogue; the caller's h must be
    # untouched and the output equal to plain torch's.
    from specserve.kv.pool import KVCache
    from specserve.model.layers import fused_mode
    from specserve.ops.attention import ForwardContext, TorchAttentionBackend
    from specserve.ops.attention_metadata import Segment, build_metadata

    model = _tiny_model(torch.float32, DEVICE, num_layers=1, attention_bias=False)
    layer = model.model.layers[0]
    if eagle_layer0:
        layer.input_layernorm = torch.nn.Identity()
    cfg, n = model.config, 6
    slots = torch.arange(n)
    meta = build_metadata([Segment(slots, n, n)], slots.to(DEVICE), DEVICE)

    def run(mode):
        kernels = _kernels(mode, max_tokens=1 if mode == 1 else 8, tuned=TINY_ALL_TUNED)
        cache = KVCache(1, n, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEVICE)
        ctx = ForwardContext(TorchAttentionBackend(), cache, meta, kernels=kernels)
        h = rand((n, cfg.hidden_size), torch.float32, 50)
        keep = h.clone()
        with torch.inference_mode():
            assert fused_mode(h, kernels) == mode
            out = layer(h, torch.arange(n, device=DEVICE), ctx)
        torch.testing.assert_close(h, keep, atol=0, rtol=0)
        return out

    torch.testing.assert_close(run(mode), run(0), atol=1e-5, rtol=1e-5)


def test_fused_mode_follows_the_kernels_and_the_token_count():
    from specserve.config import REFERENCE, Kernels
    from specserve.model.layers import fused_mode

    x = torch.zeros(3, 8)
    assert fused_mode(x, REFERENCE) == 0
    assert fused_mode(x, Kernels(fused_norms=True)) == 1
    skinny = Kernels(skinny_gemm=True, fused_norms=True, skinny_gemm_max_tokens=4)
    assert fused_mode(x, skinny) == 2
    assert fused_mode(torch.zeros(5, 8), skinny) == 1  # more rows than the skinny GEMM takes
    wide = Kernels(skinny_gemm=True, skinny_gemm_max_tokens=4, skinny_gemm_max_hidden=4)
    assert fused_mode(x, wide) == 0  # too wide, and no fused norms
    tuned = Kernels(fused_norms=True, invariant_gemm_max_tokens=4, invariant_gemm_shapes=((6, 8),))
    assert fused_mode(x, tuned) == 4  # an input as wide as a tuned weight's K
    assert fused_mode(torch.zeros(3, 16), tuned) == 1  # no tuned weight reads 16 columns
    assert fused_mode(torch.zeros(5, 8), tuned) == 1  # more rows than it takes


def test_tuned_shapes_run_the_invariant_gemm_and_the_others_f_linear(monkeypatch):
    # mode 4 routes by each weight's own shape: the tuned ones through the batch-invariant
    # GEMM, the others through F.linear, in the same layer
    from specserve.ops import triton_invariant_linear as inv

    seen = []
    real = inv.invariant_linear

    def spy(x, weight, *args, **kwargs):
        seen.append(tuple(weight.shape))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(inv, "invariant_linear", spy)
    model = _tiny_model(torch.float32, DEVICE)
    _logits(model, 3, DEVICE, _kernels(4))
    assert sorted(set(seen)) == sorted(TINY_TUNED)
    seen.clear()
    _logits(model, 9, DEVICE, _kernels(4))  # more rows than max_tokens: cuBLAS throughout
    assert seen == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n_tokens", [1, 7, 40])
def test_gpu_model_fused_paths_bf16(n_tokens):
    model = _tiny_model(
        torch.bfloat16, DEVICE, hidden_size=512, intermediate_size=1376, num_heads=8,
        num_kv_heads=2, head_dim=64, vocab_size=1000,
    )  # fmt: skip
    ref, _ = _logits(model, n_tokens, DEVICE, _kernels(0))
    tuned = ((768, 512), (2752, 512), (1000, 512))  # qkv, gate_up, lm_head; not o, down
    for mode in (1, 2, 4):
        out, _ = _logits(model, n_tokens, DEVICE, _kernels(mode, max_tokens=16, tuned=tuned))
        assert rel_err(out, ref) < 2e-2, (mode, rel_err(out, ref))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n_tokens", [1, 7, 49])
def test_gpu_logits_are_float32_not_rounded_to_bf16(n_tokens):
    # One token takes the skinny GEMM, more take cuBLAS writing float32: either way no bf16
    # rounding of the logits, whose ties would change argmaxes between batch sizes.
    model = _tiny_model(
        torch.bfloat16, DEVICE, hidden_size=512, intermediate_size=1376, num_heads=8,
        num_kv_heads=2, head_dim=64, vocab_size=1000,
    )  # fmt: skip
    h = rand((n_tokens, 512), torch.bfloat16, 60)
    kernels = Kernels(skinny_gemm=True, fused_norms=True, fp32_logits=True)
    with torch.inference_mode():
        logits = model.compute_logits(h, kernels, upcast=False)
    ref = h.float() @ model.lm_head_weight.float().T
    assert logits.dtype == torch.float32
    assert rel_err(logits, ref) < 1e-4  # bf16 output rounding alone is ~1e-3
    assert not torch.equal(logits, logits.to(torch.bfloat16).float())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA device of Hopper or later (programmatic dependent launch)",
)
def test_gpu_programmatic_launch_chain_computes_the_same_bits():
    # A chain of one-row matmuls, each reading the previous one's output, launched with
    # programmatic dependent launch and replayed from a CUDA graph: every kernel starts its
    # weight loads early but must read its input only once the previous kernel is done, so
    # the result is bit for bit the plain launches' (a read before the wait would see the
    # previous replay's values, which the fresh input below changes).
    from specserve.bench.gpu_timing import captured

    ws = [rand((512, 512), torch.bfloat16, 70 + i) * 0.05 for i in range(6)]
    norm = rand((512,), torch.bfloat16, 80).abs() + 0.5
    x = torch.zeros(1, 512, dtype=torch.bfloat16, device=DEVICE)

    def chain(pdl: bool):
        h = x
        for i, w in enumerate(ws):
            h = skinny_linear(h, w, norm_weight=norm if i % 2 else None, residual=h, pdl=pdl)
        return h

    graphs = {pdl: captured(lambda pdl=pdl: chain(pdl)) for pdl in (False, True)}
    for seed in range(3):
        x.copy_(rand((1, 512), torch.bfloat16, 90 + seed))
        outs = {}
        for pdl, (graph, out) in graphs.items():
            graph.replay()
            outs[pdl] = out.clone()
        assert torch.equal(outs[True], outs[False])
        assert torch.equal(outs[False], chain(False))
