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
        """Build from a Hugging Face config.json dictionary (Llama, Qwen2, Qwen3, SmolLM2)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        scaling = None
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta", 10000.0)
        if isinstance(rs, dict):
            rope_theta = rs.get("rope_theta", rope_theta)
            kind = rs.get("rope_type") or rs.get("type")
            if kind == "llama3":
                scaling = RopeScaling(
                    factor=rs["factor"],
                    low_freq_factor=rs["low_freq_factor"],
                    high_freq_factor=rs["high_freq_factor"],
                    original_max_position_embeddings=rs["original_max_position_embeddings"],
                )
            elif kind not in (None, "default"):
                raise ValueError(f"rope scaling type {kind!r} is not supported (llama3 or none)")
            if rs.get("freq_factors") is not None:  # written by hf_style_config for GGUF targets
                base = scaling or RopeScaling()
                scaling = replace(base, freq_factors=tuple(float(x) for x in rs["freq_factors"]))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )


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
