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
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

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

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every layer's KV from src to dst slots (gather first, so overlaps are safe)."""
        for t in (*self.k, *self.v):
            t[dst_slots] = t[src_slots]
