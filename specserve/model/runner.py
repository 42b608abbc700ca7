"""Runs one model over prepared inputs with its KV tensors, attention backend and kernels."""

from __future__ import annotations

import torch

from specserve.config.kernels import REFERENCE, Kernels
from specserve.kv.pool import KVCache
from specserve.ops.attention import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    PackedQueries,
)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        kernels: Kernels = REFERENCE,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.kernels = kernels

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
        packed: PackedQueries | None = None,
    ):
        """packed: the tokens are some rows of `meta`'s layout (ragged verification)."""
        ctx = ForwardContext(
            self.backend, self.kv_cache, meta, capture_layers, self.kernels, packed
        )
        return self.model(input_ids, positions, ctx)
