"""The sampler's top-k, top-p and min-p filters as one Triton search per row: the lowest scaled
logit the row keeps (its floor), found without sorting the vocabulary.

Each filter keeps a head of the row ordered by value: top-k the k likeliest tokens, top-p
(on the top-k's renormalised mass) those whose likelier tokens hold less than p of it, min-p
those at least min_p times as likely as the likeliest. So the tokens kept are those at or
above one value, and the draw (ops/triton_gumbel.py) skips the rest. Tokens of equal value
share their fate (a tie at the k-th value keeps every tied token), so the result does not
depend on the vocabulary's order; vLLM's and FlashInfer's top-k thresholds do the same.

The torch reference sorts every row: a tree step samples batch x nodes rows (SmolLM2's
6/8/64 tree at batch 200: 12,800 rows of 49,152), and the sort with its int64 indices, the
cumulative sums and the scatter back take several [R, V] temporaries and most of such a
step's time. Here one program per row searches the values' ordered bits: a pass over the row
counts the tokens above each of PIVOTS points spread over the interval still open (and sums
their probability), which narrows the interval PIVOTS-fold, so a 32-bit interval closes in
at most 8 passes at 16 pivots, and nothing of size [R, V] is written. Only the first passes
compare every token with every pivot: later ones skip the tiles with no token left inside
the interval.

Both find a row's floor with the same arithmetic, so a row gets the same floor from either,
alone or in any batch: each weight exp(value - max) is CUDA's expf (torch's exp; libdevice's
in the kernel) taken as an integer of FIXED_POINT units, masses are int64 sums of those,
exact in any order, and top_p x the top-k's mass is one float64 product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from specserve.sampling_params import GREEDY_BELOW

BLOCK, PIVOTS = 512, 16
# The reference's units of probability weight per 1.0: 2**23 weights of at most 1.0 sum below
# 2**63, and a weight below 2**-40 counts as none (the rounding of a float32 sum of 2**17).
FIXED_POINT = 2**40
_BELOW_ALL = tl.constexpr(-2147483648)  # ordered value of a column past the row's end


def filter_floor_reference(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> torch.Tensor:
    """float32 [R]: each row's floor (see the module's docstring) over logits / t, t the
    row's temperature (1 below GREEDY_BELOW); top_k <= 0 or >= V, top_p >= 1 and
    min_p <= 0 are off; NaN logits count as -inf."""
    temps = torch.where(temperatures >= GREEDY_BELOW, temperatures, torch.ones_like(temperatures))
    scaled = logits.float() / temps[:, None]
    scaled = scaled.masked_fill(scaled.isnan(), float("-inf"))
    vocab = scaled.shape[-1]
    values = scaled.sort(dim=-1, descending=True).values
    top = values[:, :1]
    e = torch.exp(values - torch.where(top == float("-inf"), 0.0, top))
    # masses as integer sums, exact in any order: a float32 sum's order follows the batch's
    # shape in torch, and a top-p boundary within its rounding of p would move with the batch
    weight = (e * FIXED_POINT).to(torch.int64)
    # tokens strictly above each value: the first index of its run of equal values
    above = torch.searchsorted(-values, -values, side="left")
    mass_above = (torch.cumsum(weight, dim=-1) - weight).gather(1, above)
    k = torch.where((top_ks > 0) & (top_ks < vocab), top_ks, vocab)
    in_top_k = above < k[:, None]
    kept_mass = (weight * in_top_k).sum(dim=-1, keepdim=True)
    limit = top_ps.double()[:, None] * kept_mass.double()
    in_top_p = (top_ps[:, None] >= 1.0) | (mass_above.double() < limit)
    in_min_p = e >= min_ps[:, None]
    kept = in_top_k & in_top_p & in_min_p
    kept[:, 0] = True
    return torch.where(kept, values, float("inf")).amin(dim=-1)


@triton.jit
def _ordered(x):
    """int32 with the order of the float32 values (-0.0 folded into +0.0); its own inverse."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    """The float32 value of an int32 in `_ordered`'s order."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _exp(x, CUDA_EXP: tl.constexpr):
    """expf as torch computes it on a GPU (libdevice's, not Triton's faster approximation);
    Triton's interpreter has no libdevice, and numpy's exp there is close to torch's."""
    if CUDA_EXP:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _weight(e):
    """A probability weight in FIXED_POINT units, as the reference takes it."""
    return (e * 1099511627776.0).to(tl.int64)  # (2**40)


@triton.jit
def _scaled_row(X, row_off, cols, n_cols, t):
    inside = cols < n_cols
    x = tl.load(X + row_off + cols, mask=inside, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, t)  # (rounded as torch divides)
    s = tl.where(s == s, s, float("-inf"))  # NaN as -inf, as the reference takes it
    return s, tl.where(inside, _ordered(s), _BELOW_ALL)


