"""Paged attention over a flat batch: metadata, the backend interface, the torch reference.

Layout (FlashInfer-style ragged indices). Request b owns query tokens
`qo_indptr[b]:qo_indptr[b+1]` of the flat batch and sees the KV slots
`kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, in logical order. The first
`kv_len - extra_len` of those are its cached prefix, visible to all its queries; the last
`extra_len` are governed by a mask:
- no mask: causal, aligned at the end (query i sees extra j iff j <= i + extra_len - q_len);
  plain prefill/extend is `extra_len == q_len`.
- `custom_mask`: bool [q_len, extra_len] per request, flattened row-major and concatenated;
  `mask_indptr[b]` is where request b's block starts. Tree verification and tree drafting
  use it (a node sees its ancestors and itself).
New K/V are written into `out_cache_loc` (one slot per query token) before attending.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from specserve.config.kernels import REFERENCE, Kernels
from specserve.kv.pool import KVCache


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [B+1] int32/64, device
    kv_indptr: torch.Tensor  # [B+1]
    kv_indices: torch.Tensor  # [sum kv_len] slot ids
    extra_lens: torch.Tensor  # [B]
    out_cache_loc: torch.Tensor  # [T]
    custom_mask: torch.Tensor | None = None  # [sum q_len*extra_len] bool
    mask_indptr: torch.Tensor | None = None  # [B+1]
    # Host copies for the reference backend and for launch sizes; never read back from device.
    host_qo_indptr: list[int] = field(default_factory=list)
    host_kv_indptr: list[int] = field(default_factory=list)
    host_extra_lens: list[int] = field(default_factory=list)
    host_mask_indptr: list[int] | None = None
    # When KV lengths live on the device (decode steps), host_kv_indptr holds upper bounds:
    # good for sizing launches, never for locating a request's KV.
    host_kv_is_upper_bound: bool = False
    # A decode step's forward (verify, drafting, draft extend), not a prefill: batch-invariant
    # attention gives these one reduction order per query row (ops/triton_attention.py).
    decode_step: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.host_qo_indptr) - 1


class AttentionBackend(ABC):
    """Computes attention for one layer of a forward; a model runner owns one backend.

    `fused_rope_write`: the model applies rotary embeddings and writes K/V into the cache
    itself in one fused kernel (`specserve.ops.triton_rope`) and then calls `forward` with
    k = v = None."""

    fused_rope_write: bool = False

    @abstractmethod
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, heads, head_dim]
        k: torch.Tensor | None,  # [T, kv_heads, head_dim]; None: already in the cache
        v: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...


@dataclass
class PackedQueries:
    """A forward over some rows of a batch's attention layout (ragged verification: the
    nodes each request verifies): matmuls run on the packed tokens, attention on the full
    layout, where the rows left out are zeros no kept query sees."""

    index: torch.Tensor  # [T] the packed tokens' rows in the full layout
    rows: int  # rows of the full layout
    write_slots: torch.Tensor  # [T] the packed tokens' KV slots

    def spread(self, t: torch.Tensor) -> torch.Tensor:
        full = torch.zeros((self.rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return full.index_copy_(0, self.index, t)


@dataclass
class ForwardContext:
    """Per-forward state handed down the model (no process-wide globals: a draft model and a
    target model in one process each get their own context)."""

    backend: AttentionBackend
    kv_cache: KVCache
    meta: AttentionMetadata
    capture_layers: tuple[int, ...] = ()  # target layers whose input EAGLE3 reads (may repeat)
    kernels: Kernels = REFERENCE  # which implementation each layer op runs
    packed: PackedQueries | None = None  # the forward's tokens are some rows of `meta`'s

    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """k = v = None: this layer's new K/V are already in the cache at `write_slots`."""
        if self.packed is None:
            return self.backend.forward(layer_id, q, k, v, self.kv_cache, self.meta)
        p = self.packed
        q, k, v = (None if t is None else p.spread(t) for t in (q, k, v))
        return self.backend.forward(layer_id, q, k, v, self.kv_cache, self.meta)[p.index]

    @property
    def write_slots(self) -> torch.Tensor:
        """Where this forward's tokens write their K/V."""
        return self.meta.out_cache_loc if self.packed is None else self.packed.write_slots

    @property
    def fused_rope_write(self) -> bool:
        return self.backend.fused_rope_write


def visible_mask(
    meta: AttentionMetadata, b: int, kv_len: int, device: torch.device
) -> torch.Tensor:
    """bool [q_len, kv_len] of what request b's queries may see."""
    q_len = meta.host_qo_indptr[b + 1] - meta.host_qo_indptr[b]
    extra = meta.host_extra_lens[b]
    prefix = kv_len - extra
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if meta.custom_mask is not None:
        assert meta.host_mask_indptr is not None
        start = meta.host_mask_indptr[b]
        block = meta.custom_mask[start : start + q_len * extra].view(q_len, extra)
        mask[:, prefix:] = block
    else:
        i = torch.arange(q_len, device=device)[:, None]
        j = torch.arange(extra, device=device)[None, :]
        mask[:, prefix:] = j <= i + (extra - q_len)
    return mask


