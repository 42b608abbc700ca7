"""Row top-k of log_softmax and row argmax as split-row Triton reductions (two launches each).

Torch runs `log_softmax(logits.float()).topk(k)` as a cast, a softmax kernel and a multi-block
radix top-k, and `logits.argmax(-1)` as one block reducing a whole row at batch 1; in decode
steps of small models these cost tens of microseconds per call. Here kernel 1 runs one program
per (row, chunk of columns) and writes the chunk's max, sum of exp (online, float32) and its
k best candidates; kernel 2 runs one program per row and merges the chunks' partials. Launch
sizes come from host ints only (no device->host copy), so both can be captured in CUDA graphs.

Measured on an H200 (bench/topk_kernels.py, CUDA-graph replay, bf16 logits): T=1, V=49,152:
top-8 12 us (torch 70), argmax 7 us (torch 20); T=512, V=128,256: top-8 116 us (torch 1262).
Called eagerly, the two Triton launches cost ~30-90 us of Python overhead: capture them.

Candidates are int64 keys: the float32 value's bits in the high word, mapped so that signed
integer order is float order (-0.0 folded into +0.0), and 0x7FFFFFFF - column in the low word.
One integer max is then "largest value, lowest column among equal values": the tie rule of
both functions. Selection is on the float32 logits; log_softmax is monotone, so the order
is that of the reference except where distinct logits round to one log-prob (a tie there).

Rows entirely -inf: ids are 0..k-1 (argmax: 0) and log-probs NaN, as torch's log_softmax
of such a row. Rows with some -inf entries rank those after every finite entry, lowest
column first. NaN logits are not supported (no defined order is promised).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 16
# Chunk plans, from graph-timed sweeps on an H200 (bench/topk_kernels.py --sweep):
# - latency (few rows: T * V / MIN_CHUNK <= LATENCY_PROGRAMS): chunks of MIN_CHUNK columns
#   (at least V / MAX_CHUNKS), one tile each: 48 programs at T = 1, V = 49,152;
# - throughput (more rows): about THROUGHPUT_COLUMNS columns a program, 1-2 warps, small tiles
#   (after the first tiles few beat the chunk's k-th best, and those skip the key work).
MIN_CHUNK, MAX_CHUNK, MAX_CHUNKS, MAX_BLOCK = 1024, 16384, 128, 2048
LATENCY_PROGRAMS, THROUGHPUT_COLUMNS = 1024, 2048

_LOG2E = tl.constexpr(1.4426950408889634)
_EMPTY = tl.constexpr(-0x7FFFFFFFFFFFFFFF)  # below every real key (-inf included)
_FULL = tl.constexpr(0x7FFFFFFFFFFFFFFF)  # padding slots of a candidate list: never its min
_NO_COL = tl.constexpr(0x7FFFFFFF)


def row_topk_logprobs_reference(
    logits: torch.Tensor, k: int, id_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return values, (ids if id_map is None else id_map[ids])


def row_argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


@triton.jit
def _encode(x, cols):
    """int64 keys of float32 values at int32 columns."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 ties with +0.0
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # negative: flip magnitude
    return (ordered << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _decode(key):
    """(float32 value, int64 column) of int64 keys."""
    ordered = (key >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    col = 0x7FFFFFFF - key.to(tl.int32)  # the low word is below 2**31
    return bits.to(tl.float32, bitcast=True), col.to(tl.int64)


@triton.jit
def _chunk_kernel(
    X, PartKeys, PartMax, PartSum,
    stride_x, n_cols, n_chunks,
    K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    WITH_LSE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_row = X + row * stride_x
    offs = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, KP)
    # K > 1: the chunk's K best keys, unsorted, all distinct: empty slots _EMPTY + slot
    # (below any real key), slots >= K padding that is never the minimum
    best = tl.where(offs_k < K, _EMPTY + offs_k.to(tl.int64), _FULL)
    low = tl.min(best, 0)
    # K == 1: per-lane max and its column (no keys, no reduction until the end)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_col = tl.full([BLOCK], _NO_COL, tl.int32)
    m = float("-inf")
    s = 0.0
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, n_cols)
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        mask = cols < hi
        x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if K == 1:  # strict >: a lane's later columns lose ties; unset lanes take any column
            take = (x > lane_max) | ((lane_col == _NO_COL) & mask)
            lane_max = tl.where(take, x, lane_max)
            lane_col = tl.where(take, cols, lane_col)
        else:
            tile_max = tl.max(x, 0)
        if WITH_LSE:  # online logsumexp in float32
            m_new = tl.maximum(m, tl.max(x, 0) if K == 1 else tile_max)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: no NaN
            p = tl.exp2((x - m_ref) * _LOG2E)
            s = s * tl.exp2((m - m_ref) * _LOG2E) + tl.sum(p, 0)
            m = m_new
        if K > 1:
            # a tile can change the list only if the list has an empty slot or the tile's
            # max beats the list's minimum (an equal value loses: its column is higher)
            low_value, _ = _decode(low)
            if (low < _EMPTY + KP) | (tile_max > low_value):
                keys = tl.where(mask, _encode(x, cols), _EMPTY)
                top = tl.max(keys, 0)
                # replace the list's minimum by the tile's maximum while that improves it
                while top > low:
                    best = tl.where(best == low, top, best)
                    keys = tl.where(keys == top, _EMPTY, keys)
                    top = tl.max(keys, 0)
                    low = tl.min(best, 0)
    if K == 1:
        chunk_max = tl.max(lane_max, 0)
        col = tl.min(tl.where(lane_max == chunk_max, lane_col, _NO_COL), 0)
        best = tl.where(offs_k == 0, _encode(chunk_max, col), best)
    part = row * n_chunks + chunk
    tl.store(PartKeys + part * K + offs_k, best, mask=offs_k < K)
    if WITH_LSE:
        tl.store(PartMax + part, m)
        tl.store(PartSum + part, s)


@triton.jit
def _merge_kernel(
    PartKeys, PartMax, PartSum, OutLogp, OutIds, IdMap,
    n_chunks, stride_lp, stride_id,
    K: tl.constexpr, KP: tl.constexpr, NP: tl.constexpr, CP: tl.constexpr,
    WITH_LSE: tl.constexpr, HAS_MAP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    n = n_chunks * K
    offs = tl.arange(0, NP)
    keys = tl.load(PartKeys + row * n + offs, mask=offs < n, other=_EMPTY)
    offs_k = tl.arange(0, KP)
    top = tl.full([KP], _EMPTY, tl.int64)
    for r in tl.static_range(K):  # K rounds of "take the largest key, drop it"
        key = tl.max(keys, 0)
        top = tl.where(offs_k == r, key, top)
        keys = tl.where(keys == key, _EMPTY, keys)
    values, ids = _decode(top)
    if HAS_MAP:  # a reduced draft vocabulary: column -> target token id
        ids = tl.load(IdMap + ids, mask=offs_k < K, other=0)
    tl.store(OutIds + row * stride_id + offs_k, ids, mask=offs_k < K)
    if WITH_LSE:
        offs_c = tl.arange(0, CP)
        cmask = offs_c < n_chunks
        m = tl.load(PartMax + row * n_chunks + offs_c, mask=cmask, other=float("-inf"))
        s = tl.load(PartSum + row * n_chunks + offs_c, mask=cmask, other=0.0)
        mx = tl.max(m, 0)
        mx_ref = tl.where(mx == float("-inf"), 0.0, mx)
        total = tl.sum(s * tl.exp2((m - mx_ref) * _LOG2E), 0)
        # torch's order of operations: x - max - log(sum); a row all -inf gives NaN as torch
        logp = (values - mx) - tl.log(total)
        tl.store(OutLogp + row * stride_lp + offs_k, logp, mask=offs_k < K)


def plan_chunks(num_rows: int, vocab: int, k: int = 1) -> tuple[int, int]:
    """(chunk, block): columns per kernel-1 program and per loaded tile (powers of two)."""
    cap = max(16, triton.next_power_of_2(vocab))
    if num_rows * -(-vocab // MIN_CHUNK) <= LATENCY_PROGRAMS:
        chunk = min(cap, max(MIN_CHUNK, triton.next_power_of_2(-(-vocab // MAX_CHUNKS))))
        return chunk, min(chunk, MAX_BLOCK)
    want = triton.next_power_of_2(-(-num_rows * vocab // THROUGHPUT_COLUMNS))
    chunk = min(cap, max(MIN_CHUNK, triton.next_power_of_2(-(-vocab // MAX_CHUNKS)), want))
    return min(chunk, MAX_CHUNK), min(chunk, 256 if k > 1 else 512)


def _check(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _select(
    logits: torch.Tensor,
    k: int,
    with_lse: bool,
    out_logp: torch.Tensor | None,
    out_ids: torch.Tensor,
    chunk: int | None,
    block: int | None,
    warps: tuple[int, int] | None = None,  # (kernel 1, kernel 2) num_warps: tuning only
    id_map: torch.Tensor | None = None,
) -> None:
    rows, vocab = logits.shape
    plan_chunk, plan_block = plan_chunks(rows, vocab, k)
    chunk = chunk or plan_chunk
    block = block or min(chunk, plan_block)
    assert chunk & (chunk - 1) == 0 and block & (block - 1) == 0 and block <= chunk
    n_chunks = -(-vocab // chunk)
    kp = max(2, triton.next_power_of_2(k))
    dev = logits.device
    part_keys = torch.empty((rows, n_chunks, k), dtype=torch.int64, device=dev)
    part_max = torch.empty((rows, n_chunks) if with_lse else (1,), dtype=torch.float32, device=dev)
    part_sum = torch.empty_like(part_max)
    _chunk_kernel[(rows, n_chunks)](
        logits, part_keys, part_max, part_sum,
        logits.stride(0), vocab, n_chunks,
        K=k, KP=kp, CHUNK=chunk, BLOCK=block, WITH_LSE=with_lse,
        num_warps=warps[0] if warps else max(1, min(8, block // 256)),
    )  # fmt: skip
    np_ = max(2, triton.next_power_of_2(n_chunks * k))
    lp = out_logp if out_logp is not None else part_max  # unused without the logsumexp
    _merge_kernel[(rows,)](
        part_keys, part_max, part_sum, lp, out_ids, id_map if id_map is not None else out_ids,
        n_chunks, lp.stride(0), out_ids.stride(0),
        K=k, KP=kp, NP=np_, CP=max(2, triton.next_power_of_2(n_chunks)), WITH_LSE=with_lse,
        HAS_MAP=id_map is not None,
        num_warps=warps[1] if warps else max(1, min(8, np_ // 256)),
    )  # fmt: skip


def row_topk_logprobs(
    logits: torch.Tensor,
    k: int,
    *,
    id_map: torch.Tensor | None = None,
    chunk: int | None = None,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of log_softmax(logits.float()) (float32 [T, k],
    descending) and their column ids (int64 [T, k]); equal values: lower column first.
    `id_map` (int64 [V]): return id_map[column] instead (a reduced vocabulary's token ids).
    logits: [T, V] fp32/fp16/bf16, rows may be strided (a last dim that is not contiguous is
    copied first). 1 <= k <= min(16, V), else ValueError. A row entirely -inf: ids 0..k-1,
    log-probs NaN. `chunk`/`block` (powers of two) override plan_chunks: tests, tuning."""
    logits = _check(logits)
    rows, vocab = logits.shape
    if not 1 <= k <= min(MAX_K, vocab):
        raise ValueError(f"k must be in [1, {min(MAX_K, vocab)}] (V={vocab}), got k={k}")
    if id_map is not None and not (
        id_map.shape == (vocab,)
        and id_map.dtype == torch.int64
        and id_map.device == logits.device
        and id_map.is_contiguous()
    ):
        raise ValueError(
            f"id_map must be contiguous int64 [{vocab}] on {logits.device}, got "
            f"{id_map.dtype} {tuple(id_map.shape)} on {id_map.device}"
        )
    logp = torch.empty((rows, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, k), dtype=torch.int64, device=logits.device)
    if rows > 0:
        _select(logits, k, True, logp, ids, chunk, block, id_map=id_map)
    return logp, ids


def row_argmax(
    logits: torch.Tensor, *, chunk: int | None = None, block: int | None = None
) -> torch.Tensor:
    """Column of each row's maximum (int64 [T]); equal maxima (a row entirely -inf, too):
    the lowest column. logits and overrides as for row_topk_logprobs."""
    logits = _check(logits)
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("row_argmax needs V >= 1 columns")
    ids = torch.empty((rows,), dtype=torch.int64, device=logits.device)
    if rows > 0:
        _select(logits, 1, False, None, ids, chunk, block)
    return ids
