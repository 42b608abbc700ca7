"""Loading Hugging Face-named tensors into a model whose q/k/v and gate/up are fused."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

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
    tied_copy = None
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and "lm_head.weight" not in params:
            tied_copy = tensor  # tied embeddings: some checkpoints still carry a copy
            continue
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
    embed = params.get("model.embed_tokens.weight")
    if tied_copy is not None and embed is not None:
        _check_tied_copy(embed, tied_copy)


def _check_tied_copy(embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    """A tied model computes its logits with the embedding; a checkpoint whose lm_head differs
    from it was trained untied, and running it tied would give other logits."""
    same = tuple(lm_head.shape) == tuple(embed.shape) and torch.equal(
        lm_head.to(device=embed.device, dtype=embed.dtype), embed
    )
    if not same:
        raise ValueError(
            "tie_word_embeddings is true but the checkpoint's lm_head.weight differs from "
            "model.embed_tokens.weight: set tie_word_embeddings to false in config.json to use "
            "that lm_head, or drop the tensor"
        )


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
