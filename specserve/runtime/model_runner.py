"""Runs one model (target or draft) over prepared inputs; owns its KV tensors and backend."""

from __future__ import annotations

import torch

from specserve.kv.pool import KVCache
from specserve.ops.attention import AttentionBackend, AttentionMetadata, ForwardContext


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
        **model_kwargs,
    ):
        ctx = ForwardContext(self.backend, self.kv_cache, meta, capture_layers)
        return self.model(input_ids, positions, ctx, **model_kwargs)
