"""Assembly of one forward's attention metadata: from host segments (prefill, where every
length is known on the host) or on the device (decode steps, whose KV lengths live on the
device so the host never has to wait for the previous step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.device import to_device
from specserve.ops.attention import AttentionMetadata


@dataclass
class Segment:
    """One request's part of a forward."""

    kv_slots: torch.Tensor  # CPU int64: every slot its queries may see, logical order
    q_len: int
    extra_len: int  # trailing kv entries under the mask (causal if no custom mask)


def build_metadata(
    segments: list[Segment],
    out_cache_loc: torch.Tensor,
    device: torch.device,
    custom_mask: torch.Tensor | None = None,
) -> AttentionMetadata:
    """custom_mask, if given, is already flattened per request ([q_len * extra_len] each),
    concatenated in segment order, on the device."""
    qo, kv, extra, mask_ptr = [0], [0], [], [0]
    for s in segments:
        qo.append(qo[-1] + s.q_len)
        kv.append(kv[-1] + len(s.kv_slots))
        extra.append(s.extra_len)
        mask_ptr.append(mask_ptr[-1] + s.q_len * s.extra_len)
    kv_indices = (
        torch.cat([s.kv_slots for s in segments]) if segments else torch.empty(0, dtype=torch.int64)
    )

    def dev(x: list[int] | torch.Tensor) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int64)
        return to_device(t, device)

    return AttentionMetadata(
        qo_indptr=dev(qo),
        kv_indptr=dev(kv),
        kv_indices=dev(kv_indices),
        extra_lens=dev(extra),
        out_cache_loc=to_device(out_cache_loc, device),
        custom_mask=custom_mask,
        mask_indptr=dev(mask_ptr) if custom_mask is not None else None,
        host_qo_indptr=qo,
        host_kv_indptr=kv,
        host_extra_lens=extra,
        host_mask_indptr=mask_ptr if custom_mask is not None else None,
    )


def build_device_metadata(
    owned_slots: torch.Tensor,
    visible_lens: torch.Tensor,
    visible_upper: list[int],
    q_len: int,
    extra_len: int,
    out_cache_loc: torch.Tensor,
    custom_mask: torch.Tensor | None = None,
    use_kernel: bool = False,
    decode_step: bool = False,
) -> AttentionMetadata:
    """Metadata for requests that each see the logical prefix [0, visible_lens[b]) of their
    slots, with the last `extra_len` of those under the (causal or custom) mask.

    owned_slots: [B, L] device slots of positions 0..L-1 (padding beyond what a request owns
    is never read). visible_lens: [B] device. visible_upper: host upper bounds of
    visible_lens: they size the index buffer and the kernels' launch plans, so the host needs
    no device value (host_kv_indptr then holds bounds; host_kv_is_upper_bound says so).

    use_kernel: the device tensors come from one Triton launch
    (`ops/triton_metadata.py`) instead of about fifteen torch kernels."""
    bsz = owned_slots.shape[0]
    total_upper = sum(visible_upper)
    with_mask = custom_mask is not None
    if use_kernel:
        from specserve.ops.triton_metadata import device_metadata_tensors

        tensors = device_metadata_tensors(
            owned_slots, visible_lens, total_upper, q_len, extra_len, with_mask
        )
    else:
        tensors = _device_metadata_tensors_reference(
            owned_slots, visible_lens, total_upper, q_len, extra_len, with_mask
        )
    qo_indptr, kv_indptr, kv_indices, extra_lens, mask_indptr = tensors
    qo = [q_len * i for i in range(bsz + 1)]
    upper = [0]
    for u in visible_upper:
        upper.append(upper[-1] + u)
    mask_ptr = [q_len * extra_len * i for i in range(bsz + 1)]
    return AttentionMetadata(
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        extra_lens=extra_lens,
        out_cache_loc=out_cache_loc,
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        host_qo_indptr=qo,
        host_kv_indptr=upper,
        host_extra_lens=[extra_len] * bsz,
        host_mask_indptr=mask_ptr if with_mask else None,
        host_kv_is_upper_bound=True,
        decode_step=decode_step,
    )


def _device_metadata_tensors_reference(
    owned_slots: torch.Tensor,
    visible_lens: torch.Tensor,
    total_upper: int,
    q_len: int,
    extra_len: int,
    with_mask: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qo_indptr, kv_indptr, kv_indices, extra_lens, mask_indptr or None) in torch ops (the
    CPU path and the reference of `ops/triton_metadata.py`, which does it in one launch)."""
    device = owned_slots.device
    bsz, width = owned_slots.shape
    kv_indptr = torch.zeros(bsz + 1, dtype=torch.int64, device=device)
    kv_indptr[1:] = torch.cumsum(visible_lens, dim=0)
    t = torch.arange(total_upper, device=device)
    owner = torch.searchsorted(kv_indptr[1:], t, right=True).clamp(max=bsz - 1)
    pos = (t - kv_indptr[owner]).clamp(0, width - 1)
    kv_indices = torch.where(t < kv_indptr[-1], owned_slots[owner, pos], 0)
    # Uniform strides are computed on the device: no host->device copy, so the whole
    # metadata can be built inside a CUDA graph capture.
    batch_ids = torch.arange(bsz + 1, dtype=torch.int64, device=device)
    qo_indptr = batch_ids * q_len
    extra_lens = torch.full((bsz,), extra_len, dtype=torch.int64, device=device)
    mask_indptr = batch_ids * (q_len * extra_len) if with_mask else None
    return qo_indptr, kv_indptr, kv_indices, extra_lens, mask_indptr
