"""The penalties of decode steps, kept on the device by request row (kv/request_rows.py), so
that a batch holding a penalized request is replayed from a CUDA graph and launched ahead of
the results of the step before it, like any other.

Each penalized request decoding has a slot in [slots, V] tables, which its row points at
(`slot_of`); other rows point at the neutral slot 0, whose values leave logits as they were.
A request's slot is written from the host once, when it first decodes in its row (its bias,
prompt tokens, allowed tokens, stop tokens, penalty values, and its output so far counted);
from then on each decode step counts the tokens it emits into the slot and lowers what
remains of the minimum length, on the device (`BatchPenalties.advance`). Prefill draws keep
the host-built penalties (runtime/penalties.py).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import torch

from specserve.device import to_device
from specserve.runtime.penalties import BatchPenalties, RequestPenalties

# Slots made at first (slot 0 is the neutral one): doubled whenever more penalized requests
# decode at once, so the tables cost what the penalized requests use (11 bytes x vocab each),
# not what every row could.
FIRST_SLOTS = 8


class PenaltyRows:
    """[slots, V] tables of counts, prompt tokens, bias, banned and held-back stop tokens, and
    per-slot penalty values, with each request row's slot (`slot_of`): a penalized request's
    own, 0 (neutral, never written) for any other."""

    def __init__(self, rows, vocab_size: int, eos: AbstractSet[int], device: torch.device):
        """rows: the RequestRows these are attached to (told when the tables move)."""
        self.rows = rows
        self.vocab_size = vocab_size
        self.eos = eos
        self.device = device
        self.slot_of = torch.zeros(0, dtype=torch.int64, device=device)
        self._written: dict[int, object] = {}  # row -> the request whose values it holds
        self._slot_of_row: dict[int, int] = {}  # row -> its penalized request's slot
        self._free: list[int] = []
        self.num_slots = 0
        self.counts = self.in_prompt = self.bias = self.banned = self.stops = None
        self.frequency = self.presence = self.repetition = None
        self.remaining = self.has_bias = self.has_banned = None
        self._grow(FIRST_SLOTS + 1)

    def _grow(self, slots: int) -> None:
        """Room for `slots` slots, keeping what the first ones hold (neutral new ones)."""
        dev, v, keep = self.device, self.vocab_size, self.num_slots
        new = {
            "counts": torch.zeros(slots, v, dtype=torch.float32, device=dev),
            "in_prompt": torch.zeros(slots, v, dtype=torch.bool, device=dev),
            "bias": torch.zeros(slots, v, dtype=torch.float32, device=dev),
            "banned": torch.zeros(slots, v, dtype=torch.bool, device=dev),
            "stops": torch.zeros(slots, v, dtype=torch.bool, device=dev),
            "frequency": torch.zeros(slots, dtype=torch.float32, device=dev),
            "presence": torch.zeros(slots, dtype=torch.float32, device=dev),
            "repetition": torch.ones(slots, dtype=torch.float32, device=dev),
            "remaining": torch.zeros(slots, dtype=torch.int64, device=dev),
            "has_bias": torch.zeros(slots, dtype=torch.bool, device=dev),
            "has_banned": torch.zeros(slots, dtype=torch.bool, device=dev),
        }
        for name, table in new.items():
            old = getattr(self, name)
            if old is not None:  # (a device copy, ordered after launched steps)
                table[:keep] = old
            setattr(self, name, table)
        self._free.extend(range(slots - 1, max(keep, 1) - 1, -1))
        self.num_slots = slots
        if keep:
            self.rows.tables_changed()  # (graphs captured the old tables)

    # ---- RequestRows' per-row table protocol ---------------------------------------------
    def resize(self, rows: int) -> None:
        """A slot entry for each of `rows` rows, keeping the first ones' (new ones neutral)."""
        old = self.slot_of
        self.slot_of = torch.zeros(rows, dtype=torch.int64, device=self.device)
        keep = min(rows, old.shape[0])
        self.slot_of[:keep] = old[:keep]

    def forget(self, row: int) -> None:
        """The row is released (no launched step holds it): so is its request's slot."""
        self._written.pop(row, None)
        slot = self._slot_of_row.pop(row, None)
        if slot is not None:
            self._free.append(slot)

    # ---- writes from the host --------------------------------------------------------------
    @torch.inference_mode()
    def write(self, reqs, rows: list[int]) -> None:
        """The values of the requests whose row does not hold theirs yet. Each request's
        output must be complete on the host (no step of it in flight): its first decode
        step in a row follows its prefill, or its resumption after a retraction."""
        new = [(r, row) for r, row in zip(reqs, rows) if self._written.get(row) is not r]
        if not new:
            return
        scalars, slots = [], []
        for req, row in new:
            p = req.params
            slot = 0
            if p.adjusts_logits:
                slot = self._slot_of_row.get(row)
                if slot is None:
                    if not self._free:
                        self._grow(2 * self.num_slots)
                    slot = self._slot_of_row[row] = self._free.pop()
                if req.penalties is None:
                    req.penalties = RequestPenalties(req, self.vocab_size, self.eos, self.device)
                part = req.penalties
                self._write_row(slot, part, req.output_ids)
                remaining = 0
                if part.stops is not None:
                    remaining = max(0, p.min_new_tokens - len(req.output_ids))
                scalars.append(
                    (slot, p.frequency_penalty, p.presence_penalty, p.repetition_penalty,
                     remaining, part.bias is not None, part.banned is not None)
                )  # fmt: skip
            slots.append((row, slot))
            self._written[row] = req
        dev = self.device
        at = to_device(torch.tensor(slots, dtype=torch.int64), dev)
        self.slot_of[at[:, 0]] = at[:, 1]
        if scalars:
            at = to_device(torch.tensor([s[0] for s in scalars], dtype=torch.int64), dev)
            floats = to_device(torch.tensor([s[1:4] for s in scalars], dtype=torch.float32), dev)
            ints = to_device(torch.tensor([s[4:] for s in scalars], dtype=torch.int64), dev)
            self.frequency[at], self.presence[at], self.repetition[at] = floats.T
            self.remaining[at] = ints[:, 0]
            self.has_bias[at], self.has_banned[at] = ints[:, 1].bool(), ints[:, 2].bool()

    def _write_row(self, slot: int, part: RequestPenalties, output_ids: list[int]) -> None:
        counts = part.counts_now(output_ids)
        for table, value in (
            (self.counts, counts),
            (self.in_prompt, part.in_prompt),
            (self.bias, part.bias),
            (self.banned, part.banned),
            (self.stops, part.stops),
        ):
            if value is not None:  # (else the slot's values are never read: see `batch`)
                table[slot] = value

    # ---- a decode step's view, on the device -------------------------------------------------
    def batch(self, rows: torch.Tensor) -> BatchPenalties:
        """The penalties of a step over `rows` ([B] int64, on the device), which the step
        brings up to date with what it emits (a graph replays this with new rows)."""
        slot = self.slot_of[rows]
        bias = torch.where(self.has_bias[slot][:, None], self.bias[slot], 0.0)
        return BatchPenalties.from_tensors(
            self.counts[slot],
            self.in_prompt[slot],
            bias,
            self.frequency[slot],
            self.presence[slot],
            self.repetition[slot],
            banned=self.banned[slot] & self.has_banned[slot][:, None],
            stops=self.stops[slot],
            remaining=self.remaining[slot],
            owner=(self, rows),
        )

    def advance(self, rows: torch.Tensor, accept_len: torch.Tensor, emitted: torch.Tensor):
        """A step over `rows` emitted `emitted[b, :accept_len[b]]`: counted, and the minimum
        lengths' remainders lowered by as many (the neutral slot's stay 0)."""
        slot = self.slot_of[rows]
        d = emitted.shape[1]
        taken = torch.arange(d, device=emitted.device)[None, :] < accept_len[:, None]
        # (a scatter-add into the flat table: one atomic kernel, no sort, fine in a graph)
        at = slot[:, None] * self.vocab_size + torch.where(taken, emitted, 0)
        self.counts.view(-1).scatter_add_(0, at.reshape(-1), taken.to(torch.float32).reshape(-1))
        self.remaining[slot] = (self.remaining[slot] - accept_len).clamp(min=0)
