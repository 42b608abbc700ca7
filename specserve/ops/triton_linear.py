"""Skinny GEMM y = x @ W^T for few tokens (decode, verify), reading W at close to HBM speed.

At batch 1..64 a linear layer is a stream over W ([N, K], row-major as nn.Linear stores it):
every byte of W is read once and used M times, so speed is the fraction of HBM bandwidth the
kernel reaches. Two kernels, chosen per (M, N, K) by `pick_config` (a deterministic function
of host shapes: no autotuning, so a call may be captured in a CUDA graph once warmed up):

- `fma` (M = 1; larger M re-runs per row, W then mostly comes from L2): a program owns
  BLOCK_N rows of W and streams them along K in wide, 16-byte vector loads, multiplying
  with x in fp32 registers ([BLOCK_N, BLOCK_K] partial sums, reduced once at the end).
- `dot` (M >= 2): the same W tile goes through tensor cores as the left operand (swap AB:
  y^T = W x^T), x padded to 16+ rows; W is the only big stream, pipelined by num_stages.

Split-K only where N / BLOCK_N leaves SMs idle: every split writes an fp32 partial, and the
last split of a tile to arrive (an atomic ticket per output tile) adds the partials in a
fixed order, so results do not depend on timing; the ticket counter resets itself.

Fused around the stream, each optional, so that a decoder layer needs no elementwise kernels
between its matmuls: an RMSNorm of x (`norm_weight`: rows are normalised in a prologue,
rounded to x's dtype as an unfused RMSNorm would); SiLU-and-mul (`silu_mul`: x = [gate | up],
2K wide); bias; a residual added in fp32 before the single rounding (`residual`); and an
fp32 output (`out_dtype`, logits).

Everything is computed from host shapes: fixed grid, allocations sized by shapes only, no
host synchronisation. The split-K ticket buffer is allocated on the first split-K call on
a device: make that call (engine warm-up does) before capturing a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# ---------------------------------------------------------------------------------------------
# references


def linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """What `skinny_linear` computes, as separate torch ops (each rounded to x's dtype)."""
    if norm_weight is not None:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        x = (xf * norm_weight.float()).to(x.dtype)
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x, weight, bias)
    if residual is not None:
        y = residual + y
    return y if out_dtype is None else y.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _row_inv_rms(
    X, offs_m, m_mask, stride_xm, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    """1 / rms of rows offs_m of X[:, :K] (fp32, [BLOCK_M])."""
    offs_k = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(
            X + offs_m[:, None] * stride_xm + kk[None, :],
            mask=m_mask[:, None] & (kk < K)[None, :],
            other=0.0,
        ).to(tl.float32)
        ss += x * x
    return 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)


