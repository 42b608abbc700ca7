"""The shape of a Llama-family decoder, independent of where the weights come from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3").

    freq_factors: explicit per-frequency divisors of the inverse frequencies (head_dim // 2
    values), as llama.cpp stores llama3 scaling in GGUF files (`rope_freqs.weight`); when set,
    they are used instead of the parameters above. Linear and YaRN scaling are read into them
    too: both only divide each frequency by its own factor.
    attention_factor: YaRN's scale of cos and sin (of q and k both), 1 otherwise.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def with_changes(self, **kwargs: Any) -> ModelConfig:
        return replace(self, **kwargs)

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (Llama, Qwen2, Qwen3, SmolLM2).
        A setting that would change the maths and that this decoder does not implement is
        refused (ValueError), never ignored."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"architectures must be a list of names, got {archs!r}")
        model_type = cfg.get("model_type", "llama")
        _check_supported(cfg, model_type)
        missing = [k for k in _REQUIRED_HF_KEYS if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        for key in _REQUIRED_HF_KEYS:  # before head_dim divides by one of them
            check_positive_int(key, cfg[key])
        num_heads = cfg["num_attention_heads"]
        # transformers' defaults for keys config.json may omit: per model type where absent
        # (Qwen3: 128-wide heads whatever the hidden size), from the head count where null
        head_dim = cfg.get("head_dim", _DEFAULT_HEAD_DIM.get(model_type))
        head_dim = head_dim or cfg["hidden_size"] // num_heads
        kv_heads = cfg.get("num_key_value_heads", _DEFAULT_KV_HEADS.get(model_type))
        kv_heads = num_heads if kv_heads is None else kv_heads
        positions = cfg.get("max_position_embeddings", _DEFAULT_POSITIONS[model_type])
        eps = cfg.get("rms_norm_eps", 1e-6)
        _check_numbers(cfg, model_type, head_dim, kv_heads, positions, eps)
        scaling, rope_theta = _rope(cfg, head_dim, positions)
        check_positive_number("rope_theta", rope_theta)
        _check_window(cfg, model_type, positions)
        for key in ("tie_word_embeddings", "attention_bias"):
            if key in cfg and not isinstance(cfg[key], bool):
                raise ValueError(f"{key} must be true or false, got {cfg[key]!r}")
        eos_ids = token_ids(cfg, "eos_token_id", vocab_size=cfg["vocab_size"])
        bos_ids = token_ids(cfg, "bos_token_id", allow_list=False)  # (not used to decode)
        return ModelConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2's q/k/v always carry a bias, Mistral's never (transformers ignores the key)
            attention_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=eos_ids,
            architecture=archs[0],
        )


# (a Mistral without a sliding window shorter than its context is a Llama)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_DEFAULT_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
# (Llama's are the head count, and hidden_size // num_attention_heads)
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32}
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def check_positive_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")


def check_positive_number(key: str, value: Any) -> None:
    """A positive, finite number (json reads `Infinity` and `NaN` as floats)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"{key} must be a positive finite number, got {value!r}")


