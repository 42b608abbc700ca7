"""Megatron-style sharding of a Llama-family decoder over a tensor-parallel group.

Rank r of tp holds
- attention: query heads [r H/tp, (r+1) H/tp) and the KV heads they read: num_kv_heads/tp of
  them, or, with fewer KV heads than ranks, the one its query heads share (each KV head then
  lives on tp/num_kv_heads ranks, as in SGLang and vLLM). The fused qkv is column-parallel (the
  rank's rows [q_r; k_r; v_r]), o_proj row-parallel (those heads' columns);
- MLP: gate_up column-parallel (the rank's rows of gate and of up), down row-parallel;
- embedding and lm_head: vocabulary-parallel, ceil(V / tp) rows per rank, the last rank's
  padded with zero rows; tied embeddings share that one shard.
A row-parallel output is a partial sum over the rank's heads or columns: it is all-reduced,
and rank 0 alone adds the residual (still fused into its GEMM), so the sum counts it once. An
embedding lookup outside a rank's rows gives zeros, so the all-reduce gives the row exactly.
Logits are gathered over the vocabulary and the padding cut. Norms and rotary are
replicated; so is the draft (`ReplicatedVocab` gives an EAGLE head the full embedding and
lm_head it shares with the target).

Checkpoints are read shard by shard (`CheckpointShard`): each rank reads only its slices of
safetensors tensors, and of GGUF tensors dequantizes only its slice's blocks: a quantized row
is whole blocks, so rows (column-parallel weights, the vocabulary) always slice; columns
(row-parallel o / down) slice on block boundaries (32 or 256 values), else that one tensor is
dequantized whole and cut.
"""

from __future__ import annotations

import functools
import types
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config.kernels import REFERENCE, Kernels
from specserve.errors import InvalidArgument
from specserve.model.config import ModelConfig
from specserve.model.layers import MLP, Attention, RMSNorm
from specserve.model.llama import LlamaForCausalLM
from specserve.model.loader import random_weights
from specserve.ops.attention import ForwardContext
from specserve.ops.collectives import TensorParallel


# ---- which tp sizes a model allows --------------------------------------------------------------
def _divides(cfg: ModelConfig, tp: int) -> bool:
    kv = cfg.num_kv_heads
    return (
        cfg.num_heads % tp == 0
        and cfg.intermediate_size % tp == 0
        and (kv % tp == 0 or tp % kv == 0)
    )


def allowed_tp_sizes(cfg: ModelConfig) -> list[int]:
    return [tp for tp in range(1, cfg.num_heads + 1) if _divides(cfg, tp)]


def check_shardable(cfg: ModelConfig, tp_size: int) -> None:
    if not _divides(cfg, tp_size):
        raise InvalidArgument(
            "tp_size",
            f"{tp_size} does not divide the model: {cfg.num_heads} attention heads, "
            f"{cfg.num_kv_heads} KV heads (a multiple or a divisor of tp_size), intermediate "
            f"size {cfg.intermediate_size}; allowed: {', '.join(map(str, allowed_tp_sizes(cfg)))}",
        )


