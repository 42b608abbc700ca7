"""Host-side assembly of one forward's inputs: tokens, positions and attention metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
        return t.to(device, non_blocking=True)

    return AttentionMetadata(
        qo_indptr=dev(qo),
        kv_indptr=dev(kv),
        kv_indices=dev(kv_indices),
        extra_lens=dev(extra),
        out_cache_loc=out_cache_loc.to(device, non_blocking=True),
        custom_mask=custom_mask,
        mask_indptr=dev(mask_ptr) if custom_mask is not None else None,
        host_qo_indptr=qo,
        host_kv_indptr=kv,
        host_extra_lens=extra,
        host_mask_indptr=mask_ptr if custom_mask is not None else None,
    )
