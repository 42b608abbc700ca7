"""Executes scheduled batches on the device: prefill chunks and decode steps.

A decode step is always "draft, verify, commit": without speculation the draft tree is
the root alone, so plain decoding and speculative decoding share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kv.table import KVTable
from specserve.ops.sampling import SamplingTensors, sample
from specserve.runtime.forward_batch import (
    Segment,
    build_device_metadata,
    build_metadata,
    to_device,
)
from specserve.runtime.model_runner import ModelRunner
from specserve.runtime.request import Request
from specserve.spec.kv_commit import commit_accepted_path
from specserve.spec.tree import DraftTrees, accept, ancestor_mask


@dataclass
class PrefillChunk:
    req: Request
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == self.req.fill_len


@dataclass
class DecodeOutput:
    emitted: list[list[int]]  # per request: accepted draft tokens then the bonus token
    accept_lens: list[int]


class PendingDecode:
    """A launched decode step. Its per-request results are copied to the host without
    blocking; `result()` waits for them, which is the only point where the host learns
    the accepted lengths (one step later, under overlap scheduling)."""

    def __init__(self, reqs: list[Request], accept_len: torch.Tensor, emitted: torch.Tensor):
        self.reqs = reqs
        if accept_len.device.type == "cuda":
            self._lens = torch.empty(accept_len.shape, dtype=accept_len.dtype, pin_memory=True)
            self._emitted = torch.empty(emitted.shape, dtype=emitted.dtype, pin_memory=True)
            self._lens.copy_(accept_len, non_blocking=True)
            self._emitted.copy_(emitted, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._lens, self._emitted, self._event = accept_len, emitted, None

    def result(self) -> DecodeOutput:
        if self._event is not None:
            self._event.synchronize()
        lens = self._lens.tolist()
        return DecodeOutput([e[:n] for e, n in zip(self._emitted.tolist(), lens)], lens)


@dataclass
class DecodeBatch:
    """What the drafter and verifier share about one decode step. KV lengths and roots are
    device tensors carried over from the previous step, so a step can be launched before
    the host has seen the previous one's results; the host only knows upper bounds."""

    reqs: list[Request]
    kv_upper: list[int]  # host upper bounds of each request's kv_len
    kv_lens_dev: torch.Tensor  # [B] exact, device
    roots: torch.Tensor  # [B] last token of each request, device
    window: int  # W: logical positions reserved past kv_len this step
    owned_slots: torch.Tensor  # [B, L] device slots of positions [0, L), L >= kv_len + W
    window_slots: torch.Tensor  # [B, W] device slots of positions [kv_len, kv_len + W)
    sampling: SamplingTensors

    def metadata(self, visible_past_kv: int, q_len: int, extra_len: int, out_cache_loc, mask=None):
        """Requests see positions [0, kv_len + visible_past_kv); the last extra_len are masked."""
        return build_device_metadata(
            self.owned_slots,
            self.kv_lens_dev + visible_past_kv,
            [u + visible_past_kv for u in self.kv_upper],
            q_len,
            extra_len,
            out_cache_loc,
            mask,
        )


def sampling_tensors(reqs: list[Request], device: torch.device) -> SamplingTensors:
    ps = [r.params for r in reqs]

    def dev(values, dtype) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), device)

    return SamplingTensors(
        temperatures=dev([p.temperature for p in ps], torch.float32),
        top_ks=dev([p.top_k for p in ps], torch.int64),
        top_ps=dev([p.top_p for p in ps], torch.float32),
        min_ps=dev([p.min_p for p in ps], torch.float32),
        seeds=dev([r.seed for r in reqs], torch.int64),
        all_greedy=all(p.greedy for p in ps),
        needs_filter=any(p.needs_filter and not p.greedy for p in ps),
    )


