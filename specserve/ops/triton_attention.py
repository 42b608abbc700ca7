"""Triton attention backend: same results as `TorchAttentionBackend`, in a few launches.

- Decode (every request has one query and there is no custom mask): split-KV kernel plus a
  merge, see `triton_kernels.decode`.
- Everything else (prefill, chunked prefill over a cached prefix, mixed batches, tree
  verification and drafting with `custom_mask`): one flash-attention kernel, see
  `triton_kernels.extend`; when its grid is too small for the GPU (tree verify at small batch)
  the cached prefix is split across programs and merged like decode splits.

Batch-invariant (`batch_invariant=True`, deterministic inference): a decode step's forwards
(`meta.decode_step`: plain decode, tree verify, drafting) run `triton_kernels.rows`, one
reduction order per query row set by its own visible KV, so a one-token decode and the same
token as a verified tree node agree bit for bit; prefill runs the extend kernel unsplit with
position-aligned blocks, so a prompt's rows do not depend on its batch or chunking.

K/V are written into the cache by the model's fused rope kernel (`fused_rope_write`), or
with torch indexing here when the caller passes them.
No host-device synchronisation: launch sizes come from the host lists of the metadata
(`host_qo_indptr`, `host_kv_indptr`, `host_extra_lens`), never from reading device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from specserve.kv.pool import KVCache
from specserve.ops.attention import AttentionBackend, AttentionMetadata
from specserve.ops.triton_kernels import decode_attention, extend_attention
from specserve.ops.triton_kernels.extend import extend_block_m
from specserve.ops.triton_kernels.rows import row_attention, token_requests

_BLOCK_N = 64  # split chunks are whole multiples of the kernels' KV block
_MAX_SPLITS = 64
# Splitting aims for this many programs per SM (H200 sweep: decode programs are light and
# want several per SM to keep loads in flight; extend programs of 64 rows want about 2).
_DECODE_PROGRAMS_PER_SM = 4
_EXTEND_PROGRAMS_PER_SM = 2
# Shortest cached-prefix chunk of a split extend (tree verify and tree drafting at small batch
# have a handful of programs, each walking the whole prefix one KV block at a time).
EXTEND_MIN_PREFIX_PER_SPLIT = 64


@dataclass(frozen=True)
class _LaunchPlan:
    """Host-side launch sizes for one forward; the same for all its layers."""

    is_decode: bool
    max_q_len: int
    num_splits: int  # KV splits (decode) or cached-prefix splits (extend); 1 = none
    kv_per_split: int
    rows: torch.Tensor | None = None  # batch-invariant decode step: request of each token
    max_kv_len: int = 0


class TritonAttentionBackend(AttentionBackend):
    fused_rope_write = True

    def __init__(
        self,
        num_kv_splits: int | None = None,
        min_kv_per_split: int = 256,
        min_prefix_per_split: int = EXTEND_MIN_PREFIX_PER_SPLIT,
        batch_invariant: bool = False,
    ):
        """num_kv_splits: force the split count of both paths (tests, benchmarks); None picks
        it from the GPU size and the lengths.
        min_kv_per_split: shortest decode chunk worth its own program (smaller chunks cost
        more in the merge than they save); min_prefix_per_split: the same for an extend's
        cached prefix (H200: 64 beat 128 and 256 for batch-1 tree verify and drafting).
        batch_invariant: the deterministic kernels (module doc); the split arguments then
        do not apply."""
        self.batch_invariant = batch_invariant
        self.num_kv_splits = num_kv_splits
        self.min_kv_per_split = max(1, min_kv_per_split)
        self.min_prefix_per_split = max(1, min_prefix_per_split)
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

    def _splits(
        self, programs: int, per_sm: int, max_len: int, device: torch.device, min_len: int
    ) -> tuple[int, int]:
        """(split count, positions per split) for splitting `max_len` KV positions so that
        `programs` programs become about `per_sm` per SM, with no chunk under min_len."""
        if self.num_kv_splits is not None:
            splits = self.num_kv_splits
        else:
            # Round down: one program past what fits at once adds a whole extra wave (H200:
            # 9 prefix splits of a batch-1 tree verify ran 1.5x slower than 8).
            splits = (per_sm * self._sm_count(device)) // max(programs, 1)
            splits = min(splits, triton.cdiv(max_len, min_len), _MAX_SPLITS)
        splits = max(1, splits)
        # Chunks are whole KV blocks; recompute the count so no trailing split is always empty.
        per_split = triton.cdiv(triton.cdiv(max(max_len, 1), splits), _BLOCK_N) * _BLOCK_N
        return max(1, triton.cdiv(max_len, per_split)), per_split

    def _make_plan(self, meta: AttentionMetadata, kv_heads: int, group: int, device) -> _LaunchPlan:
        qo, kv, extra = meta.host_qo_indptr, meta.host_kv_indptr, meta.host_extra_lens
        batch = meta.batch_size
        q_lens = [qo[i + 1] - qo[i] for i in range(batch)]
        kv_lens = [kv[i + 1] - kv[i] for i in range(batch)]
        max_q_len = max(q_lens, default=0)
        if self.batch_invariant:
            if meta.decode_step:
                rows = token_requests(meta.qo_indptr, qo[-1])
                return _LaunchPlan(False, max_q_len, 1, 0, rows, max(kv_lens, default=0))
            return _LaunchPlan(False, max_q_len, 1, 0)
        if meta.custom_mask is None and min(q_lens) == max_q_len == 1:
            splits, per_split = self._splits(
                batch * kv_heads,
                _DECODE_PROGRAMS_PER_SM,
                max(kv_lens),
                device,
                self.min_kv_per_split,
            )
            return _LaunchPlan(True, 1, splits, per_split)
        # Extend: only the cached prefix is split (the masked extra part stays in the last
        # split), and only when the unsplit grid leaves the GPU idle (tree verify at small
        # batch); big prefills have programs to spare and would pay for the partials. (H200,
        # a chain's 3-node verify with 16-row tiles: 2 splits at batch 16 beat 1 and 4; at
        # batch 64 and 128 splitting only added merge work.)
        programs = triton.cdiv(max_q_len * group, extend_block_m(max_q_len * group))
        programs *= batch * kv_heads
        max_prefix = max(n - e for n, e in zip(kv_lens, extra))
        if self.num_kv_splits is None and programs >= self._sm_count(device):
            return _LaunchPlan(False, max_q_len, 1, 0)
        splits, per_split = self._splits(
            programs, _EXTEND_PROGRAMS_PER_SM, max_prefix, device, self.min_prefix_per_split
        )
        return _LaunchPlan(False, max_q_len, splits, per_split)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if k is not None:  # else the model's fused rope kernel already wrote them
            kv_cache.write(layer_id, meta.out_cache_loc, k, v)
        k_cache, v_cache = kv_cache.layer(layer_id)
        out = torch.empty_like(q)
        if q.shape[0] == 0 or meta.batch_size == 0:
            return out
        if q.stride(-1) != 1:
            q = q.contiguous()
        if self._plan_for is not meta:
            kv_heads = k_cache.shape[1]
            self._plan = self._make_plan(meta, kv_heads, q.shape[1] // kv_heads, q.device)
            self._plan_for = meta
        plan = self._plan
        assert plan is not None
        if plan.rows is not None:
            row_attention(
                q, k_cache, v_cache, out, plan.rows, meta.qo_indptr, meta.kv_indptr,
                meta.kv_indices, meta.extra_lens, meta.custom_mask, meta.mask_indptr,
                plan.max_kv_len,
            )  # fmt: skip
        elif plan.is_decode:
            decode_attention(
                q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, out,
                plan.num_splits, plan.kv_per_split,
            )  # fmt: skip
        else:
            extend_attention(
                q, k_cache, v_cache, out, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                meta.extra_lens, meta.custom_mask, meta.mask_indptr,
                meta.batch_size, plan.max_q_len, plan.num_splits, plan.kv_per_split,
                aligned=self.batch_invariant,
            )  # fmt: skip
        return out
