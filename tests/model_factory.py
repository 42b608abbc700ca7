"""Tiny random-weight models written to disk in real formats, for tests.

    folder = write_hf_model(tmp_path / "m", arch="qwen2", with_tokenizer=True)
    gguf_path, state = write_gguf_model(tmp_path / "m.gguf", folder, qtype="Q8_0")
    hf = load_hf_model(folder, state)          # transformers model holding the dequantized weights

- `write_hf_model`: a Hugging Face folder (config.json + safetensors, optionally sharded, and
  optionally a small working tokenizer with a ChatML template) saved by transformers itself.
- `write_gguf_model`: the same weights as a GGUF file in llama.cpp's layout (tensor names,
  metadata keys, q/k row permutation for llama, quantization by `gguf.quants`). Returns the
  float32 state dict of the *dequantized* weights under Hugging Face names.
- `load_hf_model`: the transformers model of a folder, optionally with other weights.
- `hf_greedy`: transformers' `generate(do_sample=False)` continuation that never stops at EOS.

Weights are drawn with a fixed seed and a large enough spread (std 0.08) that logits are not
near-tied; norm weights and biases are randomized too, so a loader that drops them fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHS = ("llama", "qwen2", "qwen3")
GGUF_QTYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K")
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 1, 2, 3, 4
_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "the quick brown fox jumps over the lazy dog. hello world! a tiny model for tests, "
    "speculative decoding with a paged kv cache and continuous batching. 0123456789 "
    "What is the capital of France? Paris is the capital of France."
)


def _hf_config(
    arch: str,
    *,
    tie_word_embeddings: bool,
    rope_scaling_llama3: bool,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None,
    intermediate_size: int,
    rope_theta: float,
    max_position_embeddings: int,
):
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {ARCHS}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling_llama3:
        # original_max_position_embeddings small enough that, at head_dim 16, some frequencies
        # are kept, some divided by `factor` and some blended: every branch of llama3 runs.
        rope = {
            "rope_type": "llama3",
            "rope_theta": rope_theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.08,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        architectures=[cls.__name__.replace("Config", "ForCausalLM")],
    )


def _randomize_small_params_(model: torch.nn.Module, seed: int) -> None:
    """HF initializes norms to 1 and biases to 0: perturb them so that they matter."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 1:
                continue
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)


