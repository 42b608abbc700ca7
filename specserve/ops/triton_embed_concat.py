"""The EAGLE draft's input rows [embedding(token); feature] in one kernel.

Why: the draft runs once per drafting depth and once per draft extend, and at batch 1 its
input was two launches (the embedding's index-select, ~4-6 µs on an H200 for a few rows of a
49k-row table, and a concat) ahead of `fc`: one row copy per token does both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def embed_concat_reference(
    weight: torch.Tensor, ids: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """[T, H + F]: weight[ids] then features (both in weight's dtype)."""
    return torch.cat([weight[ids], features.to(weight.dtype)], dim=-1)


@triton.jit
def _embed_concat_kernel(
    W, Ids, Feat, Out,
    stride_w, stride_f, stride_o, hidden, feat_dim,
    BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(Ids + t).to(tl.int64)
    oh = tl.arange(0, BLOCK_H)
    mh = oh < hidden
    row = tl.load(W + tok * stride_w + oh, mask=mh)
    tl.store(Out + t * stride_o + oh, row, mask=mh)
    of = tl.arange(0, BLOCK_F)
    mf = of < feat_dim
    f = tl.load(Feat + t * stride_f + of, mask=mf)
    tl.store(Out + t * stride_o + hidden + of, f.to(Out.dtype.element_ty), mask=mf)


def embed_concat(weight: torch.Tensor, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """embed_concat_reference in one launch. weight [V, H] and features [T, F] with unit
    column stride; ids [T] (any integer dtype, contiguous)."""
    num_tokens, feat_dim = features.shape
    hidden = weight.shape[1]
    assert weight.stride(1) == 1 and features.stride(1) == 1 and ids.is_contiguous()
    out = torch.empty(num_tokens, hidden + feat_dim, dtype=weight.dtype, device=weight.device)
    if num_tokens:
        _embed_concat_kernel[(num_tokens,)](
            weight, ids, features, out,
            weight.stride(0), features.stride(0), out.stride(0), hidden, feat_dim,
            BLOCK_H=triton.next_power_of_2(hidden), BLOCK_F=triton.next_power_of_2(feat_dim),
        )  # fmt: skip
    return out
