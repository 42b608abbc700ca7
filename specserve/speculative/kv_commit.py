"""Compaction of an accepted tree path's KV to the contiguous front of the request's window.

Node i of a tree wrote its KV at logical position kv_len + i; after acceptance the path
node at depth d must sit at kv_len + d. Working in logical positions and translating to
slots through the request's page table makes this correct for every page size. On CUDA one
Triton kernel moves every layer's rows (`ops/triton_kv_commit.py`); elsewhere torch gathers
the sources before writing any destination, so overlapping moves are safe.
"""

from __future__ import annotations

import torch

from specserve.kv.pool import KVCache


def commit_accepted_path(
    caches: list[KVCache], window_slots: torch.Tensor, path: torch.Tensor, use_kernel: bool
) -> None:
    """window_slots: [B, W] slots of logical positions kv_len .. kv_len+W-1 per request;
    path: [B, D+1] accepted node ids by depth (padded by repeating the last one, whose
    copies land in positions past the accepted length, which are scratch)."""
    for cache in caches:
        if use_kernel:
            from specserve.ops.triton_kv_commit import commit_path

            commit_path(cache.buffer, window_slots, path)
        else:
            commit_path_reference(cache.buffer, window_slots, path)


def commit_path_reference(
    buffer: torch.Tensor, window_slots: torch.Tensor, path: torch.Tensor
) -> None:
    """The compaction in torch: gather every source row, then scatter (KVCache.buffer layout)."""
    src = torch.gather(window_slots, 1, path).reshape(-1)
    dst = window_slots[:, : path.shape[1]].reshape(-1)
    buffer[:, :, dst] = buffer[:, :, src]
