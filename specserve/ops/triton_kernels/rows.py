"""Batch-invariant attention for decode steps: one reduction order per query row.

Every query row (one query token, the query heads of one KV head) attends over its *visible*
KV in logical order: the request's cached prefix, then the extra entries its mask lets it see
(its ancestors and itself in a verified tree, in node order; causal otherwise), compacted, so
the row's list does not depend on where masked entries sit. A one-token decode of the token at
depth d sees prefix + d committed tokens + itself; the same token as a tree node sees prefix +
its d ancestors + itself: the same list, the same KV bits, hence the same result.

The list is walked in fixed BLOCK_N blocks from position 0 and cut into fixed CHUNK-position
splits (flash-decoding), so the split count of a row is cdiv(its length, CHUNK): set by the row
alone, never by the batch, the tree width or the GPU. `_merge_rows_kernel` combines a row's
splits one after the other in split order (trailing empty splits leave it untouched). Each
program holds one query token's GROUP heads padded to 16 rows, the same tile in every forward.

The price against the shared-tile extend kernel: a tree node reads the request's prefix on
its own (from L2 after the first node), and the compaction of a custom mask row costs a
little integer work in the blocks that reach the extra part.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.ops.triton_kernels.common import (
    LOG2E,
    NUM_STAGES,
    attend_kv_block,
    kv_block_size,
    load_query_heads,
    store_split,
)

ROW_KV_CHUNK = 256  # KV positions per split: a multiple of every KV block size
_MASK_CHUNK = 64  # mask columns compacted per step


@triton.jit
def _visible_extra(mrow, extra, MASK_CHUNK: tl.constexpr):
    """Number of set entries in the mask row mrow[0:extra]."""
    n = tl.zeros([MASK_CHUNK], tl.int32)
    for j0 in range(0, extra, MASK_CHUNK):
        j = j0 + tl.arange(0, MASK_CHUNK)
        n += (tl.load(mrow + j, mask=j < extra, other=0) != 0).to(tl.int32)
    return tl.sum(n, 0)


@triton.jit
def _nth_visible(mrow, extra, k, MASK_CHUNK: tl.constexpr):
    """Column of the k-th (0-based) set entry of mrow[0:extra], for each k of a block:
    #{j : set entries in [0, j] <= k}."""
    col = tl.zeros_like(k)
    seen = tl.zeros([1], tl.int32)
    for j0 in range(0, extra, MASK_CHUNK):
        j = j0 + tl.arange(0, MASK_CHUNK)
        valid = j < extra
        bits = (tl.load(mrow + j, mask=valid, other=0) != 0).to(tl.int32)
        cs = seen + tl.cumsum(bits, 0)
        below = (cs[None, :] <= k[:, None]) & valid[None, :]
        col += tl.sum(below.to(tl.int32), 1).to(col.dtype)
        seen += tl.sum(bits, 0)
    return col


