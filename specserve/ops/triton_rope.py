"""Fused rotary embedding + KV-cache write: one Triton kernel per layer instead of ~16 torch
kernels (cos/sin, rotate-half slices, multiplies, casts, two index_put writes).

Per token t: q[t] and k[t] are rotated (Hugging Face "rotate half" convention, float32
math from `inv_freq`, as `specserve.model.rope` does), the rotated k and the untouched v
are stored at cache slot `slots[t]`, and the rotated q is returned (contiguous). The
reference below is the composition of the model's torch code and `KVCache.write`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.ops.rotary import apply_rotary


def rope_and_write_reference(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,  # [D/2] float32
    k_cache: torch.Tensor,  # [S, Hk, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int
) -> torch.Tensor:
    q_rot, k_rot = apply_rotary(positions, inv_freq, q, k)
    k_cache[slots] = k_rot.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)
    return q_rot.contiguous()


@triton.jit
def _rotate_tile(x_ptr, row_stride, n_heads, cos, sin, offs_h, offs_d, half: tl.constexpr):
    """Load heads x (first half, second half) of one token and rotate them in float32."""
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < half)
    base = x_ptr + offs_h[:, None] * row_stride + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, mask


@triton.jit
def _rope_write_kernel(
    Q, K, V, Pos, InvFreq, KC, VC, Slots, QOut,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch, stride_ot, stride_oh, stride_pos, stride_slot,
    n_q_heads, n_kv_heads,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    pos = tl.load(Pos + t * stride_pos).to(tl.float32)
    inv = tl.load(InvFreq + offs_d, mask=offs_d < HALF, other=0.0)
    freqs = pos * inv
    cos = tl.cos(freqs)[None, :]
    sin = tl.sin(freqs)[None, :]

    offs_hq = tl.arange(0, BLOCK_HQ)
    q1, q2, mq = _rotate_tile(
        Q + t * stride_qt, stride_qh, n_q_heads, cos, sin, offs_hq, offs_d, HALF
    )
    out = QOut + t * stride_ot + offs_hq[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, q1.to(QOut.dtype.element_ty), mask=mq)
    tl.store(out + HALF, q2.to(QOut.dtype.element_ty), mask=mq)

    slot = tl.load(Slots + t * stride_slot).to(tl.int64)
    offs_hk = tl.arange(0, BLOCK_HK)
    k1, k2, mk = _rotate_tile(
        K + t * stride_kt, stride_kh, n_kv_heads, cos, sin, offs_hk, offs_d, HALF
    )
    dst = offs_hk[:, None] * stride_ch + offs_d[None, :] + slot * stride_cs
    tl.store(KC + dst, k1.to(KC.dtype.element_ty), mask=mk)
    tl.store(KC + dst + HALF, k2.to(KC.dtype.element_ty), mask=mk)
    src = V + t * stride_vt + offs_hk[:, None] * stride_vh + offs_d[None, :]
    tl.store(VC + dst, tl.load(src, mask=mk).to(VC.dtype.element_ty), mask=mk)
    tl.store(VC + dst + HALF, tl.load(src + HALF, mask=mk).to(VC.dtype.element_ty), mask=mk)


def rope_and_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k, write k and v into the cache at `slots`; return the rotated q.
    q, k, v may be strided views (e.g. of a fused qkv projection); the last dim must be
    contiguous."""
    num_tokens, n_q, head_dim = q.shape
    n_kv = k.shape[1]
    assert head_dim % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty((num_tokens, n_q, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    half = head_dim // 2
    _rope_write_kernel[(num_tokens,)](
        q, k, v, positions, inv_freq, k_cache, v_cache, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        positions.stride(0), slots.stride(0),  # index tensors may be broadcast views
        n_q, n_kv,
        HALF=half, BLOCK_D=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(n_q), BLOCK_HK=triton.next_power_of_2(n_kv),
    )  # fmt: skip
    return out
