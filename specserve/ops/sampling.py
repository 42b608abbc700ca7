"""Token sampling on the device, without host synchronisation.

Randomness is counter-based: the Gumbel noise for a token depends only on (request seed,
position of the token being sampled, vocabulary index). Consequences we rely on:
- a seeded request samples the same text whatever it is batched with;
- speculative verification draws, at a tree node, exactly the noise plain decoding would
  draw for that position, so with the same seed speculative and plain sampling give the
  same tokens (which is stronger than "the same distribution");
- a retracted and resumed request continues exactly as it would have.
Sampling x = argmax(logits / T + Gumbel) is an exact draw from softmax(logits / T)
restricted to the tokens that survive top_k / top_p / min_p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.config.kernels import REFERENCE, Kernels
from specserve.sampling_params import GREEDY_BELOW


def _triton_rows(logits: torch.Tensor, kernels: Kernels) -> bool:
    """The split-row Triton reductions (ops/triton_topk.py) apply."""
    return kernels.sampling_reductions and logits.dim() == 2


def argmax_rows(logits: torch.Tensor, kernels: Kernels = REFERENCE) -> torch.Tensor:
    """logits.argmax(-1), the first maximum on ties (as torch documents), any float dtype."""
    if _triton_rows(logits, kernels) and logits.shape[-1] > 0:
        from specserve.ops.triton_topk import row_argmax

        return row_argmax(logits)
    return logits.argmax(dim=-1)


def topk_logprobs(
    logits: torch.Tensor,
    k: int,
    id_map: torch.Tensor | None = None,
    kernels: Kernels = REFERENCE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 [T, k] descending, int64 ids [T, k]): the k likeliest tokens of each row of
    log_softmax(logits.float()); on CUDA equal values list the lower column first.
    `id_map` (int64 [V]): ids are id_map[column] (a reduced vocabulary's token ids)."""
    if _triton_rows(logits, kernels):
        from specserve.ops.triton_topk import MAX_K, row_topk_logprobs

        if 1 <= k <= min(MAX_K, logits.shape[-1]):
            return row_topk_logprobs(logits, k, id_map=id_map)
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return values, (ids if id_map is None else id_map[ids])


_MASK32 = 0xFFFFFFFF
# Rows x vocabulary the filters' sort and the torch path's noise take at once: their int64
# temporaries (sort indices, integer weights and their sums, hashes) would be 6 GiB each for
# SmolLM2's 6/8/64 tree at batch 256 (16,384 rows of 49,152); 2**25 elements keep each at
# 256 MiB, and the sort's peak at 1.5 GiB (48 bytes per entry, runtime/capacity.py).
SAMPLE_BLOCK_ELEMENTS = 1 << 25
# Fewer sampled rows than this take the filters' floor from the torch sort, more from the
# search kernel (ops/triton_filter.py). The kernel runs a program per row, which makes its
# 10-17 passes over the row alone, while a sort spreads few rows over the whole device: on an
# H100 at one row of 128,256 the search took 1.7-2.2 ms against the sort's 0.23; at 256 rows
# 4.7 ms (top-p) and 6.3 (top-k with top-p) against 6.6, at 4,096 rows 1.1-2.0x less time.
# The two find the same floor (ops/triton_filter.py: the same integer arithmetic).
FILTER_SEARCH_MIN_ROWS = 256
# Odd multipliers below 2**31: products with 32-bit values stay inside int64.
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39, 0x045D9F3B)


def _mix32(x: torch.Tensor, round_: int) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIERS[round_ % 4]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[(round_ + 1) % 4]) & _MASK32
    return x ^ (x >> 16)


