"""The penalties of decode steps, kept on the device by request row (kv/request_rows.py), so
that a batch holding a penalized request is replayed from a CUDA graph and launched ahead of
the results of the step before it, like any other.

A request's row is written from the host once, when it first decodes in that row (its bias,
prompt tokens, allowed tokens, stop tokens, penalty values, and its output so far counted);
from then on each decode step counts the tokens it emits into the row and lowers what
remains of the minimum length, on the device (`BatchPenalties.advance`). A row written for
a request without penalties holds neutral values, which leave its logits as they were.
Prefill draws keep the host-built penalties (runtime/penalties.py).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import torch

from specserve.device import to_device
from specserve.runtime.penalties import BatchPenalties, RequestPenalties


class PenaltyRows:
    """[rows, V] tables of counts, prompt tokens, bias, banned and held-back stop tokens, and
    per-row penalty values; rows never written (the padding row) are neutral."""

    def __init__(self, vocab_size: int, eos: AbstractSet[int], device: torch.device):
        self.vocab_size = vocab_size
        self.eos = eos
        self.device = device
        self.num_rows = 0
        self._written: dict[int, object] = {}  # row -> the request whose values it holds
        self.counts = self.in_prompt = self.bias = self.banned = self.stops = None
        self.frequency = self.presence = self.repetition = None
        self.remaining = self.has_bias = self.has_banned = None

    # ---- RequestRows' per-row table protocol ---------------------------------------------
    def resize(self, rows: int) -> None:
        """Room for `rows` rows, keeping what the first ones hold (neutral new rows)."""
        if rows == self.num_rows:
            return
        dev, v, keep = self.device, self.vocab_size, min(rows, self.num_rows)
        new = {
            "counts": torch.zeros(rows, v, dtype=torch.float32, device=dev),
            "in_prompt": torch.zeros(rows, v, dtype=torch.bool, device=dev),
            "bias": torch.zeros(rows, v, dtype=torch.float32, device=dev),
            "banned": torch.zeros(rows, v, dtype=torch.bool, device=dev),
            "stops": torch.zeros(rows, v, dtype=torch.bool, device=dev),
            "frequency": torch.zeros(rows, dtype=torch.float32, device=dev),
            "presence": torch.zeros(rows, dtype=torch.float32, device=dev),
            "repetition": torch.ones(rows, dtype=torch.float32, device=dev),
            "remaining": torch.zeros(rows, dtype=torch.int64, device=dev),
            "has_bias": torch.zeros(rows, dtype=torch.bool, device=dev),
            "has_banned": torch.zeros(rows, dtype=torch.bool, device=dev),
        }
        for name, table in new.items():
            old = getattr(self, name)
            if old is not None:  # (a device copy, ordered after launched steps)
                table[:keep] = old[:keep]
            setattr(self, name, table)
        self.num_rows = rows

    def forget(self, row: int) -> None:
        self._written.pop(row, None)

    # ---- writes from the host --------------------------------------------------------------
    @torch.inference_mode()
    def write(self, reqs, rows: list[int]) -> None:
        """The values of the requests whose row does not hold theirs yet. Each request's
        output must be complete on the host (no step of it in flight): its first decode
        step in a row follows its prefill, or its resumption after a retraction."""
        new = [(r, row) for r, row in zip(reqs, rows) if self._written.get(row) is not r]
        if not new:
            return
        scalars = []
        for req, row in new:
            p = req.params
            remaining = 0
            if p.adjusts_logits:
                if req.penalties is None:
                    req.penalties = RequestPenalties(req, self.vocab_size, self.eos, self.device)
                part = req.penalties
                self._write_row(row, part, req.output_ids)
                if part.stops is not None:
                    remaining = max(0, p.min_new_tokens - len(req.output_ids))
                scalars.append(
                    (row, p.frequency_penalty, p.presence_penalty, p.repetition_penalty,
                     remaining, part.bias is not None, part.banned is not None)
                )  # fmt: skip
            else:
                scalars.append((row, 0.0, 0.0, 1.0, 0, False, False))
            self._written[row] = req
        at = to_device(torch.tensor([s[0] for s in scalars], dtype=torch.int64), self.device)
        floats = to_device(
            torch.tensor([s[1:4] for s in scalars], dtype=torch.float32), self.device
        )
        ints = to_device(torch.tensor([s[4:] for s in scalars], dtype=torch.int64), self.device)
        self.frequency[at], self.presence[at], self.repetition[at] = floats.T
        self.remaining[at] = ints[:, 0]
        self.has_bias[at], self.has_banned[at] = ints[:, 1].bool(), ints[:, 2].bool()

    def _write_row(self, row: int, part: RequestPenalties, output_ids: list[int]) -> None:
        counts = part.counts_now(output_ids)
        for table, value in (
            (self.counts, counts),
            (self.in_prompt, part.in_prompt),
            (self.bias, part.bias),
            (self.banned, part.banned),
            (self.stops, part.stops),
        ):
            if value is not None:  # (else the row's values are never read: see `batch`)
                table[row] = value

    # ---- a decode step's view, on the device -------------------------------------------------
    def batch(self, rows: torch.Tensor) -> BatchPenalties:
        """The penalties of a step over `rows` ([B] int64, on the device), which the step
        brings up to date with what it emits (a graph replays this with new rows)."""
        bias = torch.where(self.has_bias[rows][:, None], self.bias[rows], 0.0)
        return BatchPenalties.from_tensors(
            self.counts[rows],
            self.in_prompt[rows],
            bias,
            self.frequency[rows],
            self.presence[rows],
            self.repetition[rows],
            banned=self.banned[rows] & self.has_banned[rows][:, None],
            stops=self.stops[rows],
            remaining=self.remaining[rows],
            owner=(self, rows),
        )

    def advance(self, rows: torch.Tensor, accept_len: torch.Tensor, emitted: torch.Tensor):
        """A step over `rows` emitted `emitted[b, :accept_len[b]]`: counted, and the minimum
        lengths' remainders lowered by as many."""
        d = emitted.shape[1]
        taken = torch.arange(d, device=emitted.device)[None, :] < accept_len[:, None]
        # (a scatter-add into the flat table: one atomic kernel, no sort, fine in a graph)
        at = rows[:, None] * self.vocab_size + torch.where(taken, emitted, 0)
        self.counts.view(-1).scatter_add_(0, at.reshape(-1), taken.to(torch.float32).reshape(-1))
        self.remaining[rows] = (self.remaining[rows] - accept_len).clamp(min=0)
