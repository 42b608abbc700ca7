"""GGUF files (llama.cpp): config, weights (dequantized by the `gguf` package), tokenizer.

llama.cpp's converter permutes the rows of q and k weights so that RoPE pairs are
interleaved; our model uses the rotate-half layout, so the permutation is undone here.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from specserve.model.config import ModelConfig, RopeScaling

_SUPPORTED_ARCHS = {"llama", "qwen2", "qwen3"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _reader(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    if len(f.types) and f.types[0].name == "STRING":
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if len(f.types) and f.types[0].name == "ARRAY":
        return [
            f.parts[i].tolist()[0] if len(f.parts[i]) == 1 else bytes(f.parts[i]) for i in f.data
        ]
    return f.parts[f.data[0]].tolist()[0]


def load_gguf_config(path: str) -> ModelConfig:
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported ({sorted(_SUPPORTED_ARCHS)})"
        )
    a = arch
    heads = _field(r, f"{a}.attention.head_count")
    hidden = _field(r, f"{a}.embedding_length")
    head_dim = (
        _field(r, f"{a}.attention.key_length")
        or _field(r, f"{a}.rope.dimension_count")
        or hidden // heads
    )
    names = {t.name for t in r.tensors}
    tokens = r.fields.get("tokenizer.ggml.tokens")
    vocab = _field(r, f"{a}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    scaling = None
    if _field(r, f"{a}.rope.scaling.type") == "llama3" or "rope_freqs.weight" in names:
        scaling = RopeScaling(
            factor=float(_field(r, f"{a}.rope.scaling.factor", 8.0)),
            original_max_position_embeddings=int(
                _field(r, f"{a}.rope.scaling.original_context_length", 8192)
            ),
        )
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_field(r, f"{a}.feed_forward_length"),
        num_layers=_field(r, f"{a}.block_count"),
        num_heads=heads,
        num_kv_heads=_field(r, f"{a}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(r, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=_field(r, f"{a}.context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
        architecture=arch,
    )


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation (rows interleaved per head -> rotate-half)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def iter_gguf_weights(path: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face-named float32 tensors from a GGUF file."""
    from gguf.quants import dequantize

    r = _reader(path)
    permute = cfg.architecture == "llama"
    for t in r.tensors:
        name = t.name
        if name == "rope_freqs.weight":
            continue
        arr = dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; numpy data is already [rows, cols] in C order.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensor = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(shape))
        if name == "token_embd.weight":
            yield "model.embed_tokens.weight", tensor
        elif name == "output_norm.weight":
            yield "model.norm.weight", tensor
        elif name == "output.weight":
            yield "lm_head.weight", tensor
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in _LAYER_NAMES:
                raise KeyError(f"unknown GGUF tensor {name!r}")
            if permute and kind == "attn_q":
                tensor = _unpermute(tensor, cfg.num_heads)
            elif permute and kind == "attn_k":
                tensor = _unpermute(tensor, cfg.num_kv_heads)
            yield f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}", tensor
        else:
            raise KeyError(f"unknown GGUF tensor {name!r}")


def gguf_chat_template(path: str) -> str | None:
    return _field(_reader(path), "tokenizer.chat_template")
