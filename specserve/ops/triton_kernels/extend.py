"""Flash-attention over paged KV for requests with any number of queries.

Request b's KV (gathered through `kv_indices`, so page size does not matter) is a cached
prefix that every query sees, followed by `extra_len` entries under a mask: causal aligned at
the end, or a per-request bool block [q_len, extra_len] (tree verification / drafting). The two
parts are separate loops so the prefix loop does no mask work.

GQA: rows of a program are (query, head-in-group) pairs of one KV head, so each K/V block is
loaded once for the whole group, and tiny q_len (tree nodes, q_len == 1 with a mask) still
fill the 16-row minimum of tl.dot when the group is large.

Split prefix: a 64-node tree verify at batch 1 has only (64 * group / BLOCK_M) * kv_heads
programs (32 for Llama-3-8B), far fewer than the GPU's SMs, each walking the whole context.
With num_splits > 1 the prefix is cut into chunks handled by separate programs (the last one
also does the extra part), and `merge_splits_kernel` combines their partial results, as in
split-KV decoding.

Aligned (deterministic inference, unsplit): the prefix loop stops at the last whole KV block
of the prefix and the masked loop starts there, so every query walks its KV in blocks
aligned to logical position 0 whatever the prefix length: a row's result is then the same
whether its prompt was prefilled in one chunk, in several, after a cached prefix, or
beside other requests (rows of a tile never mix in tl.dot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.ops.triton_kernels.common import LOG2E, NUM_STAGES, attend_kv_block, kv_block_size
from specserve.ops.triton_kernels.decode import MERGE_BLOCK_S, merge_splits_kernel

EXTEND_BLOCK_M = 64  # rows ((query, head) pairs) per program
MIN_BLOCK_M = 16  # tl.dot's smallest tile


def extend_block_m(rows_per_request: int) -> int:
    """Rows of a program: a short verify (a chain of 2 verifies 3 nodes: 12 rows under a GQA
    group of 4) takes the smallest tile that holds its rows, so it computes no empty rows and
    its programs are light; anything longer takes the 64-row tile."""
    if rows_per_request >= EXTEND_BLOCK_M:
        return EXTEND_BLOCK_M
    return max(MIN_BLOCK_M, triton.next_power_of_2(rows_per_request))


# (the split count is a loop bound and an index, not a shape: not specialized, so a longer
# context split more ways runs the variant compiled at start-up)
@triton.jit(do_not_specialize=["num_splits"])
def _extend_kernel(
    Q,  # [T, H, D]
    K,  # [num_slots, Hkv, D]
    V,
    Out,  # [T, H, D]; with SPLIT, the float32 partials [T, H, S, D]
    LSE_part,  # [T, H, S] float32 (SPLIT only)
    qo_indptr,
    kv_indptr,
    kv_indices,
    extra_lens,
    custom_mask,  # uint8 view of the flattened bool blocks (unused without CUSTOM_MASK)
    mask_indptr,
    qk_scale,
    num_splits,
    prefix_per_split,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    CUSTOM_MASK: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for merge_splits_kernel
    ALIGNED: tl.constexpr,  # blocks aligned to position 0 (not with SPLIT)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    num_heads = (tl.num_programs(2) // num_splits) * GROUP

    q_start = tl.load(qo_indptr + b).to(tl.int64)
    q_len = tl.load(qo_indptr + b + 1).to(tl.int64) - q_start
    kv_start = tl.load(kv_indptr + b).to(tl.int64)
    kv_len = tl.load(kv_indptr + b + 1).to(tl.int64) - kv_start
    extra = tl.load(extra_lens + b).to(tl.int64)
    prefix = kv_len - extra

    # Row r of this block is query r // GROUP, head kv_head * GROUP + r % GROUP.
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = qi < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # The grid is sized for the longest request; blocks past this request's rows do no work.
    active = m_block * BLOCK_M < q_len * GROUP
    if ALIGNED:
        prefix_lo = 0
        prefix_hi = tl.where(active, prefix - prefix % BLOCK_N, 0)
        do_extra = active
    elif not SPLIT:
        prefix_lo = 0
        prefix_hi = tl.where(active, prefix, 0)
        do_extra = active
    else:
        prefix_lo = split * prefix_per_split
        prefix_hi = tl.where(active, tl.minimum(prefix_lo + prefix_per_split, prefix), 0)
        do_extra = active & (split == num_splits - 1)
    if CUSTOM_MASK:
        extra_end = kv_len
        mask_start = tl.load(mask_indptr + b).to(tl.int64)
    else:
        # Causal: query i sees extra entry j iff j <= i + extra - q_len, so the block's last
        # query bounds how far into the extra part it needs to go (the query of the block's
        # last row, which may hold only some of its heads when BLOCK_M % GROUP != 0).
        last_q = (tl.minimum((m_block + 1) * BLOCK_M, q_len * GROUP) - 1) // GROUP
        extra_end = prefix + tl.minimum(extra, tl.maximum(last_q + extra - q_len + 1, 0))
    extra_lo = prefix_hi if ALIGNED else prefix  # ALIGNED: the prefix's partial block too
    extra_end = tl.where(do_extra, extra_end, extra_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1) Cached prefix (this split's chunk of it): visible to every query.
    for start in range(prefix_lo, prefix_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < prefix_hi
        slots = tl.load(kv_indices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        acc, m_i, l_i = attend_kv_block(
            acc, m_i, l_i, q, K, V, slots, n_mask[None, :], kv_head,
            stride_ks, stride_kh, stride_vs, stride_vh, offs_d, d_mask, n_mask, qk_scale,
        )  # fmt: skip

    # 2) Extra part under the mask. Blocks start at `prefix`, not at a multiple of BLOCK_N
    # (the gather makes alignment irrelevant), except ALIGNED, where they start at the
    # prefix's last partial block and its prefix columns (j < 0) are visible to all.
    for start in range(extra_lo, extra_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < extra_end
        slots = tl.load(kv_indices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        j = offs_n - prefix  # column within the extra part
        if CUSTOM_MASK:
            bits = tl.load(
                custom_mask + mask_start + qi[:, None] * extra + j[None, :],
                mask=row_mask[:, None] & (n_mask & (j >= 0))[None, :],
                other=0,
            )
            visible = ((bits != 0) | (j < 0)[None, :]) & n_mask[None, :]
        else:
            visible = (j[None, :] <= (qi + extra - q_len)[:, None]) & n_mask[None, :]
        acc, m_i, l_i = attend_kv_block(
            acc, m_i, l_i, q, K, V, slots, visible, kv_head,
            stride_ks, stride_kh, stride_vs, stride_vh, offs_d, d_mask, n_mask, qk_scale,
        )  # fmt: skip

    # A row that saw nothing (an empty split, or a degenerate mask) gets 0, not NaN, and in a
    # split run an lse of -inf, so the merge gives it no weight.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    out_mask = row_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        out_ptr = Out + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh
        tl.store(out_ptr + offs_d[None, :], out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        part = ((q_start + qi) * num_heads + heads) * num_splits + split  # into [T, H, S]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE_part + part, lse, mask=row_mask)
        tl.store(Out + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)


def extend_attention(
    q: torch.Tensor,  # [T, H, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, H, D]
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    extra_lens: torch.Tensor,
    custom_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    batch_size: int,
    max_q_len: int,
    num_splits: int = 1,
    prefix_per_split: int = 0,
    config: dict | None = None,
    aligned: bool = False,
) -> None:
    """Host integers (batch size, longest q_len, split plan) size the launch: nothing here
    reads device memory. With num_splits > 1, split s covers prefix positions
    [s * prefix_per_split, (s + 1) * prefix_per_split) and the last split the extra part.
    config overrides block_m / block_n / num_warps / num_stages (tuning).
    aligned: KV blocks aligned to position 0 (module doc), unsplit only."""
    if aligned and num_splits > 1:
        raise ValueError("aligned blocks need num_splits == 1")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # (tl.dot needs K >= 16)
    # 64-row tiles with 3 stages were the best or near it for tree verify, extend and prefill
    # in the H200 sweep (bench/attention_kernels.py --tune); short verifies take smaller ones.
    cfg = {
        # aligned rows keep one tile whatever the query count: Triton picks the MMA
        # instruction (and so a row's accumulation order) by tile
        "block_m": EXTEND_BLOCK_M if aligned else extend_block_m(max_q_len * group),
        "block_n": kv_block_size(block_d, max(q.element_size(), k_cache.element_size())),
        "num_warps": 4,
        "num_stages": NUM_STAGES,
        **(config or {}),
    }
    has_mask = custom_mask is not None
    mask_arg = custom_mask.view(torch.uint8) if has_mask else qo_indptr  # placeholder pointer
    if num_splits > 1:
        dst = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        dst, lse = out, out  # lse unused
    grid = (triton.cdiv(max_q_len * group, cfg["block_m"]), batch_size, num_kv_heads * num_splits)
    _extend_kernel[grid](
        q, k_cache, v_cache, dst, lse, qo_indptr, kv_indptr, kv_indices, extra_lens,
        mask_arg, mask_indptr if has_mask else qo_indptr,
        head_dim**-0.5 * LOG2E, num_splits, prefix_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        CUSTOM_MASK=has_mask, SPLIT=num_splits > 1, ALIGNED=aligned,
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_D=block_d,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_kernel[(num_tokens, num_heads)](
            dst, lse, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=MERGE_BLOCK_S, BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2,
        )  # fmt: skip