@triton.jit
def _above(
    X, row_off, n_cols, t, top, lo, hi, pivots,
    WITH_MASS: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr, CUDA_EXP: tl.constexpr,
):  # fmt: skip
    """Per pivot (each in [lo, hi)), the tokens whose ordered value is above it: their count
    and (WITH_MASS) their summed weights (`_weight`). A token at or above hi is above every
    pivot and one below lo above none, so only tiles holding a token in [lo, hi) compare
    with each pivot: after a pass or two of a search, few tiles do."""
    count = tl.zeros([BLOCK, P], tl.int32)
    mass = tl.zeros([BLOCK, P], tl.int64)
    count_over = tl.zeros([BLOCK], tl.int32)
    mass_over = tl.zeros([BLOCK], tl.int64)
    for start in range(0, n_cols, BLOCK):
        s, key = _scaled_row(X, row_off, start + tl.arange(0, BLOCK), n_cols, t)
        over = key >= hi
        count_over += over.to(tl.int32)
        if WITH_MASS:
            w = _weight(_exp(s - top, CUDA_EXP))
            mass_over += tl.where(over, w, 0)
        between = (key >= lo) & ~over
        if tl.max(between.to(tl.int32), 0) > 0:
            above = between[:, None] & (key[:, None] > pivots[None, :])
            count += above.to(tl.int32)
            if WITH_MASS:
                mass += tl.where(above, w[:, None], 0)
    return (
        tl.sum(count, 0) + tl.sum(count_over, 0),
        tl.sum(mass, 0) + tl.sum(mass_over, 0),
    )


@triton.jit
def _narrow(lo, hi, pivots, ok, P: tl.constexpr):
    """The interval left once `ok` (true from some pivot on) was tested at the pivots: the
    lowest value where it holds lies in [new lo, new hi]."""
    idx = tl.arange(0, P)
    first = P - tl.sum(ok.to(tl.int32), 0)  # the first pivot where it holds
    at_first = tl.sum(tl.where(idx == first, pivots, 0), 0)
    before = tl.sum(tl.where(idx == first - 1, pivots, 0), 0)
    return tl.where(first > 0, before + 1, lo), tl.where(first < P, at_first, hi)


@triton.jit
def _floor_kernel(
    X, Temps, TopKs, TopPs, MinPs, Floor, stride_x, n_cols, greedy_below,
    BLOCK: tl.constexpr, P: tl.constexpr, CUDA_EXP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_off = row * stride_x
    t = tl.load(Temps + row)
    t = tl.where(t >= greedy_below, t, 1.0)
    k = tl.load(TopKs + row)
    top_p = tl.load(TopPs + row)
    min_p = tl.load(MinPs + row)
    # the row's largest and smallest values bound the search
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_min = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s, _ = _scaled_row(X, row_off, cols, n_cols, t)
        lane_max = tl.maximum(lane_max, s)
        lane_min = tl.minimum(lane_min, tl.where(cols < n_cols, s, float("inf")))
    top_value = tl.max(lane_max, 0)
    top = tl.where(top_value == float("-inf"), 0.0, top_value)
    hi = _ordered(top_value).to(tl.int64)
    lo = _ordered(tl.min(lane_min, 0)).to(tl.int64)
    idx = tl.arange(0, P).to(tl.int64)
    # top-k: the lowest value with fewer than k tokens above it (no pass when off)
    k_hi = tl.where((k > 0) & (k < n_cols), hi, lo)
    while lo < k_hi:
        pivots = lo + ((k_hi - lo) * idx) // P
        count, _ = _above(
            X, row_off, n_cols, t, top, lo.to(tl.int32), k_hi.to(tl.int32),
            pivots.to(tl.int32), False, BLOCK, P, CUDA_EXP,
        )  # fmt: skip
        lo, k_hi = _narrow(lo, k_hi, pivots, count < k, P)
    # the top-k's mass, and the lowest value min-p keeps
    lane_mass = tl.zeros([BLOCK], tl.int64)
    lane_min_p = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        s, key = _scaled_row(X, row_off, start + tl.arange(0, BLOCK), n_cols, t)
        e = _exp(s - top, CUDA_EXP)
        lane_mass += tl.where(key >= lo.to(tl.int32), _weight(e), 0)
        lane_min_p = tl.minimum(lane_min_p, tl.where(e >= min_p, s, float("inf")))
    limit = top_p.to(tl.float64) * tl.sum(lane_mass, 0).to(tl.float64)
    # top-p: the lowest value with less than p of that mass above it (no pass when off)
    p_hi = tl.where(top_p < 1.0, hi, lo)
    while lo < p_hi:
        pivots = lo + ((p_hi - lo) * idx) // P
        _, mass = _above(
            X, row_off, n_cols, t, top, lo.to(tl.int32), p_hi.to(tl.int32),
            pivots.to(tl.int32), True, BLOCK, P, CUDA_EXP,
        )  # fmt: skip
        lo, p_hi = _narrow(lo, p_hi, pivots, mass.to(tl.float64) < limit, P)
    floor = _value(lo.to(tl.int32))
    floor = tl.where(min_p > 0.0, tl.maximum(floor, tl.min(lane_min_p, 0)), floor)
    tl.store(Floor + row, tl.minimum(floor, top_value))  # the likeliest token always stays


def filter_floor(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> torch.Tensor:
    """`filter_floor_reference` as one Triton program per row (float32 [R]). logits [R, V]
    float32/16-bit, rows may be strided; the parameters [R] each."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    floor = torch.empty((rows,), dtype=torch.float32, device=logits.device)
    if rows == 0:
        return floor
    _floor_kernel[(rows,)](
        logits, temperatures.float().contiguous(), top_ks.to(torch.int64).contiguous(),
        top_ps.float().contiguous(), min_ps.float().contiguous(), floor,
        logits.stride(0), vocab, GREEDY_BELOW, BLOCK=BLOCK, P=PIVOTS,
        CUDA_EXP=logits.is_cuda, num_warps=8,
    )  # fmt: skip
    return floor
