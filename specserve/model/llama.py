"""A Llama-family decoder over a flat batch of tokens (Llama 2/3, SmolLM2, Qwen2, Qwen3).

Tokens of all requests in a step are concatenated into one [T] sequence; the attention
backend in `ForwardContext` knows which token belongs to which request and which cached
KV it may see. Parameter names follow Hugging Face, except that q/k/v and gate/up are
stored fused (`qkv_proj`, `gate_up_proj`); `load_weights` does the stacking.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.config import ModelConfig
from specserve.model.rope import RotaryEmbedding
from specserve.ops.attention import ForwardContext


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, input_size: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        in_size = input_size or cfg.hidden_size
        self.qkv_proj = nn.Linear(in_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = ctx.attention(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


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
        for i, layer in enumerate(self.model.layers):
            if i in ctx.capture_layers:
                aux.append(h)
            h = layer(h, positions, ctx)
        return ModelOutput(hidden=self.model.norm(h), aux_hidden=aux)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up on the way."""
        load_hf_named_weights(self, weights)


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_hf_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy Hugging Face-named tensors into `module`, whose q/k/v and gate/up are fused.

    Every parameter of the module must be written exactly once; a missing or unexpected
    name raises, so a wrong checkpoint never runs with random weights.
    """
    params = dict(module.named_parameters())
    written: set[str] = set()
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and "lm_head.weight" not in params:
            continue  # tied embeddings: some checkpoints still carry a copy
        pieces = name.split(".")
        fused = next(((i, _FUSED[p]) for i, p in enumerate(pieces) if p in _FUSED), None)
        if fused is not None:
            i, (target, shard) = fused
            target_name = ".".join(pieces[:i] + [target] + pieces[i + 1 :])
            parts.setdefault(target_name, {})[shard] = tensor
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
        _copy(params[name], tensor, name)
        written.add(name)
    for target_name, shards in parts.items():
        if target_name not in params:
            raise KeyError(f"checkpoint tensors for {target_name!r} have no place in the model")
        _copy_stacked(params[target_name], [shards[i] for i in sorted(shards)], target_name)
        written.add(target_name)
    missing = sorted(set(params) - written)
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")


def _copy_stacked(param: torch.Tensor, shards: list[torch.Tensor], name: str) -> None:
    """Copy shards stacked along dim 0 into `param` (what torch.cat then _copy would do,
    without materializing the concatenation)."""
    shape = (sum(s.shape[0] for s in shards), *shards[0].shape[1:])
    if tuple(param.shape) != shape or any(s.shape[1:] != shards[0].shape[1:] for s in shards):
        got = [tuple(s.shape) for s in shards]
        raise ValueError(
            f"{name}: checkpoint shards {got} do not stack to model shape {tuple(param.shape)}"
        )
    offset = 0
    with torch.no_grad():
        for s in shards:
            param[offset : offset + s.shape[0]].copy_(s.to(param.dtype))
            offset += s.shape[0]


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