class Worker:
    def __init__(
        self,
        target: ModelRunner,
        table: KVTable,
        device: torch.device,
        drafter=None,
        simulator=None,
    ):
        self.target = target
        self.table = table
        self.device = device
        self.drafter = drafter
        self.simulator = simulator  # forces acceptance lengths (benchmarking)
        # rid -> (kv_len, last token) on the device: the next decode step's inputs
        self.device_state: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- sizes the scheduler must reserve ------------------------------------------------
    def forget(self, rid: str) -> None:
        self.device_state.pop(rid, None)
        if self.drafter is not None:
            self.drafter.forget(rid)

    @property
    def max_accept(self) -> int:
        """Most tokens one decode step can add to a request."""
        return self.drafter.max_depth + 1 if self.drafter is not None else 1

    @property
    def decode_window(self) -> int:
        """Logical positions past kv_len a decode step writes (target tree + draft scratch)."""
        return self.drafter.window if self.drafter is not None else 1

    @property
    def kv_lookahead(self) -> int:
        """Positions past kv_len that stay owned between steps (a standalone draft's root)."""
        return self.drafter.lookahead if self.drafter is not None else 0

    # ---- prefill --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> dict[str, int]:
        """Run the chunks; return the first sampled token of each request whose prefill completes."""
        tokens, positions, segments, out_slots = [], [], [], []
        for c in chunks:
            ids = c.req.all_ids[c.start : c.end]
            tokens.extend(ids)
            positions.extend(range(c.start, c.end))
            segments.append(
                Segment(self.table.slots(c.req.rid, 0, c.end), c.end - c.start, c.end - c.start)
            )
            out_slots.append(self.table.slots(c.req.rid, c.start, c.end))
        dev = self.device
        input_ids = torch.tensor(tokens, dtype=torch.int64).to(dev)
        pos = torch.tensor(positions, dtype=torch.int64).to(dev)
        meta = build_metadata(segments, torch.cat(out_slots), dev)
        capture = self.drafter.capture_layers if self.drafter is not None else frozenset()
        out = self.target.forward(input_ids, pos, meta, capture)

        done = [i for i, c in enumerate(chunks) if c.completes]
        sampled = None
        if done:
            last_rows = torch.tensor([meta.host_qo_indptr[i + 1] - 1 for i in done]).to(dev)
            logits = self.target.model.compute_logits(out.hidden[last_rows])
            reqs = [chunks[i].req for i in done]
            sample_pos = torch.tensor([chunks[i].end for i in done], dtype=torch.int64).to(dev)
            sampled = sample(logits, sampling_tensors(reqs, dev), sample_pos)
        if self.drafter is not None:
            self.drafter.extend_after_prefill(chunks, input_ids, pos, out, done, sampled)
        if sampled is None:
            return {}
        self.set_device_state([chunks[i].req.rid for i in done], sample_pos, sampled)
        values = sampled.tolist()
        return {chunks[i].req.rid: values[j] for j, i in enumerate(done)}

    # ---- decode -----------------------------------------------------------------------------
    def set_device_state(self, rids: list[str], kv_lens: torch.Tensor, roots: torch.Tensor) -> None:
        for i, rid in enumerate(rids):
            self.device_state[rid] = (kv_lens[i], roots[i])

    def make_decode_batch(self, reqs: list[Request], kv_upper: list[int]) -> DecodeBatch:
        dev = self.device
        window = self.decode_window
        width = max(kv_upper) + window
        owned = torch.zeros(len(reqs), width, dtype=torch.int64)
        for i, (r, up) in enumerate(zip(reqs, kv_upper)):
            owned[i, : up + window] = self.table.slots(r.rid, 0, up + window)
        owned = to_device(owned, dev)
        kv_lens = torch.stack([self.device_state[r.rid][0] for r in reqs])
        cols = kv_lens[:, None] + torch.arange(window, device=dev)[None, :]
        return DecodeBatch(
            reqs=reqs,
            kv_upper=kv_upper,
            kv_lens_dev=kv_lens,
            roots=torch.stack([self.device_state[r.rid][1] for r in reqs]),
            window=window,
            owned_slots=owned,
            window_slots=torch.gather(owned, 1, cols),
            sampling=sampling_tensors(reqs, dev),
        )

    @torch.inference_mode()
    def launch_decode(self, reqs: list[Request], kv_upper: list[int]) -> PendingDecode:
        """Draft, verify, commit and draft-extend on the device; nothing waits for the device."""
        batch = self.make_decode_batch(reqs, kv_upper)
        trees = (
            self.drafter.draft(batch)
            if self.drafter is not None
            else DraftTrees.root_only(batch.roots)
        )
        acc, hidden = self.verify(batch, trees)
        if self.drafter is not None:
            self.drafter.extend_after_verify(batch, trees, acc, hidden)
        self.set_device_state([r.rid for r in reqs], batch.kv_lens_dev + acc.accept_len, acc.bonus)
        return PendingDecode(reqs, acc.accept_len, acc.emitted)

    def decode(self, reqs: list[Request]) -> DecodeOutput:
        """A synchronous step (the host's kv_len is exact)."""
        return self.launch_decode(reqs, [r.kv_len for r in reqs]).result()

    def verify(self, batch: DecodeBatch, trees: DraftTrees):
        """One target forward over every tree of the batch; accept; compact the KV."""
        dev = self.device
        b, n = trees.tokens.shape
        positions = (batch.kv_lens_dev[:, None] + trees.depths).reshape(-1)
        out_slots = batch.window_slots[:, :n].reshape(-1)
        anc = None if n == 1 else ancestor_mask(trees.parents, trees.max_depth)
        mask = None if anc is None else anc.reshape(-1)
        meta = batch.metadata(n, n, n, out_slots, mask)
        capture = self.drafter.capture_layers if self.drafter is not None else frozenset()
        out = self.target.forward(trees.tokens.reshape(-1), positions, meta, capture)
        logits = self.target.model.compute_logits(out.hidden)
        # Each node's draw is for the position after it: kv_len + depth + 1.
        st = batch.sampling.expand(torch.full((b,), n, device=dev), b * n)
        target_tokens = sample(logits, st, positions + 1).view(b, n)
        if self.simulator is not None and anc is not None:
            acc = self.simulator.accept(trees, target_tokens, anc)
        else:
            acc = accept(trees, target_tokens)
        commit_accepted_path([self.target.kv_cache], batch.window_slots, acc.path)
        return acc, out
