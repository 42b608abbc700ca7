"""Executes scheduled batches on the device: prefill chunks and decode steps.

A decode step is always "draft, verify, commit": without speculation the draft tree is
the root alone, so plain decoding and speculative decoding share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kv.table import KVTable
from specserve.ops.sampling import SamplingTensors, sample
from specserve.runtime.forward_batch import Segment, build_metadata
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


@dataclass
class DecodeBatch:
    """What the drafter and verifier share about one decode step (host and device views)."""

    reqs: list[Request]
    kv_lens: list[int]
    kv_lens_dev: torch.Tensor  # [B]
    roots: torch.Tensor  # [B] last token of each request
    window: int  # W: logical positions reserved past kv_len this step
    window_slots: torch.Tensor  # [B, W] device
    window_slots_host: torch.Tensor  # [B, W] CPU (for host-built attention indices)
    prefix_slots_host: list[torch.Tensor]  # per request, slots of positions [0, kv_len)

    def visible_slots(self, b: int, extra: int, start: int = 0) -> torch.Tensor:
        """Slots of the cached prefix plus window positions [start, start + extra) (host)."""
        return torch.cat([self.prefix_slots_host[b], self.window_slots_host[b, : start + extra]])

    sampling: SamplingTensors


def sampling_tensors(reqs: list[Request], device: torch.device) -> SamplingTensors:
    ps = [r.params for r in reqs]
    return SamplingTensors(
        temperatures=torch.tensor([p.temperature for p in ps], dtype=torch.float32).to(device),
        top_ks=torch.tensor([p.top_k for p in ps], dtype=torch.int64).to(device),
        top_ps=torch.tensor([p.top_p for p in ps], dtype=torch.float32).to(device),
        min_ps=torch.tensor([p.min_p for p in ps], dtype=torch.float32).to(device),
        seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64).to(device),
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

    # ---- sizes the scheduler must reserve ------------------------------------------------
    def forget(self, rid: str) -> None:
        if self.drafter is not None:
            self.drafter.forget(rid)

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
        values = sampled.tolist()
        return {chunks[i].req.rid: values[j] for j, i in enumerate(done)}

    # ---- decode -----------------------------------------------------------------------------
    def make_decode_batch(self, reqs: list[Request]) -> DecodeBatch:
        dev = self.device
        window = self.decode_window
        kv_lens = [r.kv_len for r in reqs]
        owned = [self.table.slots(r.rid, 0, r.kv_len + window) for r in reqs]
        slots = torch.stack([o[r.kv_len :] for o, r in zip(owned, reqs)])
        return DecodeBatch(
            reqs=reqs,
            kv_lens=kv_lens,
            kv_lens_dev=torch.tensor(kv_lens, dtype=torch.int64).to(dev),
            roots=torch.tensor([r.all_ids[-1] for r in reqs], dtype=torch.int64).to(dev),
            window=window,
            window_slots=slots.to(dev),
            window_slots_host=slots,
            prefix_slots_host=[o[: r.kv_len] for o, r in zip(owned, reqs)],
            sampling=sampling_tensors(reqs, dev),
        )

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> DecodeOutput:
        batch = self.make_decode_batch(reqs)
        trees = (
            self.drafter.draft(batch)
            if self.drafter is not None
            else DraftTrees.root_only(batch.roots)
        )
        acc, hidden = self.verify(batch, trees)
        if self.drafter is not None:
            self.drafter.extend_after_verify(batch, trees, acc, hidden)
        lens = acc.accept_len.tolist()
        emitted = acc.emitted.tolist()
        return DecodeOutput([e[:n] for e, n in zip(emitted, lens)], lens)

    def verify(self, batch: DecodeBatch, trees: DraftTrees):
        """One target forward over every tree of the batch; accept; compact the KV."""
        dev = self.device
        b, n = trees.tokens.shape
        positions = (batch.kv_lens_dev[:, None] + trees.depths).reshape(-1)
        segments = [Segment(batch.visible_slots(i, n), n, n) for i in range(b)]
        out_slots = batch.window_slots[:, :n].reshape(-1)
        anc = None if n == 1 else ancestor_mask(trees.parents, trees.max_depth)
        mask = None if anc is None else anc.reshape(-1)
        meta = build_metadata(segments, out_slots, dev, custom_mask=mask)
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
