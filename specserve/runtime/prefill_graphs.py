"""CUDA graphs for the target's forward over one request's prefill chunk.

At batch 1 a short prompt's prefill is bound by the host: the eager forward of a small
model launches hundreds of kernels from Python (SmolLM2-135M, 64 tokens: ~16 ms of host
time for ~0.6 ms of device work), which is as long as a whole speculative answer's decode
steps. So a prefill batch of a single chunk of at most `max_tokens` tokens replays a
captured forward instead; everything else (several requests, longer chunks) runs eagerly.

A graph is keyed by the chunk's length padded up to a power of two (>= MIN_TOKENS) and by the
context width (start + padded length, padded as decode graphs pad it). Its static inputs are
the token ids and (row, start, end): the request's KV slots are read on the device from its
row of `RequestRows`, as a decode step reads them. Padding tokens sit after the chunk, so
causal attention keeps them out of every real token's view; they read and write only the
scratch slot 0 and their outputs are discarded. Only the forward is captured: the last token's
logits, sampling and the draft's prefill run eagerly on the graph's outputs (views valid
until the next replay of a graph in this pool).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specserve.model.llama import ModelOutput
from specserve.runtime.cuda_graphs import MIN_WIDTH, capture_graph, copy_from_host, pow2_bucket
from specserve.runtime.forward_batch import build_device_metadata
from specserve.runtime.request_rows import PAD_ROW

log = logging.getLogger(__name__)

MIN_TOKENS = 16
SCRATCH_SLOT = 0  # a slot of the scratch page (page 0), never part of a request's KV


@dataclass
class _Captured:
    graph: object | None  # torch.cuda.CUDAGraph; None when not capturing (CPU tests)
    forward: object  # the forward over the static inputs (what the graph replays)
    input_ids: torch.Tensor  # [tokens] static input
    span: torch.Tensor  # [3] static input: row, start, end
    out: ModelOutput | None  # static outputs of the graph


class PrefillGraphs:
    def __init__(self, worker, max_tokens: int, max_width: int, capture: bool = True):
        """capture=False runs the same padded forward eagerly: how the padding is tested on
        machines without CUDA."""
        self.worker = worker
        self.max_tokens = max_tokens
        self.max_width = max_width
        self.capture = capture
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = None
        self._rows_version = worker.rows.version
        self.num_captures = 0

    def bucket(self, start: int, num_tokens: int) -> tuple[int, int] | None:
        if num_tokens > self.max_tokens:
            return None
        tokens = pow2_bucket(num_tokens, MIN_TOKENS)
        if start + tokens > self.max_width:
            return None
        return tokens, min(pow2_bucket(start + tokens, MIN_WIDTH), self.max_width)

    def forward(
        self, row: int, start: int, token_ids: list[int], capture_layers: tuple[int, ...]
    ) -> ModelOutput | None:
        """The target's outputs for tokens at positions [start, start + len(token_ids)) of the
        request in `row` (its pages already flushed to the device), or None when no graph
        shape fits. The returned tensors are views of the graph's static outputs."""
        n = len(token_ids)
        shape = self.bucket(start, n)
        if shape is None:
            return None
        rows = self.worker.rows
        if rows.version != self._rows_version:
            # row tensors were reallocated: graphs captured the old addresses
            if self.capture:
                torch.cuda.synchronize(self.worker.device)
            self.graphs.clear()
            self._rows_version = rows.version
        cap = self.graphs.get(shape)
        if cap is None:
            cap = self._capture(*shape, capture_layers)
            self.graphs[shape] = cap
        tokens = shape[0]
        copy_from_host(cap.input_ids, token_ids + [0] * (tokens - n))
        copy_from_host(cap.span, [row, start, start + n])
        if cap.graph is not None:
            cap.graph.replay()
            out = cap.out
        else:
            out = cap.forward()
        return ModelOutput(hidden=out.hidden[:n], aux_hidden=[a[:n] for a in out.aux_hidden])

    def _capture(self, tokens: int, width: int, capture_layers: tuple[int, ...]) -> _Captured:
        worker, dev = self.worker, self.worker.device
        input_ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        # padding-only until the first real copy: every token writes the scratch slot
        span = torch.tensor([PAD_ROW, 0, 0], dtype=torch.int64, device=dev)

        def forward() -> ModelOutput:
            with torch.inference_mode():
                row, start, end = span[0:1], span[1], span[2]
                # Positions from `end` on are padding: they read and write only the scratch
                # slot. (Masked keys still enter the attention sums at weight 0, and 0 * NaN is
                # NaN: a stale slot past the request's KV must not even be read.)
                cols = torch.arange(width, device=dev)
                owned = torch.where(cols < end, worker.rows.slots(row, width), SCRATCH_SLOT)
                pos = start + torch.arange(tokens, device=dev)
                real = pos < end
                slots = owned[0, pos.clamp(max=width - 1)]
                meta = build_device_metadata(
                    owned,
                    (start + tokens).view(1),
                    [width],
                    q_len=tokens,
                    extra_len=tokens,
                    out_cache_loc=torch.where(real, slots, SCRATCH_SLOT),
                )
                positions = torch.where(real, pos, start)
                return worker.target.forward(input_ids, positions, meta, capture_layers)

        if not self.capture:
            return _Captured(None, forward, input_ids, span, None)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, out = capture_graph(forward, self.pool, dev)
        self.num_captures += 1
        log.info("captured prefill graph: %d tokens, width %d", tokens, width)
        return _Captured(graph, forward, input_ids, span, out)
