"""Executes scheduled batches on the device: prefill chunks and decode steps.

A decode step is always "draft, verify, commit": without speculation the draft tree is
the root alone, so plain decoding and speculative decoding share one code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.kv.table import KVInvariantError, KVTable
from specserve.ops.sampling import SamplingTensors, sample
from specserve.runtime.forward_batch import (
    Segment,
    build_device_metadata,
    build_metadata,
    to_device,
)
from specserve.runtime.model_runner import ModelRunner
from specserve.runtime.request import Request
from specserve.runtime.request_rows import PAD_ROW, RequestRows
from specserve.speculative.kv_commit import commit_accepted_path
from specserve.speculative.tree import DraftTrees, accept


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
    read on the device from the requests' rows, so a step can be launched before the host
    has seen the previous one's results; the host only knows upper bounds."""

    batch_size: int
    kv_upper: list[int]  # host upper bounds of each request's kv_len
    kv_lens_dev: torch.Tensor  # [B] exact, device
    roots: torch.Tensor  # [B] last token of each request, device
    window: int  # W: logical positions reserved past kv_len this step
    owned_slots: torch.Tensor  # [B, L] device slots of positions [0, L), L >= kv_len + W
    window_slots: torch.Tensor  # [B, W] device slots of positions [kv_len, kv_len + W)
    sampling: SamplingTensors
    root_g: torch.Tensor | None = None  # [B, H] the draft's state at the root (EAGLE)

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
        rows: RequestRows,
        device: torch.device,
        drafter=None,
        simulator=None,
    ):
        self.target = target
        self.table = table
        self.rows = rows  # per-request device state: page table, kv_len, root, draft feature
        self.device = device
        self.drafter = drafter
        # whether the draft wants the requests' tokens (a growing vocabulary); else no work
        self.observes_tokens = drafter is not None and drafter.head.takes_request_tokens
        self.simulator = simulator  # forces acceptance lengths (benchmarking)
        self.graphs = None  # DecodeGraphs, when CUDA graphs are on
        self.prefill_graphs = None  # PrefillGraphs, when CUDA graphs are on
        self._sampling_cache: tuple[tuple[str, ...], SamplingTensors] | None = None

    # ---- sizes the scheduler must reserve ------------------------------------------------
    def forget(self, rid: str) -> None:
        if self._sampling_cache is not None and rid in self._sampling_cache[0]:
            self._sampling_cache = None
        if self.observes_tokens:
            self.drafter.head.release_tokens((rid,))

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
        tokens = [t for c in chunks for t in c.req.all_ids[c.start : c.end]]
        if self.observes_tokens:
            self.observe_tokens({c.req.rid: c.req.all_ids[c.start : c.end] for c in chunks})
        dev = self.device
        capture = self.drafter.capture_layers if self.drafter is not None else ()
        out = None
        graphed = False
        if self.prefill_graphs is not None and len(chunks) == 1:
            c = chunks[0]
            if self.table.capacity(c.req.rid) < c.end:  # (the eager path's slots() checks it)
                raise KVInvariantError(f"{c.req.rid}: prefill to {c.end} exceeds its pages")
            self.rows.flush()  # the graph reads the request's pages on the device
            out = self.prefill_graphs.forward(self.rows.row(c.req.rid), c.start, tokens, capture)
            graphed = out is not None
        if out is None:
            input_ids = to_device(torch.tensor(tokens, dtype=torch.int64), dev)
            positions = [p for c in chunks for p in range(c.start, c.end)]
            pos = to_device(torch.tensor(positions, dtype=torch.int64), dev)
            out = self.target.forward(input_ids, pos, self._prefill_metadata(chunks), capture)

        done = [i for i, c in enumerate(chunks) if c.completes]
        sampled = None
        if done:
            ends = [0]
            for c in chunks:
                ends.append(ends[-1] + c.end - c.start)
            last_rows = to_device(torch.tensor([ends[i + 1] - 1 for i in done]), dev)
            logits = self.target.model.compute_logits(out.hidden[last_rows])
            reqs = [chunks[i].req for i in done]
            sample_pos = to_device(torch.tensor([chunks[i].end for i in done]), dev)
            sampled = sample(logits, sampling_tensors(reqs, dev), sample_pos)
        features = None
        if graphed and self.prefill_graphs.takes_draft():
            c = chunks[0]  # the token after the chunk: sampled, or the prompt's own
            g = self.prefill_graphs.draft(sampled if done else c.req.all_ids[c.end])
            features = g if done else None
        elif self.drafter is not None:
            features = self.drafter.extend_after_prefill(chunks, out, done, sampled)
        if sampled is None:
            return {}
        rows = self.rows.rows_of([chunks[i].req.rid for i in done])
        self.rows.set_state(to_device(torch.tensor(rows), dev), sample_pos, sampled, features)
        values = sampled.tolist()
        first = {chunks[i].req.rid: values[j] for j, i in enumerate(done)}
        if self.observes_tokens:
            self.observe_tokens({rid: (t,) for rid, t in first.items()})
        return first

    def observe_tokens(self, tokens_by_request: dict[str, Sequence[int]]) -> None:
        """Prompt and output tokens of running requests (a growing draft vocabulary's input)."""
        if self.observes_tokens:
            self.drafter.head.observe_tokens(tokens_by_request)

    def _prefill_metadata(self, chunks: list[PrefillChunk]):
        segments, out_slots = [], []
        for c in chunks:
            n = c.end - c.start
            segments.append(Segment(self.table.slots(c.req.rid, 0, c.end), n, n))
            out_slots.append(self.table.slots(c.req.rid, c.start, c.end))
        return build_metadata(segments, torch.cat(out_slots), self.device)

    # ---- decode -----------------------------------------------------------------------------
    def _sampling_for(self, reqs: list[Request]) -> SamplingTensors:
        """Sampling tensors of a batch, reused while the batch's membership is unchanged."""
        key = tuple(r.rid for r in reqs)
        if self._sampling_cache is None or self._sampling_cache[0] != key:
            self._sampling_cache = (key, sampling_tensors(reqs, self.device))
        return self._sampling_cache[1]

    @torch.inference_mode()
    def launch_decode(self, reqs: list[Request], kv_upper: list[int]) -> PendingDecode:
        """Draft, verify, commit and draft-extend on the device; nothing waits for the device."""
        self.rows.flush()
        rows = self.rows.rows_of([r.rid for r in reqs])
        sampling = self._sampling_for(reqs)
        width = max(kv_upper) + self.decode_window
        out = self.graphs.run(rows, sampling, width) if self.graphs is not None else None
        if out is None:
            rows_dev = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
            out = self.decode_step(rows_dev, sampling, width, kv_upper)
        return PendingDecode(reqs, *out)

    def decode(self, reqs: list[Request]) -> DecodeOutput:
        """A synchronous step (the host's kv_len is exact)."""
        return self.launch_decode(reqs, [r.kv_len for r in reqs]).result()

    def decode_step(
        self, rows: torch.Tensor, sampling: SamplingTensors, width: int, kv_upper: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the requests in `rows`, entirely on the device: read their state,
        draft, verify, compact the accepted KV, draft-extend, write their state back.
        Returns (accept_len [B], emitted [B, max_accept]). Shapes depend only on host values
        (B, width, kv_upper), so the same call can be captured in a CUDA graph; rows equal to
        PAD_ROW are padding and touch only scratch."""
        dev, window, st = self.device, self.decode_window, self.rows
        pad = rows == PAD_ROW
        kv_lens = torch.where(pad, 0, st.kv_lens[rows])
        roots = torch.where(pad, 0, st.roots[rows])
        owned = st.slots(rows, width)
        cols = kv_lens[:, None] + torch.arange(window, device=dev)[None, :]
        batch = DecodeBatch(
            batch_size=rows.shape[0],
            kv_upper=kv_upper,
            kv_lens_dev=kv_lens,
            roots=roots,
            window=window,
            owned_slots=owned,
            window_slots=torch.gather(owned, 1, cols),
            sampling=sampling,
            root_g=st.features[rows] if self.drafter is not None else None,
        )
        trees = (
            self.drafter.draft(batch)
            if self.drafter is not None
            else DraftTrees.root_only(batch.roots)
        )
        acc, hidden = self.verify(batch, trees)
        features = None
        if self.drafter is not None:
            features = self.drafter.extend_after_verify(batch, trees, acc, hidden)
        st.set_state(rows, kv_lens + acc.accept_len, acc.bonus, features)
        return acc.accept_len, acc.emitted

    def verify(self, batch: DecodeBatch, trees: DraftTrees):
        """One target forward over every tree of the batch; accept; compact the KV."""
        b, n = trees.tokens.shape
        positions = (batch.kv_lens_dev[:, None] + trees.depths).reshape(-1)
        out_slots = batch.window_slots[:, :n].reshape(-1)
        anc = None if n == 1 else trees.ancestors()
        mask = None if anc is None else anc.reshape(-1)
        meta = batch.metadata(n, n, n, out_slots, mask)
        capture = self.drafter.capture_layers if self.drafter is not None else ()
        out = self.target.forward(trees.tokens.reshape(-1), positions, meta, capture)
        st = batch.sampling
        logits = self.target.model.compute_logits(out.hidden, upcast=not st.all_greedy)
        # Each node's draw is for the position after it: kv_len + depth + 1.
        if n > 1 and not st.all_greedy:  # greedy rows need no per-node sampling parameters
            st = st.expand(n)
        target_tokens = sample(logits, st, positions + 1).view(b, n)
        if self.simulator is not None and anc is not None:
            acc = self.simulator.accept(trees, target_tokens, anc)
        else:
            acc = accept(trees, target_tokens, anc)
        if n > 1:  # a one-node tree's KV is already where it belongs
            commit_accepted_path([self.target.kv_cache], batch.window_slots, acc.path)
        return acc, out
