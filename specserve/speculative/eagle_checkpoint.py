"""EAGLE / EAGLE3 draft checkpoints in the layout their authors publish (and SGLang/vLLM read).

A folder with `config.json` (a Llama config: hidden_size, num_hidden_layers, heads,
intermediate_size, vocab_size, rms_norm_eps, rope_theta; EAGLE3 adds `draft_vocab_size` and
optionally `eagle_config.eagle_aux_hidden_state_layer_ids`) and weights in
`model.safetensors` or `pytorch_model.bin`:
- EAGLE:  fc.weight [H, 2H] (+ fc.bias), layers.N.self_attn.{q,k,v,o}_proj.weight,
          layers.N.mlp.{gate,up,down}_proj.weight, layers.N.{input,post_attention}_layernorm.weight
          (layer 0's input norm is unused); embed_tokens/lm_head come from the target.
- EAGLE3: fc.weight [H, 3H], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
          midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], midlayer.self_attn.o_proj.weight,
          midlayer.mlp.*, norm.weight, lm_head.weight [draft_vocab, H], d2t [draft_vocab] (int64
          offsets: target id = draft id + d2t[draft id]), t2d [vocab] (bool, unused here).
See docs/EAGLE_FORMAT.md.
"""

from __future__ import annotations

import glob
import json
import os
import pickle

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specserve.model.config import ModelConfig, check_positive_int
from specserve.model.hf_loader import read_json_object
from specserve.model.weights import load_hf_named_weights
from specserve.sampling_params import is_int
from specserve.speculative.draft_heads import Eagle3Head, EagleHead

_IGNORED = ("embed_tokens.weight", "t2d", "layers.0.input_layernorm.weight")


