"""Triton attention backend: same results as `TorchAttentionBackend`, in a few launches.

- Decode (every request has one query and there is no custom mask): split-KV kernel plus a
  merge, see `triton_kernels.decode`.
- Everything else (prefill, chunked prefill over a cached prefix, mixed batches, tree
  verification and drafting with `custom_mask`): one flash-attention kernel, see
  `triton_kernels.extend`.

K/V are written into the cache with torch indexing first, exactly as the reference does.
No host-device synchronisation: launch sizes come from the host lists of the metadata
(`host_qo_indptr`, `host_kv_indptr`), never from reading device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from specserve.kv.pool import KVCache
from specserve.ops.attention import AttentionBackend, AttentionMetadata
from specserve.ops.triton_kernels import decode_attention, extend_attention

_DECODE_BLOCK_N = 64


@dataclass(frozen=True)
class _LaunchPlan:
    """Host-side launch sizes for one forward; the same for all its layers."""

    is_decode: bool
    max_q_len: int
    num_splits: int
    kv_per_split: int


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, num_kv_splits: int | None = None, min_kv_per_split: int = 256):
        """num_kv_splits: force the decode split count (tests); None picks it from the GPU size.
        min_kv_per_split: shortest chunk worth its own program (smaller chunks cost more in
        the merge than they save)."""
        self.num_kv_splits = num_kv_splits
        self.min_kv_per_split = min_kv_per_split
        self._num_sms: int | None = None
        # One forward calls us once per layer with the same metadata object: plan once.
        self._plan_for: AttentionMetadata | None = None
        self._plan: _LaunchPlan | None = None

    def _sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":  # a host-side property query, no synchronisation
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:  # the Triton interpreter on CPU: a small machine keeps test grids small
                self._num_sms = 4
        return self._num_sms

    def _make_plan(self, meta: AttentionMetadata, num_kv_heads: int, device) -> _LaunchPlan:
        qo, kv = meta.host_qo_indptr, meta.host_kv_indptr
        batch = meta.batch_size
        q_lens = [qo[i + 1] - qo[i] for i in range(batch)]
        max_q_len = max(q_lens, default=0)
        is_decode = batch > 0 and meta.custom_mask is None and min(q_lens) == max_q_len == 1
        if not is_decode:
            return _LaunchPlan(False, max_q_len, 1, 0)
        max_kv = max(kv[i + 1] - kv[i] for i in range(batch))
        if self.num_kv_splits is not None:
            splits = self.num_kv_splits
        else:
            # Aim for about two programs per SM, but no chunk shorter than min_kv_per_split.
            splits = triton.cdiv(2 * self._sm_count(device), batch * num_kv_heads)
            splits = min(splits, triton.cdiv(max_kv, self.min_kv_per_split), 64)
        splits = max(1, splits)
        # Chunks are whole KV blocks; recompute the count so no trailing split is always empty.
        kv_per_split = max(1, triton.cdiv(triton.cdiv(max_kv, splits), _DECODE_BLOCK_N))
        kv_per_split *= _DECODE_BLOCK_N
        splits = max(1, triton.cdiv(max_kv, kv_per_split))
        return _LaunchPlan(True, 1, splits, kv_per_split)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        kv_cache.write(layer_id, meta.out_cache_loc, k, v)
        k_cache, v_cache = kv_cache.layer(layer_id)
        out = torch.empty_like(q)
        if q.shape[0] == 0 or meta.batch_size == 0:
            return out
        if q.stride(-1) != 1:
            q = q.contiguous()
        if self._plan_for is not meta:
            self._plan = self._make_plan(meta, k_cache.shape[1], q.device)
            self._plan_for = meta
        plan = self._plan
        assert plan is not None
        if plan.is_decode:
            decode_attention(
                q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, out,
                plan.num_splits, plan.kv_per_split, block_n=_DECODE_BLOCK_N,
            )  # fmt: skip
        else:
            extend_attention(
                q, k_cache, v_cache, out, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                meta.extra_lens, meta.custom_mask, meta.mask_indptr,
                meta.batch_size, plan.max_q_len,
            )  # fmt: skip
        return out
