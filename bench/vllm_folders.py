"""Model folders for vLLM, written from specserve's own files. No vLLM import: this runs, and
is tested, on a CPU (tests/test_vllm_peer_prep.py); bench/vllm_peer.py uses it on the GPU.

- `write_hf_folder`: a packaged GGUF (or any llama GGUF) as a Hugging Face Llama folder:
  model.safetensors of the dequantized weights (q/k rows back in rotate-half order, as
  specserve's GGUF reader gives them), config.json, generation_config.json. A tied lm_head is
  left out; vLLM and transformers tie it from the config. No tokenizer: vLLM runs with
  `skip_tokenizer_init=True` on token ids.
- `vllm_draft_folder`: an EAGLE draft folder vLLM loads. vLLM's EAGLE-1 Llama head has no fc
  bias and no input norm on layer 0 (its loader rejects both tensors), so a draft with an fc
  bias gets it folded into layer 0's attention biases (`fold_fc_bias`); others are linked.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specserve.model.gguf_loader import iter_gguf_weights, load_gguf_config, read_gguf
from specserve.model.registry import resolve_packaged
from specserve.speculative.eagle_checkpoint import hf_style_config, read_state_dict

VLLM_ARCHITECTURE = "LlamaForCausalLM"  # vLLM prefixes Eagle / Eagle3 to a draft's itself


def gguf_path(model: str) -> str:
    """A packaged model's GGUF file (smollm2-135m), or `model` itself if it is a .gguf file."""
    path = resolve_packaged(model)
    if path is not None:
        return path
    if os.path.isfile(model) and model.endswith(".gguf"):
        return model
    raise FileNotFoundError(f"{model!r} is neither a packaged model name nor a .gguf file")


def _fresh(folder: str, name: str) -> str:
    """The path of `name` in `folder`, with whatever an earlier run left there removed (a link
    to a source draft must not be written through)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    if os.path.lexists(path):
        os.remove(path)
    return path


def write_json(folder: str, name: str, data: dict) -> None:
    with open(_fresh(folder, name), "w") as f:
        json.dump(data, f, indent=2)


def write_hf_folder(model: str, dst: str, dtype: torch.dtype = torch.float32) -> str:
    """The GGUF of `model` as an HF Llama folder in `dst`. float32 keeps the dequantized
    weights exact, so vLLM's cast to bfloat16 rounds them as specserve's does."""
    path = gguf_path(model)
    gf = read_gguf(path)
    cfg = load_gguf_config(path, gf)
    if cfg.architecture != "llama":
        raise ValueError(f"{path}: a {cfg.architecture} GGUF; only llama is written as Llama")
    state = {
        name: t.to(dtype).contiguous()
        for name, t in iter_gguf_weights(path, cfg, gf)
        if not (cfg.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(state, _fresh(dst, "model.safetensors"), metadata={"format": "pt"})
    eos = list(cfg.eos_token_ids)
    tokens = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    config = hf_style_config(
        cfg,
        VLLM_ARCHITECTURE,
        tie_word_embeddings=cfg.tie_word_embeddings,
        hidden_act="silu",
        torch_dtype=str(dtype).removeprefix("torch."),
        **tokens,
    )
    write_json(dst, "config.json", config)
    # Without a tokenizer vLLM knows the end-of-sequence id from here alone.
    write_json(dst, "generation_config.json", tokens)
    return dst


def _layer_ids(state: dict[str, torch.Tensor]) -> list[int]:
    return sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})


def fold_fc_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An EAGLE-1 state dict without fc.bias that computes the same, for vLLM's head.

    Layer 0 has no input norm, so its attention reads h = W_fc x + b and adds its output to
    the residual h. With b moved into the layer, q/k/v get bias W_{q,k,v} b (their input is
    h, nothing in between) and o_proj gets bias b (the residual W_fc x lacks it; adding it to
    the attention output restores h + attn). `attention_bias: true` applies to every layer,
    so later layers get zero biases. Products in float64; tensors returned as float32."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    b = state.pop("fc.bias").double()
    state.pop("layers.0.input_layernorm.weight", None)  # unused by EAGLE-1, rejected by vLLM
    out = {k: v.float() for k, v in state.items()}
    for layer in _layer_ids(state):
        attn = f"layers.{layer}.self_attn."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weight = state[attn + proj + ".weight"].double()
            bias = state.get(attn + proj + ".bias")
            bias = bias.double() if bias is not None else weight.new_zeros(weight.shape[0])
            if layer == 0:
                bias = bias + (b if proj == "o_proj" else weight @ b)
            out[attn + proj + ".bias"] = bias.float()
    return out


def _has_tensor(folder: str, name: str) -> bool:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:  # published EAGLE-1 heads may ship pytorch_model.bin
        return name in read_state_dict(folder)
    for f in files:
        with safe_open(f, framework="pt") as st:
            if name in st.keys():
                return True
    return False


def _vllm_draft_config(src: str, **changes) -> dict:
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    return {**cfg, "architectures": [VLLM_ARCHITECTURE], **changes}


def write_vllm_eagle_draft(src: str, dst: str) -> str:
    """A specserve EAGLE-1 draft folder with an fc bias, folded for vLLM into `dst`."""
    folded = fold_fc_bias(read_state_dict(src))
    save_file(folded, _fresh(dst, "model.safetensors"), metadata={"format": "pt"})
    config = _vllm_draft_config(src, attention_bias=True, torch_dtype="float32")
    write_json(dst, "config.json", config)
    return dst


def vllm_draft_folder(src: str, dst: str) -> str:
    """A draft folder vLLM reads: folded (`write_vllm_eagle_draft`) when the draft has an fc
    bias, else the same weights linked under a config whose architecture vLLM reads."""
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ValueError(f"the vLLM draft folder must differ from its source {src}")
    if _has_tensor(src, "fc.bias") or _has_tensor(src, "model.fc.bias"):
        return write_vllm_eagle_draft(src, dst)
    write_json(dst, "config.json", _vllm_draft_config(src))
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            os.symlink(os.path.abspath(os.path.join(src, name)), _fresh(dst, name))
    return dst
