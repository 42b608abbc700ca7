"""Fused rotary embedding + KV-cache write against the model's torch code."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the fused rope kernel needs the triton package")

from specserve.model.config import RopeScaling  # noqa: E402
from specserve.model.rope import rope_inv_freq  # noqa: E402
from specserve.ops.triton_rope import rope_and_write, rope_and_write_reference  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def case(num_tokens, n_q, n_kv, head_dim, dtype, seed, num_slots=64, scaling=None):
    g = torch.Generator().manual_seed(seed)
    # q, k, v as strided views of one fused projection, as the model produces them
    qkv = torch.randn(num_tokens, (n_q + 2 * n_kv) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.to(DEVICE).split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    q = q.view(num_tokens, n_q, head_dim)
    k = k.view(num_tokens, n_kv, head_dim)
    v = v.view(num_tokens, n_kv, head_dim)
    positions = torch.randint(0, 5000, (num_tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens].to(DEVICE)
    inv_freq = rope_inv_freq(head_dim, 500000.0, scaling).to(DEVICE)
    caches = [
        torch.randn(num_slots, n_kv, head_dim, generator=g).to(dtype).to(DEVICE) for _ in "kv"
    ]
    return q, k, v, positions, inv_freq, caches, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, n_q, n_kv, head_dim",
    [(1, 4, 2, 16), (7, 9, 3, 64), (5, 32, 8, 128), (3, 6, 6, 32)],
)
def test_matches_reference(num_tokens, n_q, n_kv, head_dim, dtype):
    seed = num_tokens * 100 + n_q
    q, k, v, pos, inv, (kc, vc), slots = case(num_tokens, n_q, n_kv, head_dim, dtype, seed)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref_q = rope_and_write_reference(q, k, v, pos, inv, kc_ref, vc_ref, slots)
    out_q = rope_and_write(q, k, v, pos, inv, kc, vc, slots)
    tol = TOL[dtype]
    torch.testing.assert_close(out_q.float(), ref_q.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kc.float(), kc_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(vc, vc_ref)  # v is copied, not computed
    untouched = torch.ones(kc.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(kc[untouched], kc_ref[untouched])


def test_llama3_scaled_frequencies():
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    q, k, v, pos, inv, (kc, vc), slots = case(6, 8, 2, 64, torch.float32, 3, scaling=scaling)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref_q = rope_and_write_reference(q, k, v, pos, inv, kc_ref, vc_ref, slots)
    out_q = rope_and_write(q, k, v, pos, inv, kc, vc, slots)
    torch.testing.assert_close(out_q, ref_q, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc, kc_ref, atol=2e-5, rtol=2e-5)


def test_broadcast_position_and_slot_views():
    """Positions of a drafted frontier are one value expanded over its nodes (stride 0)."""
    q, k, v, _, inv, (kc, vc), _ = case(4, 4, 2, 16, torch.float32, 5)
    positions = torch.tensor([[37]], device=DEVICE).expand(1, 4).reshape(-1)
    assert positions.stride(0) == 0
    slots = torch.arange(0, 16, 2, device=DEVICE)[::2]  # strided
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref_q = rope_and_write_reference(q, k, v, positions, inv, kc_ref, vc_ref, slots)
    out_q = rope_and_write(q, k, v, positions, inv, kc, vc, slots)
    torch.testing.assert_close(out_q, ref_q, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc, kc_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(vc, vc_ref)