def noise_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 [R], each below 2**32: what a row's noise is a function of (with the column)."""
    s = _mix32(seeds.to(torch.int64) & _MASK32, 0)
    return _mix32(s ^ (positions.to(torch.int64) & _MASK32), 1)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [R, vocab] in (0, 1), a pure function of (seed, position, index). 23 random
    bits: (k + 0.5) / 2**23 is exact in float32, so no draw rounds to 1.0 (with 24 bits the
    largest did, one value in 2**24, and its Gumbel noise was infinite: that token won
    whatever its probability, even a filtered or masked one)."""
    return _uniform_of_keys(noise_keys(seeds, positions), vocab)


def _uniform_of_keys(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _mix32(keys[:, None] ^ idx[None, :], 2)
    x = _mix32(x ^ (keys[:, None] >> 7), 3)
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [R, vocab]: Gumbel(0, 1) noise of each row's `noise_keys`."""
    return -torch.log(-torch.log(_uniform_of_keys(keys, vocab)))


@dataclass(frozen=True)
class SamplingMode:
    """What a batch's sampling decides on the host: which code a step runs (and so which CUDA
    graph); the parameters themselves are per-row device values."""

    all_greedy: bool  # skip the noise entirely
    needs_filter: bool  # sort only when someone uses top_k / top_p / min_p
    logprobs: bool = False  # a request of the batch asks for log-probs
    top_logprobs: int = 0  # top-k width of those log-probs (ops/logprobs.py)
    any_plain: bool = False  # a request of the batch decodes without drafts
    penalized: bool = False  # a request of the batch has penalties, a bias or a minimum length


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device (one row per token to be sampled)."""

    temperatures: torch.Tensor  # [R] float32, 0 = greedy
    top_ks: torch.Tensor  # [R] int64, <= 0 = off
    top_ps: torch.Tensor  # [R] float32
    min_ps: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64
    all_greedy: bool  # host-known: skip the noise entirely
    needs_filter: bool  # host-known: skip sorting when nobody uses top_k/top_p/min_p
    logprobs: bool = False  # host-known: a request of the batch asks for log-probs
    top_logprobs: int = 0  # host-known: top-k width of those log-probs (ops/logprobs.py)
    plain_rows: torch.Tensor | None = None  # [R] bool: requests decoded without drafts
    any_plain: bool = False  # host-known: plain_rows has a True

    @classmethod
    def from_tables(cls, floats: torch.Tensor, ints: torch.Tensor, mode: SamplingMode):
        """floats [3, R] (temperature, top_p, min_p) and ints [3, R] (top_k, seed, decoded
        plainly), one column per row to sample, with the batch's host-known mode."""
        return cls(
            temperatures=floats[0],
            top_ks=ints[0],
            top_ps=floats[1],
            min_ps=floats[2],
            seeds=ints[1],
            all_greedy=mode.all_greedy,
            needs_filter=mode.needs_filter,
            logprobs=mode.logprobs,
            top_logprobs=mode.top_logprobs if mode.logprobs else 0,
            plain_rows=ints[2] != 0,
            any_plain=mode.any_plain,
        )

    @classmethod
    def gather(
        cls, floats: torch.Tensor, ints: torch.Tensor, rows: torch.Tensor, mode: SamplingMode
    ) -> SamplingTensors:
        """The tensors of a batch's rows from per-row tables (`from_tables`'s layout); device
        gathers only."""
        return cls.from_tables(floats[:, rows], ints[:, rows], mode)

    def expand(self, repeats: int) -> SamplingTensors:
        """Each request row repeated `repeats` times (one row per tree node); one copy kernel
        per tensor."""

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t[:, None].expand(t.shape[0], repeats).reshape(-1)

        return SamplingTensors(
            rep(self.temperatures),
            rep(self.top_ks),
            rep(self.top_ps),
            rep(self.min_ps),
            rep(self.seeds),
            self.all_greedy,
            self.needs_filter,
            self.logprobs,
            self.top_logprobs,
            None if self.plain_rows is None else rep(self.plain_rows),
            self.any_plain,
        )

    def take(self, rows: torch.Tensor) -> SamplingTensors:
        """The rows at `rows` (a packed subset of an expanded batch)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return SamplingTensors(
            pick(self.temperatures),
            pick(self.top_ks),
            pick(self.top_ps),
            pick(self.min_ps),
            pick(self.seeds),
            self.all_greedy,
            self.needs_filter,
            self.logprobs,
            self.top_logprobs,
            pick(self.plain_rows),
            self.any_plain,
        )


def filter_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Set to -inf every token removed by top_k, then top_p (on the renormalised top-k
    distribution, as Hugging Face and vLLM apply them in sequence), then min_p (relative to
    the likeliest token): those below the lowest value all three keep. Tokens of equal value
    share their fate, and the likeliest always stays (ops/triton_filter.py, whose kernel the
    Triton path runs)."""
    from specserve.ops.triton_filter import filter_floor_reference

    ones = torch.ones_like(st.temperatures)  # (logits already divided)
    floor = filter_floor_reference(logits, ones, st.top_ks, st.top_ps, st.min_ps)
    return logits.masked_fill(logits < floor[:, None], float("-inf"))


