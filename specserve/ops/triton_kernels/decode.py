"""Split-KV ("flash-decoding") attention for batches of single-query requests.

At decode time one request contributes one query per head, so a program per (request, head)
would leave most of the GPU idle at small batch sizes and long contexts. Instead each request's
KV is cut into `num_splits` contiguous chunks; one program handles one (request, KV head,
chunk) for all the query heads sharing that KV head (GQA: K/V are read once per group), and
writes a normalised partial output plus its log-sum-exp. `merge_splits_kernel` then combines
the chunks. The split count is chosen on the host from host-side lengths.
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


@triton.jit
def _decode_split_kernel(
    Q,  # [B, H, D]: query b belongs to request b
    K,  # [num_slots, Hkv, D]
    V,
    kv_indptr,  # [B+1]
    kv_indices,  # slot ids
    O_part,  # [B, H, S, D] float32
    LSE_part,  # [B, H, S] float32, log2 units
    qk_scale,
    kv_per_split,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to >= 16 (tl.dot's minimum)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)  # a runtime value: no recompilation per split count
    num_heads = tl.num_programs(1) * GROUP

    kv_start = tl.load(kv_indptr + b).to(tl.int64)
    kv_len = tl.load(kv_indptr + b + 1).to(tl.int64) - kv_start
    lo = split * kv_per_split
    hi = tl.minimum(lo + kv_per_split, kv_len)  # lo >= hi: an empty chunk (shorter request)

    q, heads, h_mask, offs_d, d_mask = load_query_heads(
        Q, b, stride_qt, stride_qh, kv_head, GROUP, HEAD_DIM, BLOCK_H, BLOCK_D
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(kv_indices + kv_start + offs_n, mask=n_mask, other=0).to(tl.int64)
        acc, m_i, l_i = attend_kv_block(
            acc, m_i, l_i, q, K, V, slots, n_mask[None, :], kv_head,
            stride_ks, stride_kh, stride_vs, stride_vh, offs_d, d_mask, n_mask, qk_scale,
        )  # fmt: skip

    store_split(
        O_part, LSE_part, acc, m_i, l_i, b, heads, h_mask, split, num_splits, num_heads,
        offs_d, d_mask, HEAD_DIM,
    )  # fmt: skip


# Splits merged per pass: a fixed width, so one compiled variant merges any split count (a
# width rounded up from the count compiled anew when a longer context split more ways, 0.1 s
# in an H200 step of SmolLM2 that an eager first step of a new shape paid).
MERGE_BLOCK_S = 16


@triton.jit(do_not_specialize=["num_splits"])
def merge_splits_kernel(
    O_part,  # [T, H, S, D] float32, each split normalised on its own
    LSE_part,  # [T, H, S] float32, log2 units, -inf for empty splits
    Out,  # [T, H, D]
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits per pass (MERGE_BLOCK_S)
    BLOCK_D: tl.constexpr,
):
    """out = sum_s w_s * o_s / sum_s w_s with w_s = exp2(lse_s - max lse): exact softmax merge,
    BLOCK_S splits a pass with a running max (one pass when num_splits <= BLOCK_S)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    base = (t * num_heads + h) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_splits
        lse = tl.load(LSE_part + base + offs_s, mask=s_mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: all zero
        scale = tl.exp2(m - m_ref)  # (0 on the first pass: m is -inf)
        w = tl.exp2(lse - m_ref)
        o = tl.load(
            O_part + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * scale + tl.sum(o * w[:, None], 0)
        total = total * scale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(
        Out + t * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask
    )


def decode_attention(
    q: torch.Tensor,  # [B, H, D], last dim contiguous
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    out: torch.Tensor,  # [B, H, D]
    num_splits: int,
    kv_per_split: int,
    config: dict | None = None,
) -> None:
    """Launch sizes are all host integers; nothing here reads device memory.
    config overrides block_n / num_warps / num_stages (tuning)."""
    batch, num_heads, head_dim = q.shape
    block_d = max(16, triton.next_power_of_2(head_dim))  # (tl.dot needs K >= 16)
    cfg = {
        "block_n": kv_block_size(block_d, max(q.element_size(), k_cache.element_size())),
        "num_warps": 4,
        "num_stages": NUM_STAGES,
        **(config or {}),
    }
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    o_part = torch.empty(
        (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    lse_part = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, o_part, lse_part,
        head_dim**-0.5 * LOG2E, kv_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg["block_n"], BLOCK_D=block_d,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    merge_splits_kernel[(batch, num_heads)](
        o_part, lse_part, out, out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=MERGE_BLOCK_S, BLOCK_D=block_d,
        num_warps=1 if block_d <= 64 else 2,
    )  # fmt: skip
