"""A Llama-family decoder over a flat batch of tokens (Llama 2/3, SmolLM2, Qwen2, Qwen3).

Tokens of all requests in a step are concatenated into one [T] sequence; the attention
backend in `ForwardContext` knows which token belongs to which request and which cached KV
it may see. Parameter names follow Hugging Face, except that q/k/v and gate/up are stored
fused (`qkv_proj`, `gate_up_proj`); `load_weights` does the stacking. The layers and their
fused GPU variants are in layers.py; which run is the context's `Kernels`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config.kernels import REFERENCE, Kernels
from specserve.model.config import ModelConfig
from specserve.model.layers import (
    DecoderLayer,
    RMSNorm,
    arrangement_mode,
    fused_mode,
    invariant_gemm_runs,
)
from specserve.model.weights import load_hf_named_weights
from specserve.ops.attention import ForwardContext


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Pass the weight: Embedding's own init calls normal_, which on the meta device (where
        # the loader builds models) imports torch._dynamo, seconds of start-up for nothing.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [T, H] after the final norm: what lm_head reads (EAGLE's feature)
    aux_hidden: list[torch.Tensor]  # residual stream entering each captured layer (EAGLE3)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> ModelOutput:
        h = self.embed(input_ids)
        aux: list[torch.Tensor] = []
        # F.linear path: the residual adds ride in the next norm's kernel (forward_deferred)
        linears = (lin for layer in self.model.layers for lin in layer.linears)  # (read lazily)
        deferred = (
            arrangement_mode(h, ctx.kernels, linears) == 1 and not torch.is_autocast_enabled()
        )
        pending = None  # the last MLP output, not yet added to h
        for i, layer in enumerate(self.model.layers):
            if i in ctx.capture_layers:  # a layer named twice is captured twice
                if pending is not None:
                    h, pending = h + pending, None
                aux.extend(h for c in ctx.capture_layers if c == i)
            if deferred:
                h, pending = layer.forward_deferred(h, pending, positions, ctx)
            else:
                h = layer(h, positions, ctx)
        norm = self.model.norm
        if pending is None:
            return ModelOutput(hidden=norm(h, ctx.kernels), aux_hidden=aux)
        from specserve.ops.triton_norm import add_rmsnorm

        _, hidden = add_rmsnorm(pending, h, norm.weight, norm.eps)
        return ModelOutput(hidden=hidden, aux_hidden=aux)

    def compute_logits(
        self, hidden: torch.Tensor, kernels: Kernels = REFERENCE, upcast: bool = True
    ) -> torch.Tensor:
        """Logits, float32. With 16-bit weights on CUDA the GEMM itself writes float32:
        logits rounded to bf16 tie often enough to change argmaxes (1.4% of SmolLM2-135M's
        greedy tokens), and verification and batched decoding must take the same argmax as
        one-token decoding. Elsewhere F.linear in the model's dtype, then upcast (upcast=False:
        left in that dtype, for argmax-only callers)."""
        weight = self.lm_head_weight
        mode = fused_mode(hidden, kernels)
        invariant = invariant_gemm_runs(mode, weight, kernels)
        if (mode == 2 or invariant) and weight.dtype == hidden.dtype:
            # (float32 out: no bf16 rounding)
            if invariant:  # deterministic inference, or a tuned shape: the invariant GEMM
                from specserve.ops.triton_invariant_linear import invariant_linear

                return invariant_linear(hidden, weight, out_dtype=torch.float32)
            from specserve.ops.triton_linear import skinny_linear

            return skinny_linear(
                hidden, weight, out_dtype=torch.float32, pdl=kernels.programmatic_launch
            )
        if kernels.fp32_logits and weight.dtype == hidden.dtype != torch.float32:
            flat = torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.t(), torch.float32)
            return flat.view(*hidden.shape[:-1], weight.shape[0])
        logits = F.linear(hidden, weight)
        return logits.float() if upcast else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up on the way."""
        load_hf_named_weights(self, weights)