def target_distribution_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits / T with filters applied: softmax of this is the distribution we sample from."""
    # Rows below GREEDY_BELOW take the greedy token (see `sample`); clamping keeps logits / T
    # finite for them (a denormal T overflows float32 and argmax of NaNs is token 0).
    temps = torch.where(
        st.temperatures >= GREEDY_BELOW, st.temperatures, torch.ones_like(st.temperatures)
    )
    scaled = logits.float() / temps[:, None]
    return filter_logits(scaled, st) if st.needs_filter else scaled


def _draw_in_blocks(logits: torch.Tensor, st: SamplingTensors, keys: torch.Tensor) -> torch.Tensor:
    """The torch path's draws, a block of rows at a time: the filters' sort and the noise
    take several [R, V] temporaries (a tree samples every node: batch x nodes rows)."""
    rows, vocab = logits.shape
    block = max(1, SAMPLE_BLOCK_ELEMENTS // max(vocab, 1))
    parts = []
    for start in range(0, rows, block):
        part = slice(start, min(rows, start + block))
        scaled = target_distribution_logits(logits[part], st.take(part))
        parts.append((scaled + gumbel_noise(keys[part], vocab)).argmax(dim=-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _filter_floor(logits: torch.Tensor, st: SamplingTensors, search: bool) -> torch.Tensor:
    """Each row's filters' floor (ops/triton_filter.py): the search kernel (`search`, from
    `FILTER_SEARCH_MIN_ROWS` rows), else the torch sort, a block of rows at a time."""
    from specserve.ops.triton_filter import filter_floor, filter_floor_reference

    args = (st.temperatures, st.top_ks, st.top_ps, st.min_ps)
    if not len(logits):
        return torch.empty((0,), dtype=torch.float32, device=logits.device)
    if search and len(logits) >= FILTER_SEARCH_MIN_ROWS:
        return filter_floor(logits, *args)
    block = max(1, SAMPLE_BLOCK_ELEMENTS // max(logits.shape[-1], 1))
    parts = [
        filter_floor_reference(logits[i : i + block], *(a[i : i + block] for a in args))
        for i in range(0, len(logits), block)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def sample(
    logits: torch.Tensor,
    st: SamplingTensors,
    positions: torch.Tensor,
    kernels: Kernels = REFERENCE,
) -> torch.Tensor:
    """One token per row. logits [R, V] (float32; bf16/fp16 logits are fine for all-greedy
    rows: argmax needs no upcast); positions [R]: where the sampled token goes."""
    greedy = argmax_rows(logits, kernels)
    if st.all_greedy:
        return greedy
    keys = noise_keys(st.seeds, positions)
    if _triton_rows(logits, kernels):
        # (the filters' floor and the noise in registers: the reference's [R, V]
        # temporaries, several per step, outgrow the device's memory beside the KV cache at
        # large batches of a tree, and its sort takes most of a filtered step's time)
        from specserve.ops.triton_gumbel import gumbel_argmax

        floor = _filter_floor(logits, st, kernels.filter_search) if st.needs_filter else None
        sampled = gumbel_argmax(logits, st.temperatures, keys, floor)
    else:
        sampled = _draw_in_blocks(logits, st, keys) if len(logits) else greedy
    return torch.where(st.temperatures >= GREEDY_BELOW, sampled, greedy)
