"""Shared pieces of the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl

# Scores are kept in log2 units (scale * log2(e) folded into one multiply) so that the softmax
# uses exp2, which maps to a single hardware instruction.
LOG2E = 1.4426950408889634

# Measured on an H200 (bench/attention_kernels.py --tune): a 3-stage pipeline of 64-position
# K/V blocks beats 2 stages by 1.5-2x for both kernels, the loop being latency-bound.
NUM_STAGES = 3


def kv_block_size(head_dim_padded: int, element_size: int, budget: int = 96 * 1024) -> int:
    """Largest KV block (<= 64 positions) whose pipelined K and V tiles stay within `budget`
    bytes of shared memory: 64 for 16-bit head_dim 128, 32 for float32 or head_dim 256."""
    block_n = 64
    while block_n > 16 and NUM_STAGES * 2 * block_n * head_dim_padded * element_size > budget:
        block_n //= 2
    return block_n


@triton.jit
def attend_kv_block(
    acc,  # [ROWS, BLOCK_D] float32, un-normalised output so far
    m_i,  # [ROWS] float32, running row max (log2 units), -inf where nothing seen yet
    l_i,  # [ROWS] float32, running sum of exp2(score - m_i)
    q,  # [ROWS, BLOCK_D] queries in the compute dtype
    K,
    V,
    slots,  # [BLOCK_N] int64 slot ids of this KV block (any value where not valid)
    visible,  # bool, broadcastable to [ROWS, BLOCK_N]: which scores count
    kv_head,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    offs_d,
    d_mask,
    n_mask,  # [BLOCK_N] which entries of the block exist (guards the loads)
    qk_scale,  # softmax scale * log2(e)
):
    """One flash-attention step: gather K/V rows by slot id, update (acc, m_i, l_i)."""
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    # "ieee" keeps float32 inputs exact (Triton's default for fp32 is tf32); for 16-bit inputs
    # it changes nothing.
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may have seen nothing yet and see nothing in this block either (masked tree rows):
    # subtract 0 instead of -inf so that exp2 yields 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    # As in flash-attention, the probabilities go into the second product in the input dtype;
    # the accumulator stays float32.
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def load_query_heads(
    Q,
    token,  # the query token's row in Q
    stride_qt,
    stride_qh,
    kv_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The query heads of one token that read KV head `kv_head` ([BLOCK_H, BLOCK_D], zero past
    GROUP heads and HEAD_DIM), with their head ids and the masks of both axes."""
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    return q, heads, h_mask, offs_d, d_mask


@triton.jit
def store_split(
    O_part,  # [T, H, S, D] float32
    LSE_part,  # [T, H, S] float32, log2 units
    acc,
    m_i,
    l_i,
    token,
    heads,
    h_mask,
    split,
    num_splits,
    num_heads,
    offs_d,
    d_mask,
    HEAD_DIM: tl.constexpr,
):
    """One KV split's normalised partial output and its log-sum-exp, for the merge. An empty
    split (nothing visible) stores output 0 with lse -inf, so the merge gives it no weight."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (token * num_heads + heads) * num_splits + split
    tl.store(LSE_part + row, lse, mask=h_mask)
    tl.store(
        O_part + row[:, None] * HEAD_DIM + offs_d[None, :],
        out,
        mask=h_mask[:, None] & d_mask[None, :],
    )