@triton.jit
def _load_x(
    X, NW, offs_m, m_mask, kk, k_mask, stride_xm, K, inv_rms,
    HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """x[offs_m, kk] after the fused prologue, in x's dtype ([BLOCK_M, BLOCK_K])."""
    ptrs = X + offs_m[:, None] * stride_xm + kk[None, :]
    if EVEN_K:
        mask = m_mask[:, None]
    else:
        mask = m_mask[:, None] & k_mask[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    if SILU_MUL:
        up = tl.load(ptrs + K, mask=mask, other=0.0)
        # F.silu then * up, each rounded to x's dtype, as the unfused model computes it
        g = x.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(x.dtype)
        x = (s.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    if HAS_NORM:
        if EVEN_K:
            nw = tl.load(NW + kk)
        else:
            nw = tl.load(NW + kk, mask=k_mask, other=0.0)
        xf = x.to(tl.float32) * inv_rms[:, None]
        x = (xf * nw.to(tl.float32)[None, :]).to(x.dtype)
    return x


@triton.jit
def _dot_k_step(
    acc, X, NW, w_ptrs, k0, offs_k, offs_m, m_mask, stride_xm, K, inv_rms,
    HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] += W[:, k0:k0+BLOCK_K] @ f(x)[:, k0:k0+BLOCK_K]^T on tensor cores
    (the skinny dot kernel's K loop and the batch-invariant GEMM's)."""
    kk = k0 + offs_k
    k_mask = kk < K
    x = _load_x(X, NW, offs_m, m_mask, kk, k_mask, stride_xm, K, inv_rms,
                HAS_NORM, SILU_MUL, EVEN_K)  # fmt: skip
    if EVEN_K:
        w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
    if DOT_UPCAST:  # the interpreter's tl.dot mishandles bf16: test the logic in fp32
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    return tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)


@triton.jit
def _epilogue(
    acc, Y, B, R, P, C, tile, pid_k, offs_m, offs_n, M, N, stride_ym, stride_rm,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """acc: fp32 [BLOCK_N, BLOCK_M] (y transposed). Split-K: partial, ticket, last one sums."""
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if SPLIT_K > 1:
        # partial[pid_k, m, n] in fp32, the last split of this tile to arrive adds them up
        p_ptrs = P + offs_m[None, :] * N + offs_n[:, None]
        tl.store(p_ptrs + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is issued before the ticket is taken
        ticket = tl.atomic_add(C + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros_like(acc)
            for s in range(SPLIT_K):  # fixed order: deterministic
                acc += tl.load(p_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _finish(acc, Y, B, R, offs_m, offs_n, mask, N, stride_ym, stride_rm, HAS_BIAS, HAS_RES)
            tl.atomic_xchg(C + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        _finish(acc, Y, B, R, offs_m, offs_n, mask, N, stride_ym, stride_rm, HAS_BIAS, HAS_RES)


@triton.jit
def _finish(
    acc, Y, B, R, offs_m, offs_n, mask, N, stride_ym, stride_rm,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    if HAS_RES:
        r = tl.load(R + offs_m[None, :] * stride_rm + offs_n[:, None], mask=mask, other=0.0)
        acc += r.to(tl.float32)
    tl.store(
        Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty), mask=mask
    )


@triton.jit
def _skinny_fma_kernel(
    X, W, Y, B, R, NW, P, C,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, stride_rm, eps,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr,
    SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(N, BLOCK_N) * M, SPLIT_K); one row of x per program (consecutive programs
    # share a W block, so for M > 1 the repeats come from L2)
    if PDL:  # the next kernel may start its own weight loads while this one finishes
        gdc_launch_dependents()
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tile % M
    pid_n = tile // M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N  # rows past N read a valid row; their result is never stored
    offs_m = tl.full([1], 0, tl.int32) + pid_m
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_wn[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    k_begin = pid_k * K_SPLIT
    k_hi = tl.minimum(k_begin + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PREFETCH:  # registers hold the next W tile while this one is used: 2 tiles in flight
        w_next = tl.load(
            w_ptrs + k_begin,
            mask=(k_begin + offs_k < k_hi)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
    if PDL:  # W is constant; x, the residual and the outputs wait for the previous kernel
        gdc_wait()
    if HAS_NORM:
        inv_rms = _row_inv_rms(X, offs_m, m_mask, stride_xm, K, eps, 1, BLOCK_K)
    else:
        inv_rms = tl.zeros([1], dtype=tl.float32)
    for k0 in range(k_begin, k_begin + K_SPLIT, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        if PREFETCH:
            w = w_next
            w_next = tl.load(
                w_ptrs + (k0 + BLOCK_K),
                mask=(kk + BLOCK_K < k_hi)[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
        elif EVEN_K:
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
        x = _load_x(X, NW, offs_m, m_mask, kk, k_mask, stride_xm, K, inv_rms,
                    HAS_NORM, SILU_MUL, EVEN_K)  # fmt: skip
        acc += w.to(tl.float32) * x.to(tl.float32)
    y = tl.sum(acc, axis=1)[:, None]  # [BLOCK_N, 1]
    _epilogue(y, Y, B, R, P, C, tile, pid_k, offs_m, offs_n, M, N, stride_ym, stride_rm,
              HAS_BIAS, HAS_RES, SPLIT_K)  # fmt: skip


@triton.jit
def _skinny_dot_kernel(
    X, W, Y, B, R, NW, P, C,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, stride_rm, eps,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr,
    SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M), SPLIT_K); acc = W_tile @ x_tile^T
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_n = tile % num_n
    pid_m = tile // num_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    if HAS_NORM:
        inv_rms = _row_inv_rms(X, offs_m, m_mask, stride_xm, K, eps, BLOCK_M, BLOCK_K)
    else:
        inv_rms = tl.zeros([BLOCK_M], dtype=tl.float32)
    w_ptrs = W + offs_wn[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    k_begin = pid_k * K_SPLIT
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_begin + K_SPLIT, BLOCK_K):
        acc = _dot_k_step(acc, X, NW, w_ptrs, k0, offs_k, offs_m, m_mask, stride_xm, K, inv_rms,
                          HAS_NORM, SILU_MUL, EVEN_K, DOT_PRECISION, DOT_UPCAST)  # fmt: skip
    _epilogue(acc, Y, B, R, P, C, tile, pid_k, offs_m, offs_n, M, N, stride_ym, stride_rm,
              HAS_BIAS, HAS_RES, SPLIT_K)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# configs

NUM_SMS_DEFAULT = 132  # H200 / H100 SXM; the device's own count is used when CUDA is there


@dataclass(frozen=True)
class LinearConfig:
    kind: str  # "fma" (M == 1 per program, fp32 FMAs) or "dot" (tensor cores, x padded)
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 16  # dot only: rows of x per program (>= 16)
    prefetch: bool = True  # fma only: load the next W tile before using this one

    def __post_init__(self):
        if self.kind not in ("fma", "dot"):
            raise ValueError(f"kind must be 'fma' or 'dot', not {self.kind!r}")
        for name in ("block_n", "block_k", "block_m", "split_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.kind == "dot" and min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError("dot blocks must be >= 16 (tl.dot's smallest shape)")


# Measured overrides, keyed (m_bucket, N, K) with m_bucket = next power of two of M (at least
# 1): `bench/linear_kernels.py --tune` prints entries in this form, to be pasted here. Anything
# not listed uses the heuristic in `pick_config`.
TUNED: Mapping[tuple[int, int, int], LinearConfig] = MappingProxyType({})


def m_bucket(m: int) -> int:
    return 1 if m <= 1 else triton.next_power_of_2(m)


def _pow2_floor(v: float) -> int:
    p = 1
    while p * 2 <= v:
        p *= 2
    return p


def _num_sms(device: torch.device | None) -> int:
    if device is not None and device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return NUM_SMS_DEFAULT


_SM_COUNTS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _split_for(tiles: int, k: int, block_k: int, sms: int) -> int:
    """Split K while the grid leaves SMs idle and each split keeps >= 2 K blocks."""
    split = 1
    while tiles * split < sms and k >= split * 4 * block_k and split < 16:
        split *= 2
    return split


def pick_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT) -> LinearConfig:
    """Deterministic choice from shapes: TUNED entry, else the heuristic below."""
    tuned = TUNED.get((m_bucket(m), n, k))
    if tuned is not None:
        return tuned
    if m == 1:
        # Stream BLOCK_N rows x 512 columns per step (16-byte loads, 32 elements a thread,
        # twice that in flight with the prefetch). ~80 registers a thread let ~12 two-warp
        # programs share an SM: N ~ 4-6k in 4-row programs is one wave of ~8-12 per SM;
        # larger N goes 8 rows at a time, small N fewer rows for enough programs.
        block_k = min(512, max(16, triton.next_power_of_2(k)))
        block_n = 8 if n >= 4 * 4 * num_sms * 8 else max(1, min(4, _pow2_floor(n / (4 * num_sms))))
        num_warps = max(1, min(8, block_n * block_k // 1024))
        split = _split_for(triton.cdiv(n, block_n), k, block_k, num_sms)
        return LinearConfig("fma", block_n, block_k, split, num_warps, num_stages=3)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_k = 256 if block_m <= 16 else 128
    m_tiles = triton.cdiv(m, block_m)
    block_n = 16
    for bn in (64, 32):
        if triton.cdiv(n, bn) * m_tiles >= num_sms:
            block_n = bn
            break
    split = _split_for(triton.cdiv(n, block_n) * m_tiles, k, block_k, num_sms)
    # 4 stages: 3 W tiles in flight per program while the oldest one is multiplied
    return LinearConfig("dot", block_n, block_k, split, num_warps=4, num_stages=4, block_m=block_m)


_PICKED: dict[tuple[int, int, int, int], LinearConfig] = {}


def _picked(m: int, n: int, k: int, sms: int) -> LinearConfig:
    """pick_config, memoised (launch overhead); TUNED is read at the first call of a shape."""
    key = (m, n, k, sms)
    cfg = _PICKED.get(key)
    if cfg is None:
        cfg = _PICKED[key] = pick_config(m, n, k, sms)
    return cfg


# ---------------------------------------------------------------------------------------------
# launcher

_TICKETS: dict[torch.device, torch.Tensor] = {}
_TICKET_SLOTS = 1 << 15


def _tickets(device: torch.device, tiles: int) -> torch.Tensor:
    if tiles > _TICKET_SLOTS:
        raise ValueError(f"split-K over {tiles} tiles (at most {_TICKET_SLOTS}): use split_k=1")
    t = _TICKETS.get(device)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "skinny_linear: first split-K call inside CUDA graph capture; run it once "
                "eagerly (warm-up) so that the ticket buffer exists before capture"
            )
        t = torch.zeros(_TICKET_SLOTS, dtype=torch.int32, device=device)
        _TICKETS[device] = t
    return t


def linear_io(x, weight, bias, norm_weight, silu_mul, residual, out_dtype):
    """The checks and the 2-D layout every fused linear kernel shares: (x2 [M, K'], the
    output y [M, N], residual r2 [M, N] or None, x's leading shape, M, N, K), or the result
    itself when there is nothing to stream (M or N is 0, or K is 0: an empty sum)."""
    n, k = weight.shape
    kx = 2 * k if silu_mul else k
    if x.shape[-1] != kx:
        raise ValueError(f"x has {x.shape[-1]} columns, weight {tuple(weight.shape)} needs {kx}")
    if norm_weight is not None and silu_mul:
        raise ValueError("norm_weight and silu_mul do not combine")
    if weight.stride(1) != 1:
        raise ValueError("weight needs unit stride along K")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype}, weight {weight.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, kx)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*lead, n)
    if k == 0:
        y.zero_()
        if bias is not None:
            y += bias
        if residual is not None:
            y += residual.reshape(m, n)
        return y.view(*lead, n)
    r2 = None
    if residual is not None:
        r2 = residual.reshape(m, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    return x2, y, r2, lead, m, n, k


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: LinearConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """y = [residual +] f(x) @ weight^T [+ bias], f = RMSNorm(norm_weight) or SiLU-and-mul or
    identity; x [..., K] ([..., 2K] with silu_mul), weight [N, K] with unit column stride.
    Output [..., N] in out_dtype (default x's dtype); math in fp32, one rounding at the end.
    pdl: launch the one-row kernel with programmatic dependent launch (Hopper and later): it
    loads its first W tile before waiting for the previous kernel to finish (no effect on
    the tensor-core kernel; results are the same bits)."""
    io = linear_io(x, weight, bias, norm_weight, silu_mul, residual, out_dtype)
    if isinstance(io, torch.Tensor):
        return io  # nothing to compute (empty, or K == 0)
    x2, y, r2, lead, m, n, k = io
    cfg = config or _picked(m, n, k, _num_sms(x.device))
    if cfg.kind == "fma":
        tiles = triton.cdiv(n, cfg.block_n) * m
    else:
        tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    split = cfg.split_k
    k_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_split)  # splits that have work
    even_k = k_split * split == k
    if split > 1:
        partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        tickets = _tickets(x.device, tiles)
    else:
        partial = tickets = y
    args = (
        x2, weight, y,
        bias if bias is not None else y,
        r2 if r2 is not None else y,
        norm_weight if norm_weight is not None else y,
        partial, tickets,
        m, n, k, k_split, x2.stride(0), weight.stride(0), y.stride(0),
        r2.stride(0) if r2 is not None else 0, float(eps),
    )  # fmt: skip
    flags = dict(
        HAS_BIAS=bias is not None,
        HAS_RES=r2 is not None,
        HAS_NORM=norm_weight is not None,
        SILU_MUL=silu_mul,
        EVEN_K=even_k,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.kind == "fma":
        _skinny_fma_kernel[(tiles, split)](
            *args, PREFETCH=cfg.prefetch, PDL=pdl, launch_pdl=pdl, **flags
        )
    else:
        # (CPU tensors: the Triton interpreter, whose dot has no bf16)
        upcast = x.device.type == "cpu" and x.dtype == torch.bfloat16
        precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
        _skinny_dot_kernel[(tiles, split)](
            *args, BLOCK_M=cfg.block_m, DOT_PRECISION=precision, DOT_UPCAST=upcast, **flags
        )
    return y.view(*lead, n)
