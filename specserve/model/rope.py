"""Rotary position embedding (rotate-half convention, as in Hugging Face Llama)."""

from __future__ import annotations

import math

import torch

from specserve.model.config import RopeScaling
from specserve.ops.rotary import apply_rotary


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    # Computed on the CPU even inside a `torch.device("meta")` block (the loader builds models
    # there and recomputes this afterwards): meta-device arithmetic imports torch._dynamo,
    # seconds of start-up.
    exps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exps)
    if scaling is None:
        return inv_freq.float()
    if scaling.freq_factors is not None:
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float64, device="cpu")
        if factors.numel() != inv_freq.numel():
            raise ValueError(
                f"rope: {factors.numel()} frequency factors for head_dim {head_dim} "
                f"(expected {inv_freq.numel()})"
            )
        return (inv_freq / factors).float()
    # Llama 3.1: keep high frequencies, divide low frequencies by `factor`, blend between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, blended, out).float()


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        self._freq_args = (head_dim, theta, scaling)
        # YaRN scales cos and sin, so both q and k: the scores by its square, carried by q
        # alone (rotation is linear), so the cached keys stay those of a plain rotation
        factor = 1.0 if scaling is None else scaling.attention_factor
        self.q_scale = factor * factor
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to(bf16) would round the frequencies (angles drift by ~p * 2^-9 rad at
        # position p) and to_empty() off the meta device leaves them uninitialised: whatever
        # was applied, recompute them in float32 on the module's new device.
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.inv_freq = rope_inv_freq(*self._freq_args).to(self.inv_freq.device)
        return self

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim], positions: [T]."""
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return apply_rotary(positions, self.inv_freq, q, k)
