"""Rotary position embedding applied to q and k, in torch: the model's rotation and the
reference of the fused rotary + KV-write kernel (ops/triton_rope.py)."""

from __future__ import annotations

import torch


def apply_rotary(
    positions: torch.Tensor, inv_freq: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ("rotate half" convention) in float32; outputs keep the input dtype."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)[:, None, :]
    sin = torch.cat([freqs.sin(), freqs.sin()], dim=-1)[:, None, :]
    return _apply(q, cos, sin), _apply(k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)