def write_hf_model(
    folder: str | os.PathLike,
    arch: str = "llama",
    tie_word_embeddings: bool = False,
    rope_scaling_llama3: bool = False,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    seed: int = 0,
    with_tokenizer: bool = False,
    sharded: bool = False,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
) -> str:
    """Save a random `{Llama,Qwen2,Qwen3}ForCausalLM` with transformers; return the folder.

    arch: "llama" | "qwen2" (q/k/v bias) | "qwen3" (q/k RMSNorm). sharded: several
    safetensors files plus model.safetensors.index.json. with_tokenizer: a working
    tokenizer (see `write_tokenizer`). bos=1, eos=2 in config.json.
    """
    import transformers

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    cfg = _hf_config(
        arch,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling_llama3=rope_scaling_llama3,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
    )
    cls = getattr(transformers, cfg.architectures[0])
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    _randomize_small_params_(model, seed)
    kwargs: dict[str, Any] = {}
    if sharded:
        total = sum(p.numel() * 4 for p in model.parameters())
        kwargs["max_shard_size"] = max(total // 3, 1)
    model.save_pretrained(folder, **kwargs)
    if with_tokenizer:
        write_tokenizer(folder, vocab_size)
    return folder


def build_tokenizer(vocab_size: int):
    """A working `PreTrainedTokenizerFast` with exactly `vocab_size` ids at most.

    Special tokens: 0 <unk>, 1 <s> (bos, prepended by encode), 2 </s> (eos), 3 <|im_start|>,
    4 <|im_end|>; ChatML chat template. vocab_size >= 261: byte-level BPE trained on a small
    corpus (any text round-trips). Smaller: one token per printable ASCII character (others
    map to <unk>).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size >= len(_SPECIALS) + len(alphabet):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(_SPECIALS),
            initial_alphabet=alphabet,
            show_progress=False,
        )
        tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    else:
        chars = [chr(c) for c in range(32, 127)] + ["\n"]
        chars = chars[: max(0, vocab_size - len(_SPECIALS))]
        vocab = {t: i for i, t in enumerate(_SPECIALS + chars)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(_SPECIALS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    assert tok.get_vocab_size() <= vocab_size, (tok.get_vocab_size(), vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def write_tokenizer(folder: str | os.PathLike, vocab_size: int) -> str:
    """Save `build_tokenizer(vocab_size)` (tokenizer.json + tokenizer_config.json) into folder."""
    build_tokenizer(vocab_size).save_pretrained(str(folder))
    return str(folder)


# ---- loading back with transformers -------------------------------------------------------------
def load_hf_model(folder: str | os.PathLike, state: dict[str, torch.Tensor] | None = None):
    """The transformers model of `folder` in float32 eval mode; `state` replaces its weights
    (e.g. the dequantized weights returned by `write_gguf_model`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if state is not None:
        own = model.state_dict()
        missing = [k for k in own if k not in state and k != "lm_head.weight"]
        if missing:
            raise KeyError(f"state lacks {missing[:4]}")
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v)
            if model.config.tie_word_embeddings:
                model.lm_head.weight = model.model.embed_tokens.weight
    return model


@torch.no_grad()
def hf_logits(model, input_ids: list[int]) -> torch.Tensor:
    """[len(input_ids), vocab] float32 logits of one causal forward in transformers."""
    return model(torch.tensor([input_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate(do_sample=False), exactly max_new_tokens (EOS does not stop it)."""
    gen_cfg = model.generation_config
    saved = gen_cfg.eos_token_id
    gen_cfg.eos_token_id = None
    try:
        out = model.generate(
            torch.tensor([input_ids]),
            attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    finally:
        gen_cfg.eos_token_id = saved
    return out[0, len(input_ids) :].tolist()


def random_prompt(n: int, vocab_size: int, seed: int = 0, low: int = 5) -> list[int]:
    """n token ids in [low, vocab_size), avoiding the special ids below `low`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab_size, (n,), generator=g).tolist()


# ---- GGUF ----------------------------------------------------------------------------------------
def _read_state(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors")
    for f in files:
        state.update(load_file(str(f)))
    return {k: v.float() for k, v in state.items()}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row permutation (rotate-half -> interleaved pairs)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        rest = ".".join(parts[3:])
        if rest in _GGUF_LAYER:
            return f"blk.{parts[2]}.{_GGUF_LAYER[rest]}"
    raise KeyError(f"no GGUF name for {hf_name!r}")


def _llama3_rope_factors(rope: dict, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for rope_type llama3 (what convert_hf_to_gguf writes)."""
    import math

    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks (uint8 [rows, cols // 256 * 210]) in ggml's layout; `gguf.quants` can
    only dequantize Q6_K. A plain absmax quantizer (llama.cpp searches scales a little harder;
    any valid encoding serves a loader test). Per 256-value super-block: ql (low 4 bits),
    qh (high 2 bits), 16 int8 sub-block scales, f16 super-scale d; value = d * sc * (q - 32)."""
    rows, cols = x.shape
    if cols % 256:
        raise ValueError(f"Q6_K needs rows of a multiple of 256 values, got {cols}")
    blocks = x.astype(np.float32).reshape(-1, 16, 16)  # [n, sub-block, value]
    n = blocks.shape[0]
    sub = np.abs(blocks).max(axis=-1) / 31.0  # [n, 16] wanted sub-block scales
    d = (sub.max(axis=-1, keepdims=True) / 127.0).astype(np.float16)  # [n, 1]
    d32 = d.astype(np.float32)
    sc = np.where(d32 > 0, np.round(sub / np.where(d32 > 0, d32, 1.0)), 0).clip(-128, 127)
    step = (d32 * sc)[..., None]  # [n, 16, 1]
    q = np.where(step > 0, np.round(blocks / np.where(step > 0, step, 1.0)), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    lo, hi = q & 0x0F, q >> 4
    ql = (lo[:, :, :64] | (lo[:, :, 64:] << 4)).reshape(n, 128)
    hi = hi.reshape(n, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    scales = sc.astype(np.int8).view(np.uint8)
    out = np.concatenate([ql, qh, scales, d.view(np.uint8)], axis=1)  # [n, 210]
    return out.reshape(rows, cols // 256 * 210)


def _gguf_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges) of `build_tokenizer(vocab_size)` as llama.cpp's "gpt2"
    tokenizer fields; unused ids are padded with placeholder tokens. Below 261 ids there is
    no byte-level vocabulary: placeholders only, no merges (token ids only)."""
    if vocab_size < len(_SPECIALS) + 256:
        return list(_SPECIALS) + [f"<t{i}>" for i in range(len(_SPECIALS), vocab_size)], []
    backend = build_tokenizer(vocab_size).backend_tokenizer
    model = json.loads(backend.to_str())["model"]
    by_id = {i: t for t, i in model["vocab"].items()}
    tokens = [by_id.get(i, f"<extra_{i}>") for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_gguf_model(
    path: str | os.PathLike,
    hf_folder_or_state: str | os.PathLike | dict[str, torch.Tensor],
    qtype: str = "F32",
    config: dict | None = None,
    arch: str | None = None,
    permute: bool = True,
    with_tokenizer: bool = True,
    chat_template: str | None = CHAT_TEMPLATE,
    name: str = "tiny-test-model",
    eot_token_id: int | None = None,
) -> tuple[str, dict[str, torch.Tensor]]:
    """Write a GGUF file the way llama.cpp's convert_hf_to_gguf lays it out.

    hf_folder_or_state: a folder from `write_hf_model` (config.json + safetensors), or a state
    dict of Hugging Face-named tensors together with `config` (a config.json dict).
    qtype: "F32" | "F16" | "Q8_0" | "Q4_0" | "Q4_1" | "Q6_K" for the 2-D weights (norms and
    biases stay F32, as llama.cpp does). Row lengths must be multiples of the block size
    (32; 256 for Q6_K), else ValueError.
    arch: GGUF architecture (default: the config's model_type: llama, qwen2, qwen3). llama's
    q/k rows are permuted like llama.cpp does (`permute=False` writes them unpermuted, for
    tests that must see the difference). llama3 rope scaling becomes a `rope_freqs` tensor.
    with_tokenizer: tokenizer.ggml.* fields of `build_tokenizer(vocab_size)` as a llama.cpp
    "gpt2" (byte-level BPE) tokenizer, plus `chat_template`; a working text tokenizer when
    vocab_size >= 261, placeholder tokens (ids only) below that. eot_token_id: an end-of-turn
    token (tokenizer.ggml.eot_token_id, as chat models' conversions write).

    Returns (path, state): state is the float32 dequantized weights under Hugging Face names
    (q/k un-permuted, i.e. what a correct loader must produce), for `load_hf_model(folder, state)`.
    """
    import gguf
    from gguf.quants import dequantize, quantize

    path = str(path)
    if isinstance(hf_folder_or_state, dict):
        if config is None:
            raise ValueError("a state dict needs `config` (a config.json dictionary)")
        state = {k: v.float() for k, v in hf_folder_or_state.items()}
    else:
        folder = str(hf_folder_or_state)
        if config is None:
            with open(os.path.join(folder, "config.json")) as f:
                config = json.load(f)
        state = _read_state(folder)
    if qtype not in GGUF_QTYPES:
        raise ValueError(f"qtype {qtype!r} is not one of {GGUF_QTYPES}")
    q = gguf.GGMLQuantizationType[qtype]
    arch = arch or config.get("model_type", "llama")
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_head)
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // n_head
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))

    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    w.add_rope_dimension_count(head_dim)
    if head_dim != hidden // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(
        {
            "F32": gguf.LlamaFileType.ALL_F32,
            "F16": gguf.LlamaFileType.MOSTLY_F16,
            "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
            "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
            "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
            "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
        }[qtype]
    )
    if with_tokenizer:
        tokens, merges = _gguf_vocab(config["vocab_size"])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(
            [gguf.TokenType.CONTROL] * len(_SPECIALS)
            + [gguf.TokenType.NORMAL] * (len(tokens) - len(_SPECIALS))
        )
        if merges:
            w.add_token_merges(merges)
        else:
            w.add_token_scores([0.0] * len(tokens))
        w.add_bos_token_id(config.get("bos_token_id", BOS_ID) or BOS_ID)
        eos = config.get("eos_token_id", EOS_ID)
        w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
        if eot_token_id is not None:
            w.add_eot_token_id(eot_token_id)
        w.add_add_bos_token(False)
        if chat_template:
            w.add_chat_template(chat_template)

    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim, theta))

    do_permute = permute and arch == "llama"
    out_state: dict[str, torch.Tensor] = {}
    for hf_name, tensor in state.items():
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        gname = gguf_tensor_name(hf_name)
        arr = tensor.numpy().astype(np.float32)
        heads = None
        if do_permute and gname.endswith(("attn_q.weight", "attn_q.bias")):
            heads = n_head
        elif do_permute and gname.endswith(("attn_k.weight", "attn_k.bias")):
            heads = n_kv
        if heads is not None:
            arr = permute_qk(arr, heads)
        if arr.ndim == 2 and q != gguf.GGMLQuantizationType.F32:
            block = gguf.GGML_QUANT_SIZES[q][0]
            if arr.shape[-1] % block:
                raise ValueError(
                    f"{hf_name}: row length {arr.shape[-1]} is not a multiple of {qtype}'s block "
                    f"size {block}; pick sizes that are"
                )
            data = quantize_q6_k(arr) if qtype == "Q6_K" else quantize(arr, q)
            if q == gguf.GGMLQuantizationType.F16:
                w.add_tensor(gname, data)
            else:
                w.add_tensor(gname, data, raw_dtype=q)
            back = dequantize(data, q).reshape(arr.shape).astype(np.float32)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
            back = arr
        if heads is not None:
            back = _unpermute_qk(back, heads)
        out_state[hf_name] = torch.from_numpy(np.ascontiguousarray(back))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, out_state


# ---- our model, driven directly ---------------------------------------------------------------
class SequenceRunner:
    """Drives a specserve model through `ModelRunner` with the torch attention backend, one
    flat batch per call, over a paged KV cache whose slots are handed out in shuffled order
    (so nothing relies on contiguous slots).

        r = SequenceRunner(load_ours(folder))
        logits = r.extend({"a": prompt[:8]})["a"]        # prefill chunk 1
        logits = r.extend({"a": prompt[8:], "b": [5]})   # chunk 2 of a + prefill of b, one batch

    `extend` appends tokens to each named sequence (causal over its cached prefix) and returns
    float32 logits [n_tokens, vocab] per sequence; `capture_layers` returns aux hidden states.
    """

    def __init__(self, loaded, num_slots: int = 512, seed: int = 0):
        from specserve.kv.pool import KVCache
        from specserve.model.runner import ModelRunner
        from specserve.ops.attention import TorchAttentionBackend

        cfg = loaded.config
        self.model = loaded.model
        dtype = next(self.model.parameters()).dtype
        self.kv = KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
        self.runner = ModelRunner(self.model, self.kv, TorchAttentionBackend())
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_slots, generator=g).tolist()
        self.slots: dict[str, list[int]] = {}

    def extend(
        self, batch: dict[str, list[int]], capture_layers: frozenset[int] = frozenset()
    ) -> dict[str, Any]:
        from specserve.ops.attention_metadata import Segment, build_metadata

        ids, pos, segs, out_loc = [], [], [], []
        for name, toks in batch.items():
            have = self.slots.setdefault(name, [])
            new = [self.free.pop() for _ in toks]
            pos += list(range(len(have), len(have) + len(toks)))
            have += new
            ids += list(toks)
            out_loc += new
            segs.append(Segment(torch.tensor(have, dtype=torch.int64), len(toks), len(toks)))
        meta = build_metadata(segs, torch.tensor(out_loc, dtype=torch.int64), torch.device("cpu"))
        out = self.runner.forward(
            torch.tensor(ids), torch.tensor(pos), meta, capture_layers=tuple(sorted(capture_layers))
        )
        with torch.inference_mode():
            logits = self.model.compute_logits(out.hidden).float()
        res: dict[str, Any] = {}
        start = 0
        for name, toks in batch.items():
            res[name] = logits[start : start + len(toks)]
            start += len(toks)
        if capture_layers:
            res["_output"] = out
        return res


def load_ours(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """specserve's `load_model` of a folder or .gguf file, on the CPU, token ids only."""
    from specserve.model.loader import load_model

    return load_model(str(path), "auto", dtype, torch.device("cpu"), skip_tokenizer_init=True)
