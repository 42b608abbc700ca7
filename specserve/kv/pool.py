"""KV tensors: one K and one V tensor per layer, indexed by slot."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_slots = num_slots
        # One buffer for all layers' K and V, so moving slots (accepted-path compaction,
        # speculative/kv_commit.py) touches one tensor rather than two per layer; k[i] / v[i] are views.
        self.buffer = torch.zeros(
            (2, num_layers, num_slots, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.k = list(self.buffer[0].unbind(0))
        self.v = list(self.buffer[1].unbind(0))

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer_id][slots] = k.to(self.k[layer_id].dtype)
        self.v[layer_id][slots] = v.to(self.v[layer_id].dtype)