def read_state_dict(folder: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            try:
                state.update(load_file(f))
            except SafetensorError as e:
                raise ValueError(f"{f} is not a readable safetensors file ({e})") from e
        return state
    bins = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
    if not bins:
        raise FileNotFoundError(f"{folder} has neither *.safetensors nor pytorch_model*.bin")
    for f in bins:
        try:
            loaded = torch.load(f, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
            # (RuntimeError: torch's zip reader on a truncated or foreign file)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{f} is not a readable PyTorch checkpoint ({first})") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"{f} must hold a state dict, got {type(loaded).__name__}")
        state.update(loaded)
    return state


def _strip(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def read_draft_config(folder: str) -> tuple[dict, ModelConfig]:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"draft checkpoint {folder} has no config.json")
    raw = read_json_object(path)
    return raw, ModelConfig.from_hf_dict(raw)


def draft_algorithm(path: str) -> str:
    """The speculative algorithm a draft checkpoint is for: 'EAGLE3' (an Eagle3 architecture
    or a draft vocabulary in config.json, or fc [H, 3H]), 'EAGLE' (fc [H, 2H]: published EAGLE-1
    heads often name a plain Llama architecture) or 'STANDALONE' (anything else: a whole model,
    a GGUF file, a preset name)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "STANDALONE"
    raw, cfg = read_draft_config(path)
    archs = " ".join(raw.get("architectures") or []).lower()
    if "eagle3" in archs or "draft_vocab_size" in raw:
        return "EAGLE3"
    fc = _tensor_shape(path, ("fc.weight", "model.fc.weight"))
    if fc is not None and len(fc) == 2:
        return "EAGLE3" if fc[1] == 3 * cfg.hidden_size else "EAGLE"
    return "EAGLE" if "eagle" in archs else "STANDALONE"


def _tensor_shape(folder: str, names: tuple[str, ...]) -> list[int] | None:
    """Shape of the first of `names` in the folder's weights: safetensors headers only, or
    (published EAGLE-1 heads ship pytorch_model.bin) the loaded state dict."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in names:
                if name in st.keys():
                    return list(st.get_slice(name).get_shape())
    if files:
        return None
    try:
        state = read_state_dict(folder)
    except FileNotFoundError:
        return None
    return next((list(state[n].shape) for n in names if n in state), None)


def eagle3_capture_layers(raw: dict, target_layers: int) -> list[int]:
    """Target layers whose input residual stream EAGLE3 reads, ascending (the order of the
    feature's three H-wide parts; a layer may repeat on a small target). The config's ids, or
    SGLang's default [2, L/2, L-3]."""
    eagle_config = raw.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise ValueError(f"eagle_config must be an object (or null), got {eagle_config!r}")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids and (not isinstance(ids, list) or not all(is_int(i) for i in ids)):
        raise ValueError(
            f"eagle_config.eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {ids!r}"
        )
    if ids:
        layers = [i + 1 for i in ids]  # published ids name the layer whose *output* is taken
        if len(layers) != 3 or not all(0 <= i < target_layers for i in layers):
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids must name three layers in [-1, "
                f"{target_layers - 1}) (-1: the embedding output); got {list(ids)}"
            )
    else:  # a target under 7 layers repeats layers rather than read past its ends
        last = target_layers - 1
        layers = [min(2, last), target_layers // 2, max(target_layers - 3, 0)]
    return sorted(layers)


def check_hidden_size(draft: int, target: int) -> None:
    """A head reads the target's hidden states: its width must be the target's."""
    if draft != target:
        raise ValueError(f"draft hidden_size {draft} != target hidden_size {target}")


def load_eagle_head(folder: str, algorithm: str, target) -> tuple[torch.nn.Module, dict]:
    raw, cfg = read_draft_config(folder)
    state = {_strip(k): v for k, v in read_state_dict(folder).items()}
    t2d = state.get("t2d")  # (unused, but sized by the vocabulary the draft was made for)
    if t2d is not None and tuple(t2d.shape) != (target.config.vocab_size,):
        raise ValueError(
            f"t2d has shape {tuple(t2d.shape)}, expected ({target.config.vocab_size},) "
            "(the target's vocabulary)"
        )
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED) or k == "lm_head.weight"}
    check_hidden_size(cfg.hidden_size, target.config.hidden_size)
    # a head reads the target's embedding (and an EAGLE head its lm_head): its vocabulary is
    # the target's, else it was trained for another model
    if "vocab_size" in raw and cfg.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft vocab_size {cfg.vocab_size} != target vocab_size {target.config.vocab_size}"
        )
    if algorithm == "EAGLE":
        if "fc.weight" not in state or state["fc.weight"].shape[1] != 2 * cfg.hidden_size:
            raise ValueError(f"{folder} is not an EAGLE checkpoint (fc.weight must be [H, 2H])")
        head = EagleHead(
            cfg, target.model.embed_tokens, target.lm_head_weight, fc_bias="fc.bias" in state
        )
        load_hf_named_weights(head, state.items())
    else:
        if "fc.weight" not in state or state["fc.weight"].shape[1] != 3 * cfg.hidden_size:
            raise ValueError(f"{folder} is not an EAGLE3 checkpoint (fc.weight must be [H, 3H])")
        if "lm_head.weight" not in state:
            raise ValueError(f"{folder}: the EAGLE3 checkpoint lacks lm_head.weight")
        if cfg.num_layers != 1:  # (SGLang refuses these too)
            raise ValueError(
                f"an EAGLE3 draft has one decoder layer (num_hidden_layers 1), got {cfg.num_layers}"
            )
        draft_vocab = raw.get("draft_vocab_size")
        if draft_vocab is None:
            draft_vocab = state["lm_head.weight"].shape[0]
        check_positive_int("draft_vocab_size", draft_vocab)
        head = Eagle3Head(cfg, draft_vocab, target.model.embed_tokens)
        d2t = state.pop("d2t", None)
        if d2t is None:
            if draft_vocab != target.config.vocab_size:
                raise ValueError("EAGLE3 checkpoint with a reduced vocabulary lacks d2t")
            d2t = torch.zeros(draft_vocab, dtype=torch.int64)
        renamed = [
            (k[len("midlayer.") :] if k.startswith("midlayer.") else k, v) for k, v in state.items()
        ]
        load_hf_named_weights(head, renamed)
        _check_draft_vocab(d2t, draft_vocab, target.config.vocab_size)
        head.d2t.copy_(d2t.to(torch.int64))
    return head, raw


