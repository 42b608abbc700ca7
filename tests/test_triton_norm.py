"""Fused RMSNorm / residual-add + RMSNorm / SiLU-and-mul Triton kernels against their torch
references."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the fused norm kernels need the triton package")

from specserve.ops.triton_norm import (  # noqa: E402
    add_rmsnorm,
    add_rmsnorm_reference,
    rmsnorm,
    rmsnorm_reference,
    silu_and_mul,
    silu_and_mul_reference,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
DTYPES = [torch.float32] + (
    [
        pytest.param(torch.bfloat16, marks=pytest.mark.gpu),
        pytest.param(torch.float16, marks=pytest.mark.gpu),
    ]
    if CUDA
    else []
)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 96), (1, 4096), (0, 32)])
def test_rmsnorm(shape, dtype):
    x = rand(shape, dtype, seed=shape[-1])
    w = rand(shape[-1:], dtype, seed=1)
    out = rmsnorm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, rmsnorm_reference(x, w, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])


def test_rmsnorm_strided_rows_and_float32_weight():
    x = rand((6, 2, 48), torch.float32, seed=5)[:, 1]  # rows with a stride of 96
    w = rand((48,), torch.float32, seed=6)
    torch.testing.assert_close(rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 96), (1, 576), (0, 32)])
def test_add_rmsnorm(shape, dtype):
    x = rand(shape, dtype, seed=shape[-1] + 2)
    r = rand(shape, dtype, seed=shape[-1] + 3)
    w = rand(shape[-1:], dtype, seed=4)
    h, y = add_rmsnorm(x, r, w, 1e-5)
    h_ref, y_ref = add_rmsnorm_reference(x, r, w, 1e-5)
    assert h.shape == y.shape == x.shape and h.dtype == y.dtype == dtype
    torch.testing.assert_close(h, h_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(y, y_ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_add_rmsnorm_strided_rows():
    x = rand((6, 2, 48), torch.float32, seed=7)[:, 0]
    r = rand((6, 48), torch.float32, seed=8)
    w = rand((48,), torch.float32, seed=9)
    h, y = add_rmsnorm(x, r, w, 1e-6)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, rmsnorm_reference(x + r, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 40), (2, 3, 2 * 1500), (0, 16)])
def test_silu_and_mul(shape, dtype):
    x = rand(shape, dtype, seed=shape[-1] + 1)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_reference(x), atol=TOL[dtype], rtol=TOL[dtype])


def test_silu_and_mul_matches_model_formula():
    # The model computes F.silu(gate) * up on split halves: same function.
    x = rand((4, 2 * 33), torch.float32, seed=9)
    gate, up = x.split(33, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.gpu
@needs_cuda
def test_gpu_large_rows_bf16():
    x = rand((2048, 8192), torch.bfloat16, seed=3)
    w = rand((8192,), torch.bfloat16, seed=4)
    torch.testing.assert_close(
        rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5), atol=1.6e-2, rtol=1.6e-2
    )
    r = rand((2048, 8192), torch.bfloat16, seed=6)
    h, y = add_rmsnorm(x, r, w, 1e-5)
    h_ref, y_ref = add_rmsnorm_reference(x, r, w, 1e-5)
    torch.testing.assert_close(h, h_ref, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(y, y_ref, atol=1.6e-2, rtol=1.6e-2)
    y = rand((2048, 2 * 14336), torch.bfloat16, seed=5)
    torch.testing.assert_close(silu_and_mul(y), silu_and_mul_reference(y), atol=1.6e-2, rtol=1.6e-2)