def _rope(cfg: dict[str, Any], head_dim: int, positions: int) -> tuple[RopeScaling | None, Any]:
    """(scaling, rope_theta) of config.json's rope_scaling / rope_parameters, read as
    transformers reads them (the scaling types it implements for these models)."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rs = cfg.get(key)
    rope_theta = cfg.get("rope_theta", 10000.0)
    if rs is None:
        return None, rope_theta
    if not isinstance(rs, dict):
        raise ValueError(f"{key} must be an object (or null), got {rs!r}")
    rope_theta = rs.get("rope_theta", rope_theta)
    check_positive_number("rope_theta", rope_theta)
    kind = rs.get("rope_type") or rs.get("type")
    if kind is None and any(isinstance(v, dict) for v in rs.values()):
        # (per-layer-type parameters: these architectures rotate every layer alike)
        raise ValueError(f"{key} per layer type ({', '.join(rs)}) is not supported")
    if kind in ("llama3", "yarn"):
        # transformers' rule for both: a top-level original_max_position_embeddings (as
        # Phi-3-style configs save it) wins over the nested one; absent, the model's positions
        top_level = cfg.get("original_max_position_embeddings")
        if top_level is not None:
            rs = {**rs, "original_max_position_embeddings": top_level}
        else:
            rs = {"original_max_position_embeddings": positions, **rs}
    scaling = None
    if kind == "llama3":
        absent = [k for k in _LLAMA3_ROPE_KEYS if k not in rs]
        if absent:
            raise ValueError(f"llama3 rope scaling lacks {', '.join(absent)}")
        for k in _LLAMA3_ROPE_KEYS:
            check_positive_number(f"{key}.{k}", rs[k])
        if rs["high_freq_factor"] <= rs["low_freq_factor"]:  # (the blend divides by their gap)
            raise ValueError(
                f"{key}.high_freq_factor ({rs['high_freq_factor']}) must exceed "
                f"low_freq_factor ({rs['low_freq_factor']})"
            )
        scaling = RopeScaling(**{k: rs[k] for k in _LLAMA3_ROPE_KEYS})
    elif kind == "linear":
        factor = rs.get("factor")
        check_positive_number(f"{key}.factor", factor)
        scaling = RopeScaling(factor=factor, freq_factors=(float(factor),) * (head_dim // 2))
    elif kind == "dynamic":
        # Dynamic NTK changes the frequencies only past max_position_embeddings, which no
        # context reaches (capacity.py bounds it there): the default rotation.
        check_positive_number(f"{key}.factor", rs.get("factor"))
    elif kind == "yarn":
        scaling = _yarn(key, rs, head_dim, rope_theta, positions)
    elif kind not in (None, "default"):
        raise ValueError(
            f"rope scaling type {kind!r} is not supported (default, linear, dynamic, yarn, llama3)"
        )
    if rs.get("freq_factors") is not None:  # written by hf_style_config for drafts of GGUF,
        # linear or YaRN targets (YaRN's attention factor beside them)
        base = scaling or RopeScaling()
        attention = rs.get("attention_factor", base.attention_factor)
        check_positive_number(f"{key}.attention_factor", attention)
        scaling = replace(
            base,
            freq_factors=tuple(float(x) for x in rs["freq_factors"]),
            attention_factor=float(attention),
        )
    return scaling, rope_theta


def _yarn(key: str, rs: dict[str, Any], dim: int, base: float, positions: int) -> RopeScaling:
    """YaRN as transformers computes it (`_compute_yarn_parameters`): each frequency blends
    between kept and divided by `factor` along a ramp over the dimensions; cos and sin are
    scaled by the attention factor."""
    orig = rs["original_max_position_embeddings"]
    check_positive_int(f"{key}.original_max_position_embeddings", orig)
    factor = rs.get("factor")
    factor = positions / orig if factor is None else factor
    check_positive_number(f"{key}.factor", factor)
    for k in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if rs.get(k) is not None:
            check_positive_number(f"{key}.{k}", rs[k])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.get("beta_fast") or 32), correction_dim(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    factors = []
    for i in range(dim // 2):
        keep = 1 - min(max((i - low) / (high - low), 0.0), 1.0)  # 1: frequency kept as is
        factors.append(1.0 / ((1 - keep) / factor + keep))
    return RopeScaling(
        factor=factor,
        original_max_position_embeddings=orig,
        freq_factors=tuple(factors),
        attention_factor=float(attention_factor),
    )


def token_ids(
    cfg: dict[str, Any], key: str, allow_list: bool = True, vocab_size: int | None = None
) -> tuple[int, ...]:
    """config.json's id field (one id, a list of them, or null) as a tuple, refused unless
    every one is a token id (below vocab_size where given: an end-of-text id the model can
    never emit would never end a request)."""
    value = cfg.get(key)
    ids = [] if value is None else value if isinstance(value, list) and allow_list else [value]
    limit = math.inf if vocab_size is None else vocab_size
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < limit for i in ids):
        allowed = "a token id, a list of them, or null" if allow_list else "a token id or null"
        within = "" if vocab_size is None else f" (ids in [0, vocab_size = {vocab_size}))"
        raise ValueError(f"{key} must be {allowed}{within}, got {value!r}")
    return tuple(ids)


def _check_numbers(
    cfg: dict[str, Any], model_type: str, head_dim: Any, kv_heads: Any, positions: Any, eps: Any
) -> None:
    sizes = {k: cfg[k] for k in _REQUIRED_HF_KEYS}
    sizes["head_dim"] = head_dim
    sizes["num_key_value_heads"] = kv_heads
    sizes["max_position_embeddings"] = positions
    for key, value in sizes.items():
        check_positive_int(key, value)
    check_positive_number("rope_theta", cfg.get("rope_theta", 10000.0))
    check_positive_number("rms_norm_eps", eps)
    heads = cfg["num_attention_heads"]
    if cfg.get("head_dim"):
        given = "head_dim"
    elif "head_dim" not in cfg and model_type in _DEFAULT_HEAD_DIM:
        given = f"{model_type}'s default"
    else:
        given = "hidden_size // num_attention_heads"
    if "num_key_value_heads" not in cfg and heads % kv_heads:
        raise ValueError(
            f"num_key_value_heads is absent and {model_type}'s default ({kv_heads}) does not "
            f"divide num_attention_heads ({heads}): set num_key_value_heads in config.json"
        )
    check_attention_shape(heads, kv_heads, head_dim, given)


def _check_window(cfg: dict[str, Any], model_type: str, positions: int) -> None:
    """Refuse sliding-window attention where it would change results: a window shorter than
    the context on some layer, as transformers decides which layers slide (Mistral: every
    one; Qwen2/3 with use_sliding_window: layer_types, else those from max_window_layers on).
    Llama has no sliding window (transformers ignores the keys)."""
    if model_type == "llama" or (model_type != "mistral" and not cfg.get("use_sliding_window")):
        return
    window = cfg.get("sliding_window", 4096)  # (transformers' default when the key is absent)
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    if window >= positions:  # (a token sees keys fewer than `window` positions back)
        return
    layers = cfg["num_hidden_layers"]
    if model_type == "mistral":
        sliding = list(range(layers))
    elif isinstance(cfg.get("layer_types"), list):
        sliding = [i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention"]
    elif isinstance(cfg.get("max_window_layers"), int):
        sliding = list(range(cfg["max_window_layers"], layers))
    else:  # (neither key, as transformers always saves them: refused, to be safe)
        sliding = list(range(layers))
    if sliding:
        raise ValueError(
            f"sliding-window attention (sliding_window {window} < max_position_embeddings "
            f"{positions}, on layers {sliding}) is not supported"
        )


def check_attention_shape(heads: int, kv_heads: int, head_dim: int, head_dim_from: str) -> None:
    """Refuse (ValueError) head counts and sizes the attention cannot run (they would fail
    the first request, and with it the engine's step for every request after)."""
    if heads % kv_heads:
        raise ValueError(
            f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads}): "
            "each key/value head serves a whole group of query heads"
        )
    if head_dim % 2:
        raise ValueError(
            f"head_dim must be even (the rotary embedding turns pairs of dimensions), got "
            f"{head_dim} ({head_dim_from})"
        )


def _check_supported(cfg: dict[str, Any], model_type: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (allowed: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(
            f"quantization_config ({method or quantization!r}) is not supported: this engine "
            "loads float32, float16, bfloat16 or float64 weights (or a GGUF file)"
        )
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # (the same function in transformers)
        raise ValueError(f"hidden_act {act!r} is not supported (allowed: silu, swish)")
    if model_type == "llama" and cfg.get("mlp_bias"):  # (the others' MLPs ignore the key)
        raise ValueError("mlp_bias is not supported (the MLP's projections have no bias)")
    if model_type in ("llama", "qwen3") and cfg.get("attention_bias"):
        # these biases o_proj too (Qwen2's attention_bias does not); only q/k/v biases are
        # implemented
        raise ValueError(f"attention_bias is not supported for model_type {model_type!r}")


# Shapes for `load_format="dummy"`: benchmarks without weight files.
PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(),
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
}
