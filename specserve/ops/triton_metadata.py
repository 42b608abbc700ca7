"""A decode step's device-side attention metadata in one kernel (the torch reference,
`ops/attention_metadata.py: _device_metadata_tensors_reference`, runs without triton).

`build_device_metadata` turns each request's device KV length and its owned slots into the
flattened `kv_indptr` / `kv_indices` (plus the uniform `qo_indptr`, `extra_lens` and
`mask_indptr`). In torch that is about fifteen small kernels (zeros, cumsum, arange,
searchsorted, clamp, two gathers, where, full, ...), and it runs three times per speculative
decode step inside the CUDA graph: at batch 1 on a small model those launches alone are a few
percent of a step. Here it is one launch.

Grid over blocks of flattened KV entries t in [0, total_upper). Each program loads
visible_lens in chunks of at most MAX_BLOCK_B requests, takes their inclusive cumsum c (carried
across chunks) and, for every t, counts the requests with c[b] <= t (the owner: searchsorted
right) and the largest such c[b] (the owner's exclusive start kv_indptr[owner]; lengths are
non-negative, so c is non-decreasing and that maximum is c[owner - 1]). Entries past the real
total (t >= kv_indptr[B]: the slack of the host's upper bounds) are 0, as in the reference;
for the others the owner is < B, so the reference's clamp to B - 1 never matters, and the
position is clamped to [0, width - 1] as there. Program 0 also writes kv_indptr, qo_indptr,
extra_lens and mask_indptr. Nothing depends on a device value on the host: capturable.

Limit: MAX_BLOCK_B = 128 requests per chunk, with BLOCK_T * BLOCK_B <= 8192, because the
[BLOCK_T, BLOCK_B] comparison lives in registers; larger batches loop over chunks (correct for
every B, each program then reads all B lengths).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_B = 128  # requests per chunk of the [BLOCK_T, BLOCK_B] comparison
TILE = 8192  # BLOCK_T * BLOCK_B: bounds the comparison's registers per program
MAX_BLOCK_T = 1024


@triton.jit
def _device_metadata_kernel(
    Slots, Lens, QoIndptr, KvIndptr, KvIndices, ExtraLens, MaskIndptr,
    B, width, total_upper, slot_stride_b, slot_stride_p, lens_stride,
    q_len, extra_len, mask_stride,
    HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    # Program 0 writes the [B + 1] tensors: n_ptr of their entries (0 elsewhere; integer
    # bounds rather than a scalar `pid == 0` mask, which the interpreter mishandles).
    n_ptr = tl.where(pid == 0, B + 1, 0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_b = tl.arange(0, BLOCK_B)
    count = tl.zeros([BLOCK_T], dtype=tl.int32)  # requests whose cumsum is <= t
    start = tl.zeros([BLOCK_T], dtype=tl.int64)  # the largest such cumsum (owner's start)
    carry = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int64), axis=0)  # cumsum before the chunk
    for b0 in range(0, B, BLOCK_B):
        b = b0 + offs_b
        mb = b < B
        lens = tl.load(Lens + b * lens_stride, mask=mb, other=0).to(tl.int64)
        c = tl.cumsum(lens, axis=0) + carry
        tl.store(KvIndptr + 1 + b, c, mask=b < n_ptr - 1)
        le = (c[None, :] <= t[:, None]) & mb[None, :]
        count += tl.sum(le.to(tl.int32), axis=1)
        start = tl.maximum(start, tl.max(tl.where(le, c[None, :], 0), axis=1))
        carry += tl.sum(lens, axis=0)
    in_range = t < total_upper
    valid = in_range & (t < carry)  # past the real total: the upper bounds' slack, 0
    pos = tl.minimum(tl.maximum(t - start, 0), width - 1)
    src = Slots + count.to(tl.int64) * slot_stride_b + pos * slot_stride_p
    val = tl.load(src, mask=valid, other=0)
    tl.store(KvIndices + t, val, mask=in_range)
    for i0 in range(0, B + 1, BLOCK_B):
        i = (i0 + offs_b).to(tl.int64)
        mi = i < n_ptr
        tl.store(QoIndptr + i, i * q_len, mask=mi)
        tl.store(ExtraLens + i, tl.zeros([BLOCK_B], dtype=tl.int64) + extra_len, mask=i < n_ptr - 1)
        if HAS_MASK:
            tl.store(MaskIndptr + i, i * mask_stride, mask=mi)
    tl.store(
        KvIndptr + offs_b, tl.zeros([BLOCK_B], dtype=tl.int64), mask=offs_b < tl.minimum(n_ptr, 1)
    )


def device_metadata_tensors(
    owned_slots: torch.Tensor,
    visible_lens: torch.Tensor,
    total_upper: int,
    q_len: int,
    extra_len: int,
    with_mask: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qo_indptr, kv_indptr, kv_indices, extra_lens, mask_indptr or None), bit for bit the
    reference's, in one launch. owned_slots: [B, width] (any strides, any integer dtype:
    kv_indices takes it, as torch.where does); visible_lens: [B] non-negative integers (any
    stride); total_upper: the host's bound on their sum (sizes kv_indices)."""
    bsz, width = owned_slots.shape
    dev = owned_slots.device
    i64 = torch.int64
    qo_indptr = torch.empty(bsz + 1, dtype=i64, device=dev)
    kv_indptr = torch.empty(bsz + 1, dtype=i64, device=dev)
    # at least one element so the kernel never gets a null pointer (total_upper may be 0)
    kv_indices = torch.empty(max(total_upper, 1), dtype=owned_slots.dtype, device=dev)
    kv_indices = kv_indices[:total_upper]
    extra_lens = torch.empty(max(bsz, 1), dtype=i64, device=dev)[:bsz]
    mask_indptr = torch.empty(bsz + 1, dtype=i64, device=dev) if with_mask else None
    # at least 2: no size-1 scans or reductions (the masks cover the extra lane)
    block_b = min(triton.next_power_of_2(max(bsz, 2)), MAX_BLOCK_B)
    block_t = min(MAX_BLOCK_T, TILE // block_b)  # fixed per B: one compile per chunk size
    grid = (max(1, triton.cdiv(total_upper, block_t)),)
    _device_metadata_kernel[grid](
        owned_slots, visible_lens, qo_indptr, kv_indptr, kv_indices, extra_lens,
        mask_indptr if with_mask else qo_indptr,
        bsz, width, total_upper, owned_slots.stride(0), owned_slots.stride(1),
        visible_lens.stride(0), q_len, extra_len, q_len * extra_len,
        HAS_MASK=with_mask, BLOCK_T=block_t, BLOCK_B=block_b,
    )  # fmt: skip
    return qo_indptr, kv_indptr, kv_indices, extra_lens, mask_indptr