def _check_draft_vocab(d2t: torch.Tensor, draft_vocab: int, target_vocab: int) -> None:
    """Draft token i is target token i + d2t[i]: every one must be a target token."""
    if draft_vocab > target_vocab:
        raise ValueError(
            f"EAGLE3 draft vocabulary {draft_vocab} exceeds the target's {target_vocab}"
        )
    if d2t.shape != (draft_vocab,):
        raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must hold integer offsets, got {d2t.dtype}")
    target_ids = torch.arange(draft_vocab) + d2t.to(torch.int64).cpu()
    if bool(((target_ids < 0) | (target_ids >= target_vocab)).any()):
        raise ValueError(
            f"d2t maps draft tokens outside the target's vocabulary [0, {target_vocab})"
        )
    # sibling draft tokens must differ, or verification would accept two children at once
    if torch.unique(target_ids).numel() != draft_vocab:
        raise ValueError("d2t maps two draft tokens to the same target token")


def save_eagle_checkpoint(
    folder: str, head: torch.nn.Module, base_config: dict, extra_config: dict | None = None
) -> None:
    """Write a head in the published layout (the inverse of load_eagle_head)."""
    os.makedirs(folder, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for name, t in head.state_dict().items():
        if name.startswith("_"):
            continue
        for fused, parts in (
            ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("gate_up_proj", ("gate_proj", "up_proj")),
        ):
            if f".{fused}." in f".{name}":
                sizes = _split_sizes(head, fused, t)
                for part, chunk in zip(parts, t.split(sizes, dim=0)):
                    state[_publish_name(head, name.replace(fused, part))] = chunk.contiguous()
                break
        else:
            if name.endswith("rotary.inv_freq"):
                continue
            state[_publish_name(head, name)] = t.contiguous()
    state = {k: v.detach().cpu() for k, v in state.items()}
    save_file(state, os.path.join(folder, "model.safetensors"))
    cfg = dict(base_config)
    cfg.update(extra_config or {})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def _split_sizes(head, fused: str, t: torch.Tensor) -> list[int]:
    cfg = head.config
    if fused == "qkv_proj":
        q = cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        return [q, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def _publish_name(head, name: str) -> str:
    if isinstance(head, Eagle3Head) and name.split(".")[0] in (
        "input_layernorm",
        "hidden_norm",
        "self_attn",
        "post_attention_layernorm",
        "mlp",
    ):
        return "midlayer." + name
    return name


def hf_style_config(cfg: ModelConfig, architecture: str, **extra) -> dict:
    """A Llama config.json for a draft head of shape `cfg`."""
    out = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
    }
    rs = cfg.rope_scaling
    if rs is not None:  # the head rotates like its target; llama3 scaling, or GGUF's factors
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
        if rs.freq_factors is not None:
            out["rope_scaling"]["freq_factors"] = list(rs.freq_factors)
        if rs.attention_factor != 1.0:  # (YaRN's, read back beside freq_factors)
            out["rope_scaling"]["attention_factor"] = rs.attention_factor
    out.update(extra)
    return out


def write_random_eagle_checkpoint(
    folder: str,
    target_config: ModelConfig,
    algorithm: str = "EAGLE",
    draft_vocab_size: int | None = None,
    seed: int = 0,
) -> str:
    """A random-weight draft head for `target_config`, in the published layout (benchmarks and
    tests; a trained head is written the same way)."""
    from specserve.model.loader import random_init_

    # Published heads are plain Llama layers whatever the target (no qkv bias, no q/k norm).
    cfg = target_config.with_changes(
        num_layers=1, tie_word_embeddings=False, attention_bias=False, qk_norm=False
    )
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    if algorithm == "EAGLE":
        head = EagleHead(cfg, embed, embed.weight)
        extra = {}
    elif algorithm == "EAGLE3":
        dv = draft_vocab_size or cfg.vocab_size
        head = Eagle3Head(cfg, dv, embed)
        g = torch.Generator().manual_seed(seed)
        # a reduced vocabulary keeps a sorted random subset of target ids
        keep = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[:dv]).values
        head.d2t.copy_(keep - torch.arange(dv))
        extra = {"draft_vocab_size": dv}
    else:
        raise ValueError(f"algorithm must be EAGLE or EAGLE3, got {algorithm!r}")
    random_init_(head, seed)
    arch = "LlamaForCausalLMEagle3" if algorithm == "EAGLE3" else "LlamaForCausalLMEagle"
    save_eagle_checkpoint(folder, head, hf_style_config(cfg, arch, **extra))
    return folder