# One compiled variant for every forward: whether a custom mask is given is a runtime value
# (not a constexpr), so plain decode and tree verify run the same instructions.
@triton.jit(do_not_specialize=["has_mask"])
def _row_split_kernel(
    Q,  # [T, H, D]
    K,  # [num_slots, Hkv, D]
    V,
    O_part,  # [T, H, S, D] float32, each split normalised on its own
    LSE_part,  # [T, H, S] float32, log2 units, -inf for an empty split
    token_request,  # [T] request of each query token
    qo_indptr,
    kv_indptr,
    kv_indices,
    extra_lens,
    custom_mask,  # uint8 view of the flattened bool blocks (read only if has_mask)
    mask_indptr,
    has_mask,  # 1: custom_mask governs the extra part; 0: causal
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    MASK_CHUNK: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_heads = tl.num_programs(1) * GROUP

    b = tl.load(token_request + t).to(tl.int64)
    q_start = tl.load(qo_indptr + b).to(tl.int64)
    q_len = tl.load(qo_indptr + b + 1).to(tl.int64) - q_start
    i = t - q_start  # the query's index within its request
    kv_start = tl.load(kv_indptr + b).to(tl.int64)
    kv_len = tl.load(kv_indptr + b + 1).to(tl.int64) - kv_start
    extra = tl.load(extra_lens + b).to(tl.int64)
    prefix = kv_len - extra
    n_vis = tl.minimum(tl.maximum(i + extra - q_len + 1, 0), extra)  # causal, aligned at the end
    mrow = custom_mask + tl.load(mask_indptr + b).to(tl.int64) + i * extra
    if has_mask != 0:
        n_vis = _visible_extra(mrow, extra, MASK_CHUNK).to(tl.int64)
    length = prefix + n_vis  # the row's visible KV
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, length)  # lo >= hi: a split past the row's end

    q, heads, h_mask, offs_d, d_mask = load_query_heads(
        Q, t, stride_qt, stride_qh, kv_head, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # logical positions in the row's visible list
        n_mask = pos < hi
        col = pos - prefix  # column in the extra part (causal: the visible ones come first)
        if (has_mask != 0) & (start + BLOCK_N > prefix):
            col = _nth_visible(mrow, extra, pos - prefix, MASK_CHUNK)
        idx = tl.where(pos < prefix, pos, prefix + col)
        slots = tl.load(kv_indices + kv_start + idx, mask=n_mask, other=0).to(tl.int64)
        acc, m_i, l_i = attend_kv_block(
            acc, m_i, l_i, q, K, V, slots, n_mask[None, :], kv_head,
            stride_ks, stride_kh, stride_vs, stride_vh, offs_d, d_mask, n_mask, qk_scale,
        )  # fmt: skip

    store_split(
        O_part, LSE_part, acc, m_i, l_i, t, heads, h_mask, split, num_splits, num_heads,
        offs_d, d_mask, HEAD_DIM,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])  # (one variant for any context length)
def _merge_rows_kernel(
    O_part,
    LSE_part,
    Out,  # [T, H, D]
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The splits of one (token, head) in split order, one at a time (online softmax); an empty
    split (lse -inf: past the row's end) leaves the running state as it is, so a row's result
    does not depend on how many splits the grid had."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    base = (t * num_heads + h) * num_splits
    one = tl.arange(0, 1)
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(num_splits):
        lse = tl.load(LSE_part + base + s + one)
        o = tl.load(O_part + (base + s) * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
        valid = lse > float("-inf")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)  # 0 at the first valid split (m = -inf)
        w = tl.exp2(lse - m_new)
        acc = tl.where(valid, acc * alpha + o * w, acc)
        total = tl.where(valid, total * alpha + w, total)
        m = tl.where(valid, m_new, m)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(
        Out + t * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask
    )


def token_requests(qo_indptr: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] request of each query token, on the device (no host read; graph-capturable)."""
    t = torch.arange(num_tokens, device=qo_indptr.device, dtype=qo_indptr.dtype)
    return torch.searchsorted(qo_indptr[1:].contiguous(), t, right=True)


def row_attention(
    q: torch.Tensor,  # [T, H, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, H, D]
    token_request: torch.Tensor,  # [T], see token_requests
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    extra_lens: torch.Tensor,
    custom_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    max_kv_len: int,
    chunk: int = ROW_KV_CHUNK,
) -> None:
    """Attention of every query row over its visible KV in one fixed order (module doc).
    max_kv_len: a host bound of every request's kv_len (it sizes the split grid only)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # (tl.dot needs K >= 16)
    block_n = kv_block_size(block_d, max(q.element_size(), k_cache.element_size()))
    if chunk % block_n:
        raise ValueError(f"chunk {chunk} is not a multiple of the KV block {block_n}")
    splits = max(1, triton.cdiv(max_kv_len, chunk))
    o_part = torch.empty(
        (num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
    )
    lse_part = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
    has_mask = custom_mask is not None
    _row_split_kernel[(num_tokens, num_kv_heads, splits)](
        q, k_cache, v_cache, o_part, lse_part, token_request, qo_indptr, kv_indptr, kv_indices,
        extra_lens,
        # placeholders of the same types without a mask: one compiled variant
        (custom_mask if has_mask else qo_indptr).view(torch.uint8),
        mask_indptr if has_mask else qo_indptr,
        int(has_mask),
        head_dim**-0.5 * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        CHUNK=chunk, MASK_CHUNK=_MASK_CHUNK,
        num_warps=4, num_stages=NUM_STAGES,
    )  # fmt: skip
    _merge_rows_kernel[(num_tokens, num_heads)](
        o_part, lse_part, out, out.stride(0), out.stride(1), splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=1 if block_d <= 64 else 2,
    )  # fmt: skip
