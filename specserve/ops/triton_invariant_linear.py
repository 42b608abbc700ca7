"""Batch-invariant GEMM y = x @ W^T: each output row has the same bits whatever M is and
whatever the other rows hold (deterministic inference).

A row's result depends only on the instructions that reduce it, so nothing that reduces may
depend on M: one tile shape per weight shape (`invariant_config(N, K)`, never M), BLOCK_M fixed
at 16 rows (M beyond a tile launches more tiles, never a wider one), one program owning the
whole K range of its tile (no split-K), K walked in order in fixed BLOCK_K steps, tensor-core
products into an fp32 accumulator. Rows are independent inside `tl.dot` (an output element is
the same sum of the same products whichever row it sits in), and padding rows are zeros that
never reach a real row. The same kernel serves decode (M = batch), tree verification
(M = batch x nodes) and prefill, so a one-token decode and a verified tree node agree bit for
bit, as does a prompt alone and inside a batch.

Like the skinny GEMM (`ops/triton_linear.py`, whose prologue / epilogue helpers it shares) it
fuses an RMSNorm or SiLU-and-mul of x, bias, a residual add and an fp32 output, each per row.
The engine uses the epilogue only: with no split-K every program of a layer would redo its
rows' norm (or the SiLU of its K range), which costs more than a separate kernel
(`bench/weight_stream_bandwidth.py --fused`).
W is the left operand (swap AB: acc^T = W_tile @ x_tile^T), so a decode step's few rows pad to
16, not to 64; the M tiles of one W tile are launched next to each other so that at verify
widths W comes from L2 after its first read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from specserve.config.kernels import INVARIANT_GEMM_TILES
from specserve.ops.triton_linear import (
    _dot_k_step,
    _finish,
    _num_sms,
    _row_inv_rms,
    linear_io,
    linear_reference,
)

__all__ = ["InvariantConfig", "invariant_config", "invariant_linear", "linear_reference"]

BLOCK_M = 16  # rows per tile for every M: tl.dot's smallest shape, so decode pads the least


@triton.jit
def _invariant_gemm_kernel(
    X, W, Y, B, R, NW,
    M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, eps,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr,
    SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),), M tiles innermost (they share a W tile)
    tile = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tile % num_m
    pid_n = tile // num_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N  # rows past N read a valid row; their result is never stored
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    if HAS_NORM:
        inv_rms = _row_inv_rms(X, offs_m, m_mask, stride_xm, K, eps, BLOCK_M, BLOCK_K)
    else:
        inv_rms = tl.zeros([BLOCK_M], dtype=tl.float32)
    w_ptrs = W + offs_wn[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the one reduction order of every row
        acc = _dot_k_step(acc, X, NW, w_ptrs, k0, offs_k, offs_m, m_mask, stride_xm, K, inv_rms,
                          HAS_NORM, SILU_MUL, EVEN_K, DOT_PRECISION, DOT_UPCAST)  # fmt: skip
    mask = (offs_n < N)[:, None] & m_mask[None, :]
    _finish(acc, Y, B, R, offs_m, offs_n, mask, N, stride_ym, stride_rm, HAS_BIAS, HAS_RES)


@dataclass(frozen=True)
class InvariantConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if min(self.block_n, self.block_k) < 16:
            raise ValueError("blocks must be >= 16 (tl.dot's smallest shape)")


# Measured tiles keyed by the weight's (N, K) (never by M: that would break invariance), kept
# with the kernel choices in config/kernels.py (the resolver routes few-token matmuls of these
# shapes here); shapes not listed use the heuristic in `invariant_config`.
TUNED: Mapping[tuple[int, int], InvariantConfig] = MappingProxyType(
    {shape: InvariantConfig(*tile) for shape, tile in INVARIANT_GEMM_TILES.items()}
)

_CONFIGS: dict[tuple[int, int, int], InvariantConfig] = {}


def invariant_config(n: int, k: int, num_sms: int) -> InvariantConfig:
    """The tile of a weight [n, k]: a function of the weight's shape and the GPU, never of M.
    A TUNED entry, else: BLOCK_N the widest of 64 / 32 / 16 that still gives ~2 programs per
    SM at one M tile (no split-K here, so narrow layers need narrow tiles to fill the GPU);
    BLOCK_K streams 512 bytes of a W row per step."""
    key = (n, k, num_sms)
    cfg = _CONFIGS.get(key) or TUNED.get((n, k))
    if cfg is None:
        block_n = 16
        for bn in (64, 32):
            if triton.cdiv(n, bn) >= 2 * num_sms:
                block_n = bn
                break
        block_k = min(256, max(16, triton.next_power_of_2(k)))
        # W tiles in flight per program: a 64x256 bf16 tile is 32 KiB of shared memory
        stages = 3 if block_n == 64 else 4
        cfg = _CONFIGS[key] = InvariantConfig(block_n, block_k, num_warps=4, num_stages=stages)
    return cfg


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: InvariantConfig | None = None,
) -> torch.Tensor:
    """y = [residual +] f(x) @ weight^T [+ bias], f = RMSNorm(norm_weight) or SiLU-and-mul or
    identity (as `skinny_linear`), each row computed in an order independent of M.
    x [..., K] ([..., 2K] with silu_mul), weight [N, K] with unit stride along K; output
    [..., N] in out_dtype (default x's dtype), fp32 math, one rounding at the end."""
    io = linear_io(x, weight, bias, norm_weight, silu_mul, residual, out_dtype)
    if isinstance(io, torch.Tensor):
        return io  # nothing to compute (empty, or K == 0)
    x2, y, r2, lead, m, n, k = io
    cfg = config or invariant_config(n, k, _num_sms(x.device))
    # (CPU tensors: the Triton interpreter, whose dot has no bf16)
    upcast = x.device.type == "cpu" and x.dtype == torch.bfloat16
    grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(n, cfg.block_n),)
    _invariant_gemm_kernel[grid](
        x2, weight, y,
        bias if bias is not None else y,
        r2 if r2 is not None else y,
        norm_weight if norm_weight is not None else y,
        m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        r2.stride(0) if r2 is not None else 0, float(eps),
        HAS_BIAS=bias is not None, HAS_RES=r2 is not None, HAS_NORM=norm_weight is not None,
        SILU_MUL=silu_mul, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y.view(*lead, n)
