"""Plain decoding as a drafter: the tree is the root alone.

`DecodeStep` then verifies a one-node tree, which is an ordinary one-token forward, and the
rest of the engine needs no "is there a drafter" branch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from specserve.speculative.tree import PLAIN, DraftTrees


class RootOnlyDrafter:
    speculative = False  # no draft tokens: no speculative statistics
    shape = PLAIN
    window = 1  # the root's own KV position
    lookahead = 0
    capture_layers: tuple[int, ...] = ()
    kv_bytes_per_slot = 0
    observes_tokens = False
    graphs_prefill = False  # no draft prefill to replay
    draft_kv_reads_next_token = False  # no draft KV: cached prefixes are shared whole

    def kv_caches(self) -> list:
        return []

    def attach(self, table, num_slots: int, backend, rows) -> None:
        """No draft KV, no root state."""

    def draft(self, batch, shape=None, penalties=None) -> DraftTrees:
        return DraftTrees.root_only(batch.roots)

    def extend_after_verify(self, batch, trees, acc, target_out, path_rows) -> None:
        return None

    def extend_after_prefill(self, chunks, target_out, done, sampled) -> torch.Tensor | None:
        return None

    def observe_tokens(self, tokens_by_request: Mapping[str, Sequence[int]]) -> None:
        pass

    def release_tokens(self, request_ids: Iterable[str]) -> None:
        pass