def local_kv_heads(cfg: ModelConfig, tp_size: int) -> int:
    """KV heads one rank holds (its KV cache's width)."""
    return max(1, cfg.num_kv_heads // tp_size)


def local_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The shape of one rank's attention and MLP."""
    return replace(
        cfg,
        num_heads=cfg.num_heads // tp_size,
        num_kv_heads=local_kv_heads(cfg, tp_size),
        intermediate_size=cfg.intermediate_size // tp_size,
    )


def vocab_rows(vocab_size: int, tp_size: int) -> int:
    """Rows of the embedding / lm_head per rank (the last rank's padded)."""
    return -(-vocab_size // tp_size)


# ---- the sharded layers ------------------------------------------------------------------------
class ShardedAttention(Attention):
    """This rank's heads; the output all-reduced, the residual added by rank 0 alone."""

    def __init__(self, local: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__(local, layer_id)
        self.tp = tp

    def forward(self, x, positions, ctx: ForwardContext, *, norm=None, residual=None, qkv=None):
        own = residual if self.tp.rank == 0 else None
        out = super().forward(x, positions, ctx, norm=norm, residual=own, qkv=qkv)
        return self.tp.all_reduce(out)


class ShardedMLP(MLP):
    """This rank's columns of gate / up and rows of down; reduced like attention."""

    def __init__(self, local: ModelConfig, tp: TensorParallel):
        super().__init__(local)
        self.tp = tp

    def forward(
        self,
        x: torch.Tensor,
        kernels: Kernels = REFERENCE,
        *,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor:
        own = residual if self.tp.rank == 0 else None
        out = super().forward(x, kernels, norm=norm, residual=own, accumulate=accumulate)
        return self.tp.all_reduce(out)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.rows = vocab_rows(vocab_size, tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill(outside[..., None], 0))


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` whose layers hold one rank's shard. `config` stays the whole
    model's; build it on the meta device (the replaced whole-size modules cost nothing)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__(cfg)
        check_shardable(cfg, tp.size)
        local = local_config(cfg, tp.size)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = ShardedAttention(local, i, tp)
            layer.mlp = ShardedMLP(local, tp)
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        if self.lm_head is not None:
            rows = vocab_rows(cfg.vocab_size, tp.size)
            self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        self.tp = tp

    def compute_logits(
        self, hidden: torch.Tensor, kernels: Kernels = REFERENCE, upcast: bool = True
    ) -> torch.Tensor:
        logits = self.tp.all_gather(super().compute_logits(hidden, kernels, upcast))
        vocab = self.config.vocab_size
        return logits if logits.shape[-1] == vocab else logits[..., :vocab].contiguous()


class ReplicatedVocab:
    """What a replicated draft head reads of a sharded target (the interface of
    `LlamaForCausalLM` that speculative/eagle_checkpoint.py uses): the whole embedding and
    lm_head, gathered from the shards on first use (every rank builds its draft at the same
    point, so the gathers pair up). An extra vocabulary-sized copy per rank: the price of a
    draft that runs without collectives."""

    def __init__(self, target: ShardedLlamaForCausalLM):
        self.config = target.config
        self._target = target

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        return self._target.tp.all_gather(shard, dim=0)[: self.config.vocab_size].contiguous()

    @functools.cached_property
    def model(self) -> types.SimpleNamespace:
        weight = self._gather(self._target.model.embed_tokens.weight)
        embed = nn.Embedding(*weight.shape, _weight=weight).requires_grad_(False)
        return types.SimpleNamespace(embed_tokens=embed)

    @functools.cached_property
    def lm_head_weight(self) -> torch.Tensor:
        if self._target.lm_head is None:
            return self.model.embed_tokens.weight
        return self._gather(self._target.lm_head.weight)


def draft_target(loaded):
    """The LoadedModel a draft is built against: a sharded target's whole-vocabulary view."""
    if isinstance(loaded.model, ShardedLlamaForCausalLM):
        return replace(loaded, model=ReplicatedVocab(loaded.model))
    return loaded


# ---- which slice of each checkpoint tensor a rank loads --------------------------------------------
class CheckpointShard:
    """Slices of Hugging Face-named tensors for one rank; tensors not named here (norms,
    rotary) are replicated whole."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        self.cfg = cfg
        rank, size = tp.rank, tp.size
        hd = cfg.head_dim
        q = cfg.num_heads // size * hd
        kv_n = local_kv_heads(cfg, size)
        kv_first = rank * cfg.num_kv_heads // size if cfg.num_kv_heads < size else rank * kv_n
        inter = cfg.intermediate_size // size
        rows = vocab_rows(cfg.vocab_size, size)
        vocab = (0, rank * rows, min(cfg.vocab_size, (rank + 1) * rows), rows)
        # module name -> (dim, start, stop, length after zero padding)
        self._ranges = {
            "q_proj": (0, rank * q, (rank + 1) * q, q),
            "k_proj": (0, kv_first * hd, (kv_first + kv_n) * hd, kv_n * hd),
            "v_proj": (0, kv_first * hd, (kv_first + kv_n) * hd, kv_n * hd),
            "gate_proj": (0, rank * inter, (rank + 1) * inter, inter),
            "up_proj": (0, rank * inter, (rank + 1) * inter, inter),
            "o_proj": (1, rank * q, (rank + 1) * q, q),
            "down_proj": (1, rank * inter, (rank + 1) * inter, inter),
            "embed_tokens": vocab,
            "lm_head": vocab,
        }
        # the whole tensor's length along the sliced dim: a slice of a wrong-sized tensor
        # would otherwise fit this rank's shard
        whole_q, whole_kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self._whole = {"q_proj": whole_q, "k_proj": whole_kv, "v_proj": whole_kv}
        self._whole.update(o_proj=whole_q, embed_tokens=cfg.vocab_size, lm_head=cfg.vocab_size)
        self._whole.update(gate_proj=cfg.intermediate_size, up_proj=cfg.intermediate_size)
        self._whole.update(down_proj=cfg.intermediate_size)

    def _range(self, name: str) -> tuple[int, int, int, int] | None:
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        r = self._ranges.get(module)
        if r is not None and r[0] == 1 and parts[-1] == "bias":
            raise ValueError(f"{name}: a bias on a row-parallel projection is not supported")
        return r

    def part(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's slice of tensor `name`; None: the whole."""
        r = self._range(name)
        return None if r is None else r[:3]

    def pad(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """The slice padded with zeros to the shard's length (the last vocabulary shard)."""
        r = self._range(name)
        return part if r is None else _pad(part, r[0], r[3])

    def read(self, name: str, lazy) -> torch.Tensor:
        """This rank's part of a safetensors tensor, reading only that part (`lazy`: the
        object of `safe_open(...).get_slice(name)`)."""
        r = self.part(name)
        if r is None:
            return lazy[:]
        dim, start, stop = r
        shape = tuple(lazy.get_shape() if hasattr(lazy, "get_shape") else lazy.shape)
        whole = self._whole[name.split(".")[-2]]
        if len(shape) <= dim or shape[dim] != whole:
            raise ValueError(
                f"{name}: checkpoint shape {shape}, but the model needs {whole} along dim {dim}"
            )
        return self.pad(name, lazy[start:stop] if dim == 0 else lazy[:, start:stop])

    def random_weights(self, seed: int, device: torch.device):
        """This rank's slices of the random weights an unsharded model of the same seed gets
        (`random_init_`), Hugging Face-named: tp_size does not change a dummy model. Each
        whole tensor is drawn in turn (the draws' order and shapes decide the values)."""
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        with torch.device("meta"):
            whole = LlamaForCausalLM(cfg)
        for name, t in random_weights(whole, seed, device):
            if ".qkv_proj." in name:
                parts = zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv]))
            elif ".gate_up_proj." in name:
                parts = zip(("gate_proj", "up_proj"), t.chunk(2))
            else:
                yield name, self.read(name, t)
                continue
            fused = name.split(".")[-2]
            for proj, part in parts:
                hf_name = name.replace(f".{fused}.", f".{proj}.")
                yield hf_name, self.read(hf_name, part)


def _pad(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)
