"""The shape of a Llama-family decoder, independent of where the weights come from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3").

    freq_factors: explicit per-frequency divisors of the inverse frequencies (head_dim // 2
    values), as llama.cpp stores llama3 scaling in GGUF files (`rope_freqs.weight`); when set,
    they are used instead of the parameters above.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None


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
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        kv_heads = cfg.get("num_key_value_heads")
        kv_heads = num_heads if kv_heads is None else kv_heads  # null: absent (transformers)
        scaling, rope_theta = _rope(cfg)
        _check_numbers(cfg, head_dim, rope_theta)
        _check_window(cfg, model_type)
        for key in ("tie_word_embeddings", "attention_bias"):
            if key in cfg and not isinstance(cfg[key], bool):
                raise ValueError(f"{key} must be true or false, got {cfg[key]!r}")
        eos_ids = token_ids(cfg, "eos_token_id")
        bos_ids = token_ids(cfg, "bos_token_id", allow_list=False)
        return ModelConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=eos_ids,
            architecture=archs[0],
        )


# (a Mistral without a sliding window shorter than its context is a Llama)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")


def _rope(cfg: dict[str, Any]) -> tuple[RopeScaling | None, Any]:
    """(scaling, rope_theta) of config.json's rope_scaling / rope_parameters."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rs = cfg.get(key)
    rope_theta = cfg.get("rope_theta", 10000.0)
    if rs is None:
        return None, rope_theta
    if not isinstance(rs, dict):
        raise ValueError(f"{key} must be an object (or null), got {rs!r}")
    rope_theta = rs.get("rope_theta", rope_theta)
    kind = rs.get("rope_type") or rs.get("type")
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
    elif kind not in (None, "default"):
        raise ValueError(f"rope scaling type {kind!r} is not supported (llama3 or none)")
    if rs.get("freq_factors") is not None:  # written by hf_style_config for GGUF targets
        base = scaling or RopeScaling()
        scaling = replace(base, freq_factors=tuple(float(x) for x in rs["freq_factors"]))
    return scaling, rope_theta


def token_ids(cfg: dict[str, Any], key: str, allow_list: bool = True) -> tuple[int, ...]:
    """config.json's id field (one id, a list of them, or null) as a tuple, refused unless
    every one is a token id."""
    value = cfg.get(key)
    ids = [] if value is None else value if isinstance(value, list) and allow_list else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        allowed = "a token id, a list of them, or null" if allow_list else "a token id or null"
        raise ValueError(f"{key} must be {allowed}, got {value!r}")
    return tuple(ids)


def _check_numbers(cfg: dict[str, Any], head_dim: Any, rope_theta: Any) -> None:
    sizes = {k: cfg[k] for k in _REQUIRED_HF_KEYS}
    sizes["head_dim"] = head_dim
    if cfg.get("num_key_value_heads") is not None:
        sizes["num_key_value_heads"] = cfg["num_key_value_heads"]
    if "max_position_embeddings" in cfg:
        sizes["max_position_embeddings"] = cfg["max_position_embeddings"]
    for key, value in sizes.items():
        check_positive_int(key, value)
    for key, value in (("rope_theta", rope_theta), ("rms_norm_eps", cfg.get("rms_norm_eps", 1e-5))):
        check_positive_number(key, value)
    heads = cfg["num_attention_heads"]
    given = "head_dim" if cfg.get("head_dim") else "hidden_size // num_attention_heads"
    check_attention_shape(heads, sizes.get("num_key_value_heads", heads), head_dim, given)


def _check_window(cfg: dict[str, Any], model_type: str) -> None:
    window = cfg.get("sliding_window")
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    positions = cfg.get("max_position_embeddings", 4096)
    windowed = cfg.get("use_sliding_window") or model_type == "mistral"
    if windowed and window < positions:
        raise ValueError(
            f"sliding-window attention (sliding_window {window} < max_position_embeddings "
            f"{positions}) is not supported"
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
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (allowed: silu)")
    if cfg.get("mlp_bias"):
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
