"""The sampler's Gumbel-max draw as one split-row Triton reduction: argmax over the vocabulary
of logits / temperature + Gumbel noise, the noise hashed from (row key, column) in registers.

The torch reference (`gumbel_argmax_reference`, ops/sampling.py's formula) builds the noise
as [R, V] tensors: int64 hash rounds, then float32 uniforms and two logs, each a pass over
memory. A tree step samples every node (R = batch x nodes): SmolLM2's 6/8/64 tree at batch 32
has R = 2,048 rows of 49,152 columns, 768 MiB per int64 temporary, and at batch 256 the
temporaries of one step outgrow an H100's memory beside its KV cache. Here kernel 1 runs one
program per (row, chunk of columns) and writes the chunk's best score and its lowest column;
a torch argmax over the chunks (in column order, so the first maximum wins) picks the row's.

The hash is the reference's, in 32-bit unsigned arithmetic (a product masked to 32 bits is
the wrapped one), so the noise bits are equal; the division is correctly rounded, as torch's
(Triton's `/` is not); the logs are libdevice's, which may round differently from torch's in
the last place: draws equal the reference's except where two columns' scores are that
close. Each row's draw depends on that row alone, whatever else is in the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.sampling_params import GREEDY_BELOW

CHUNK, BLOCK = 4096, 1024
_NO_COL = tl.constexpr(0x7FFFFFFF)
# ops/sampling.py's multipliers for its mixer's rounds 2 and 3 (its 3rd, 4th and 1st)
_M0, _M2, _M3 = 0x7FEB352D, 0x297A2D39, 0x045D9F3B


def gumbel_argmax_reference(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    keys: torch.Tensor,
    floor: torch.Tensor | None = None,
) -> torch.Tensor:
    from specserve.ops.sampling import gumbel_noise

    temps = torch.where(temperatures >= GREEDY_BELOW, temperatures, torch.ones_like(temperatures))
    scaled = logits.float() / temps[:, None]
    scores = scaled + gumbel_noise(keys, logits.shape[-1])
    if floor is not None:
        scores = scores.masked_fill(scaled < floor[:, None], float("-inf"))
    return scores.argmax(dim=-1)


@triton.jit
def _mix(x, a: tl.constexpr, b: tl.constexpr):
    x = x ^ (x >> 16)
    x = x * a
    x = x ^ (x >> 15)
    x = x * b
    return x ^ (x >> 16)


@triton.jit
def _chunk_kernel(
    X, Temps, Keys, Floor, PartMax, PartCol,
    stride_x, n_cols, n_chunks, greedy_below,
    M0: tl.constexpr, M2: tl.constexpr, M3: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_FLOOR: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(Temps + row)
    t = tl.where(t >= greedy_below, t, 1.0)
    key = tl.load(Keys + row).to(tl.uint32)
    high = key >> 7
    if HAS_FLOOR:
        floor = tl.load(Floor + row)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_col = tl.full([BLOCK], _NO_COL, tl.int32)
    for start in tl.static_range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
        h = _mix(key ^ cols.to(tl.uint32), M2, M3)
        h = _mix(h ^ high, M3, M0)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        scaled = tl.math.div_rn(x, t)  # (rounded as torch divides)
        score = scaled - tl.log(-tl.log(u))
        if HAS_FLOOR:  # (the filters' floor, ops/triton_filter.py)
            inside = inside & (scaled >= floor)
        score = tl.where(inside, score, float("-inf"))
        better = score > lane_max  # (strictly: a lane keeps its lowest column on ties)
        lane_col = tl.where(better, cols, lane_col)
        lane_max = tl.where(better, score, lane_max)
    best = tl.max(lane_max, 0)
    col = tl.min(tl.where(lane_max == best, lane_col, _NO_COL), 0)
    # (a chunk entirely -inf: its first column, as argmax of such a row)
    col = tl.where(col == _NO_COL, chunk * CHUNK, col)
    tl.store(PartMax + row * n_chunks + chunk, best)
    tl.store(PartCol + row * n_chunks + chunk, col.to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    keys: torch.Tensor,
    floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row, the column of max(logits / t + Gumbel noise) (int64 [R]), t the row's
    temperature (1 below GREEDY_BELOW), the noise that of `keys` (int64 [R], each below
    2**32: ops/sampling.py's `noise_keys`); equal scores: the lowest column. logits: [R, V]
    float32/16-bit, rows may be strided (a last dim that is not contiguous is copied).
    floor (float32 [R]): only columns with logits / t >= the row's floor are drawn from."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    dev = logits.device
    if rows == 0:
        return torch.empty((0,), dtype=torch.int64, device=dev)
    n_chunks = max(1, -(-vocab // CHUNK))
    part_max = torch.empty((rows, n_chunks), dtype=torch.float32, device=dev)
    part_col = torch.empty((rows, n_chunks), dtype=torch.int64, device=dev)
    _chunk_kernel[(rows, n_chunks)](
        logits, temperatures.float().contiguous(), keys.contiguous(),
        keys if floor is None else floor.float().contiguous(), part_max, part_col,
        logits.stride(0), vocab, n_chunks, GREEDY_BELOW,
        M0=_M0, M2=_M2, M3=_M3, CHUNK=CHUNK, BLOCK=BLOCK, HAS_FLOOR=floor is not None,
        num_warps=4,
    )  # fmt: skip
    return part_col.gather(1, part_max.argmax(dim=1, keepdim=True)).squeeze(1)
