"""Masking logits to the tokens a grammar allows, from xgrammar's packed bitmask (token t of
row r allowed iff bit t % 32 of bitmask[r, t // 32] is set), beside its torch reference."""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[r, t] = -inf where row r does not allow token t (xgrammar's kernel;
    bitmask on the logits' device)."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


def allowed_tokens_reference(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size]: which tokens each row allows."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    unpacked = (bitmask[:, :, None] >> bits) & 1  # (an arithmetic shift: bit 31 is the sign)
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    logits.masked_fill_(~allowed_tokens_reference(bitmask, logits.shape[-1]), float("-inf"))
