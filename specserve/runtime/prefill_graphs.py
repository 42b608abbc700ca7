"""CUDA graphs for the target's forward over one request's prefill chunk.

At batch 1 a short prompt's prefill is bound by the host: the eager forward of a small
model launches hundreds of kernels from Python (SmolLM2-135M, 64 tokens: ~16 ms of host
time for ~0.6 ms of device work), which is as long as a whole speculative answer's decode
steps. So a prefill batch of a single chunk of at most `max_tokens` tokens replays a
captured forward instead; everything else (several requests, longer chunks) runs eagerly.

A graph is keyed by the chunk's length padded up to a power of two (>= MIN_TOKENS) and by the
context width (start + padded length, padded as decode graphs pad it); every length bucket is
captured at its shortest width when the engine starts (`capture_at_start`), other widths as
chunks meet them. Its static inputs are
the token ids and (row, start, end): the request's KV slots are read on the device from its
row of `RequestRows`, as a decode step reads them. Padding tokens sit after the chunk, so
causal attention keeps them out of every real token's view; they read and write only the
scratch slot 0 and their outputs are discarded. The last token's logits and sampling run
eagerly on the graph's outputs (views valid until the next replay of a graph in this pool).

With an EAGLE or EAGLE3 draft a second graph of the same shape replays the draft's prefill of
the chunk (`draft`): token x_{j+1} with the target's feature h_j at position j, so it shares
the target's positions, slots and metadata; the token after the chunk (the sampled one, or
the prompt's next) is a static input. Eagerly this was ~25 launches and host-built metadata,
as long as the target's whole prefill. A standalone draft (tokens at their own positions, one
more row when the prompt completes) keeps the eager path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specserve.kv.request_rows import PAD_ROW
from specserve.model.llama import ModelOutput
from specserve.ops.attention_metadata import build_device_metadata
from specserve.runtime.cuda_graphs import MIN_WIDTH
from specserve.runtime.graph_capture import (
    capture_graph,
    capture_unless_out_of_memory,
    copy_from_host,
    pow2_bucket,
    synchronize_device,
)

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
    next_token: torch.Tensor | None = None  # [1] static input of the draft graph
    draft_graph: object | None = None
    draft_forward: object | None = None  # the draft's prefill over the static inputs
    draft_out: torch.Tensor | None = None  # [tokens, H] static output of the draft graph
    last_out: ModelOutput | None = None  # eager (capture=False): the last forward's outputs


class PrefillGraphs:
    def __init__(
        self,
        worker,
        max_tokens: int,
        max_width: int,
        capture: bool = True,
        eager_without_memory: bool = True,
    ):
        """capture=False runs the same padded forward eagerly: how the padding is tested on
        machines without CUDA. eager_without_memory=False: a capture without device memory
        raises (tensor-parallel ranks, whose forwards must stay alike)."""
        self.worker = worker
        self.eager_without_memory = eager_without_memory
        self.max_tokens = max_tokens
        self.max_width = max_width
        self.capture = capture
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = None
        self._rows_version = worker.rows.version
        self.num_captures = 0
        self._no_memory: dict[tuple[int, int], None] = {}  # shapes whose capture ran out
        self._last: tuple[_Captured, int] | None = None  # the last forward's graph, tokens

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
                synchronize_device(self.worker.device)
            self.graphs.clear()
            self._no_memory.clear()
            self._rows_version = rows.version
        cap = self.graphs.get(shape)
        if cap is None:
            cap = self._capture_if_memory(shape, capture_layers)
            if cap is None:
                return None
            self.graphs[shape] = cap
        tokens = shape[0]
        copy_from_host(cap.input_ids, token_ids + [0] * (tokens - n))
        copy_from_host(cap.span, [row, start, start + n])
        if cap.graph is not None:
            cap.graph.replay()
            out = cap.out
        else:
            out = cap.last_out = cap.forward()
        self._last = (cap, n)
        return ModelOutput(hidden=out.hidden[:n], aux_hidden=[a[:n] for a in out.aux_hidden])

    @torch.inference_mode()  # (as when a step meets its shape: inputs written in place)
    def capture_at_start(self, capture_layers: tuple[int, ...], max_chunk: int | None) -> int:
        """Capture a chunk of every token bucket up to `max_chunk` tokens (the scheduler's
        chunk size; None: no limit but the graphs') at its shortest width, before the first
        request. The first capture at a chunk length compiles its kernels' variants: serving
        SmolLM2 on an H100, a request whose 16-token chunk met it waited 0.67 s for its first
        token, against 7 ms for the others. Returns how many shapes were captured. A length
        whose capture finds no device memory, and every longer one, is left to serving."""
        count, tokens, most = 0, MIN_TOKENS, min(self.max_tokens, max_chunk or self.max_tokens)
        while (shape := self.bucket(0, min(tokens, most))) is not None:
            if shape not in self.graphs:
                cap = self._capture_if_memory(shape, capture_layers)
                if cap is None:
                    break  # (longer chunks need more)
                self.graphs[shape] = cap
                count += 1
            if tokens >= most:
                break
            tokens *= 2
        return count

    def draft(self, next_token: torch.Tensor | int) -> torch.Tensor:
        """The draft's prefill of the chunk of the last `forward` (which returned a graph's
        outputs), replayed; `next_token`: the token after the chunk, a [1] device tensor (the
        sampled one) or a host int (the prompt's). Returns the draft's state at the chunk's
        last token, [1, H] (a view of the graph's output)."""
        assert self._last is not None and self.worker.drafter.graphs_prefill
        cap, n = self._last
        if isinstance(next_token, int):
            copy_from_host(cap.next_token, [next_token])
        else:
            cap.next_token.copy_(next_token.reshape(1))
        if cap.draft_graph is not None:
            cap.draft_graph.replay()
            g = cap.draft_out
        else:
            g = cap.draft_forward()
        return g[n - 1 : n]

    def _metadata(self, span: torch.Tensor, tokens: int, width: int):
        """(metadata, positions) of the padded chunk in `span`, on the device."""
        dev = self.worker.device
        row, start, end = span[0:1], span[1], span[2]
        # Positions from `end` on are padding: they read and write only the scratch slot.
        # (Masked keys still enter the attention sums at weight 0, and 0 * NaN is NaN: a stale
        # slot past the request's KV must not even be read.)
        cols = torch.arange(width, device=dev)
        owned = torch.where(cols < end, self.worker.rows.slots(row, width), SCRATCH_SLOT)
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
            use_kernel=self.worker.kernels.decode_metadata,
        )
        return meta, torch.where(real, pos, start)

    def _capture_if_memory(
        self, shape: tuple[int, int], capture_layers: tuple[int, ...]
    ) -> _Captured | None:
        """The graphs of `shape`, captured; None when the device has no memory for them, then
        or ever after (until the rows are reallocated): captures write the scratch slot
        alone, so such chunks prefill eagerly instead."""
        if shape in self._no_memory:
            return None
        cap = capture_unless_out_of_memory(
            lambda: self._capture(*shape, capture_layers),
            f"prefill graph {shape}",
            self.eager_without_memory,
        )
        if cap is None:
            self._no_memory[shape] = None
        return cap

    def _capture(self, tokens: int, width: int, capture_layers: tuple[int, ...]) -> _Captured:
        worker, dev = self.worker, self.worker.device
        input_ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        # padding-only until the first real copy: every token writes the scratch slot
        span = torch.tensor([PAD_ROW, 0, 0], dtype=torch.int64, device=dev)

        def forward() -> ModelOutput:
            with torch.inference_mode():
                meta, positions = self._metadata(span, tokens, width)
                return worker.target.forward(input_ids, positions, meta, capture_layers)

        cap = _Captured(None, forward, input_ids, span, None)
        if worker.drafter.graphs_prefill:
            cap.next_token = torch.zeros(1, dtype=torch.int64, device=dev)
            cap.draft_forward = self._draft_forward(cap, tokens, width)
        if not self.capture:
            return cap
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        cap.graph, cap.out = capture_graph(forward, self.pool, dev)
        cap.last_out = cap.out
        self.num_captures += 1
        if cap.draft_forward is not None:  # reads the target graph's static outputs
            cap.draft_graph, cap.draft_out = capture_graph(cap.draft_forward, self.pool, dev)
            self.num_captures += 1
        log.info(
            "captured prefill graph in %.2f s: %d tokens, width %d",
            time.perf_counter() - start,
            tokens,
            width,
        )
        return cap

    def _draft_forward(self, cap: _Captured, tokens: int, width: int):
        drafter, dev = self.worker.drafter, self.worker.device
        rows = torch.arange(tokens, device=dev)

        def draft_forward() -> torch.Tensor:
            with torch.inference_mode():
                meta, positions = self._metadata(cap.span, tokens, width)
                # row i: token x_{start+i+1}, the chunk's next token, and for the chunk's last
                # row the token after it; padding rows' tokens do not matter
                n = cap.span[2] - cap.span[1]
                shifted = torch.roll(cap.input_ids, -1)
                next_tokens = torch.where(rows == n - 1, cap.next_token, shifted)
                features = drafter.features_of(cap.last_out, None)
                return drafter.forward(next_tokens, features, positions, meta)

        return draft_forward