class TorchAttentionBackend(AttentionBackend):
    """Obviously-correct reference, float32 softmax; CPU and CUDA.

    Small batches are padded into one dense [B, heads, max_q, max_kv] problem (the padding
    gather and the visibility mask are built once per forward and shared by all layers);
    batches whose padded problem would be large fall back to one request at a time."""

    max_dense_elements = 1 << 24

    def forward(self, layer_id, q, k, v, kv_cache, meta):
        if k is not None:
            kv_cache.write(layer_id, meta.out_cache_loc, k, v)
        dense = _dense_layout(meta, q.device, q.shape[1])
        if dense is None:
            return self._per_request(layer_id, q, kv_cache, meta)
        q_rows, kv_slots, mask, out_rows = dense
        k_all, v_all = kv_cache.layer(layer_id)
        group = q.shape[1] // k_all.shape[1]
        kb = k_all[kv_slots].float().repeat_interleave(group, dim=2)  # [B, m, heads, d]
        vb = v_all[kv_slots].float().repeat_interleave(group, dim=2)
        qb = q.float()[q_rows]  # [B, n, heads, d]
        scores = torch.einsum("bnhd,bmhd->bhnm", qb, kb) * (q.shape[-1] ** -0.5)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows see nothing
        out = torch.einsum("bhnm,bmhd->bnhd", probs, vb)
        result = torch.empty_like(q)
        result[out_rows[1]] = out[out_rows[0], out_rows[2]].to(q.dtype)
        return result

    def _per_request(self, layer_id, q, kv_cache, meta):
        k_all, v_all = kv_cache.layer(layer_id)
        out = torch.empty_like(q)
        group = q.shape[1] // k_all.shape[1]
        scale = q.shape[-1] ** -0.5
        # The reference may read lengths back from the device (it is not the fast path).
        kv_ptr = meta.kv_indptr.tolist() if meta.host_kv_is_upper_bound else meta.host_kv_indptr
        for b in range(meta.batch_size):
            qs, qe = meta.host_qo_indptr[b], meta.host_qo_indptr[b + 1]
            if qe == qs:
                continue
            ks, ke = kv_ptr[b], kv_ptr[b + 1]
            slots = meta.kv_indices[ks:ke]
            kb = k_all[slots].float().repeat_interleave(group, dim=1)  # [m, heads, d]
            vb = v_all[slots].float().repeat_interleave(group, dim=1)
            qb = q[qs:qe].float()  # [n, heads, d]
            scores = torch.einsum("nhd,mhd->hnm", qb, kb) * scale
            mask = visible_mask(meta, b, ke - ks, q.device)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[qs:qe] = torch.einsum("hnm,mhd->nhd", probs, vb).to(q.dtype)
        return out


def _dense_layout(meta: AttentionMetadata, device: torch.device, heads: int):
    """(q_rows [B, n], kv_slots [B, m], mask [B, n, m], (b, row, i) scatter of real queries),
    cached on the metadata; None when the padded problem is too large."""
    cached = getattr(meta, "_dense", "unset")
    if cached != "unset":
        return cached
    b = meta.batch_size
    q_lens = [meta.host_qo_indptr[i + 1] - meta.host_qo_indptr[i] for i in range(b)]
    kv_lens = [meta.host_kv_indptr[i + 1] - meta.host_kv_indptr[i] for i in range(b)]
    n, m = max(q_lens, default=0), max(kv_lens, default=0)
    if b == 0 or n == 0 or b * heads * n * m > TorchAttentionBackend.max_dense_elements:
        meta._dense = None
        return None
    qo = torch.tensor(meta.host_qo_indptr[:-1], device=device)
    ql = torch.tensor(q_lens, device=device)
    # Real lengths from the device tensor (host lists may be upper bounds); padding to the
    # host maximum keeps every shape host-known.
    kvp = meta.kv_indptr[:-1]
    kl = meta.kv_indptr[1:] - meta.kv_indptr[:-1]
    ar_n = torch.arange(n, device=device)
    ar_m = torch.arange(m, device=device)
    q_valid = ar_n[None, :] < ql[:, None]
    kv_valid = ar_m[None, :] < kl[:, None]
    q_rows = torch.where(q_valid, qo[:, None] + ar_n[None, :], 0)
    kv_slots = meta.kv_indices[torch.where(kv_valid, kvp[:, None] + ar_m[None, :], 0)]
    extra = torch.tensor(meta.host_extra_lens, device=device)
    prefix = kl - extra
    i = ar_n[None, :, None]
    j = ar_m[None, None, :] - prefix[:, None, None]  # index into the extra part
    if meta.custom_mask is None:
        in_extra = j <= i + (extra - ql)[:, None, None]
    else:
        mp = torch.tensor(meta.host_mask_indptr[:-1], device=device)
        flat = mp[:, None, None] + i * extra[:, None, None] + j
        ok = (j >= 0) & q_valid[:, :, None] & kv_valid[:, None, :]
        in_extra = torch.where(ok, meta.custom_mask[torch.where(ok, flat, 0)], False)
    mask = torch.where(j < 0, True, in_extra) & q_valid[:, :, None] & kv_valid[:, None, :]
    # query lengths are host-known: build the scatter of real query rows on the host
    bi = torch.tensor([i for i, n_ in enumerate(q_lens) for _ in range(n_)], device=device)
    ri = torch.tensor([r for n_ in q_lens for r in range(n_)], device=device)
    meta._dense = (q_rows, kv_slots, mask, (bi, q_rows[bi, ri], ri))
    return meta._dense
