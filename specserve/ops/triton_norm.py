"""Fused RMSNorm, residual-add + RMSNorm and SiLU-and-mul Triton kernels, with the torch
references they must match.

All are memory-bound elementwise/row ops that torch runs as several kernels (square, mean,
rsqrt, multiply, cast; add; silu, multiply): one pass each here. Math is float32, output in
the input dtype, as in `specserve.model.llama`, which uses them on CUDA for fp16/bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return h, rmsnorm_reference(h, weight, eps)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@triton.jit
def _rmsnorm_kernel(X, W, Y, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    # One program per row; the whole row fits in one block (hidden sizes are a few thousand).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (x * inv_rms * w).to(Y.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, weight, y, x2.stride(0), y.stride(0), n, eps,
            BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return y.view(x.shape)


@triton.jit
def _add_rmsnorm_kernel(
    X, R, W, H, Y, stride_x, stride_r, stride_h, stride_y, n_cols, eps, BLOCK: tl.constexpr
):
    # h = x + r rounded to the input dtype (as torch adds), then y = RMSNorm(h); one row each.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
    tl.store(H + row * stride_h + offs, h, mask=mask)
    hf = h.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (hf * inv_rms * w).to(Y.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h)) with h = x + residual, in one pass; both new tensors shaped like x."""
    n = x.shape[-1]
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    h = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    y = torch.empty_like(h)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _add_rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, h, y, x2.stride(0), r2.stride(0), h.stride(0), y.stride(0), n, eps,
            BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return h.view(x.shape), y.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
    # Grid: (row, column block). Gate is x[:, :n_cols], up is x[:, n_cols:].
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(Y + row * stride_y + offs, (silu * up).to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up where x = [gate | up] along the last dim; returns [..., last // 2]."""
    two_n = x.shape[-1]
    assert two_n % 2 == 0, "last dim must hold gate and up halves"
    n = two_n // 2
    x2 = x.reshape(-1, two_n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and n > 0:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, y, x2.stride(0), y.stride(0), n, BLOCK=block, num_warps=4
        )
    return y.view(*x.shape[:-1], n)
