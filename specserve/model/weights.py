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
    parts: dict[str, dict[int, tuple[str, torch.Tensor]]] = {}
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
            parts.setdefault(target_name, {})[shard] = (name, tensor)
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
        _copy(params[name], tensor, name)
        written.add(name)
    for target_name, shards in parts.items():
        if target_name not in params:  # (named as the checkpoint names them, not as fused)
            names = ", ".join(repr(name) for name, _ in shards.values())
            raise KeyError(f"checkpoint tensor {names} has no place in the model")
        _copy_stacked(params[target_name], shards, _piece_shapes(module, target_name))
        written.add(target_name)
    missing = sorted(set(params) - written)
    if missing == ["lm_head.weight"]:
        raise KeyError(
            "checkpoint lacks lm_head.weight, which tie_word_embeddings false (config.json) "
            "needs: set it to true if the output layer is the embedding"
        )
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


def _piece_shapes(module: nn.Module, target_name: str) -> list[tuple[str, int, str]]:
    """(Hugging Face name, rows, why) of each piece of a fused parameter, from the module
    that owns it (under tensor parallelism, this rank's share)."""
    head, _, suffix = target_name.rpartition(".")  # e.g. model.layers.0.self_attn.qkv_proj
    owner_name, _, fused = head.rpartition(".")
    owner = module.get_submodule(owner_name)
    if fused == "qkv_proj":
        heads, kv_heads, hd = owner.num_heads, owner.num_kv_heads, owner.head_dim
        kv = kv_heads * hd, f"num_key_value_heads * head_dim = {kv_heads} * {hd}"
        rows = [(heads * hd, f"num_attention_heads * head_dim = {heads} * {hd}"), kv, kv]
    else:
        rows = [(owner.intermediate, f"intermediate_size = {owner.intermediate}")] * 2
    pieces = sorted((p for p, (t, _) in _FUSED.items() if t == fused), key=lambda p: _FUSED[p])
    prefix = f"{owner_name}." if owner_name else ""
    return [(f"{prefix}{p}.{suffix}", n, why) for p, (n, why) in zip(pieces, rows)]


def _copy_stacked(
    param: torch.Tensor, shards: dict[int, tuple[str, torch.Tensor]], pieces: list
) -> None:
    """Copy the pieces (q, k, v or gate, up) stacked along dim 0 into `param`. Each piece is
    checked against its own shape: pieces of wrong sizes can add up to the fused size."""
    for i, (hf_name, rows, why) in enumerate(pieces):
        if i not in shards:
            raise KeyError(f"checkpoint lacks {hf_name!r}")
        name, tensor = shards[i]
        _check_dtype(name, tensor)
        expected = (rows, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {expected} "
                f"(rows: {why})"
            )
    offset = 0
    with torch.no_grad():
        for i in range(len(pieces)):
            s = shards[i][1]
            param[offset : offset + s.shape[0]].copy_(s.to(param.dtype))
            offset += s.shape[0]


# Weight types a checkpoint's tensors may have: the floats it is computed in, converted on
# load. Others are quantized (integers, float8) and would be cast, not dequantized: garbage.
LOADABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in LOADABLE_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in LOADABLE_DTYPES)
        raise ValueError(
            f"{name}: checkpoint dtype {str(tensor.dtype).removeprefix('torch.')} is not a "
            f"weight type this engine loads ({allowed}); quantized checkpoints are not "
            "supported (a GGUF file is)"
        )


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    _check_dtype(name, tensor)
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
