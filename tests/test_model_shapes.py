"""Model shapes and settings beyond the parity suite's: each checkpoint is written by
transformers itself (or by the GGUF writer) and must either match transformers' float32 logits
and greedy tokens, or be refused naming what is not supported."""

from __future__ import annotations

import json
import os

import gguf
import pytest
import torch
import transformers

from specserve import Engine, InvalidArgument
from tests.model_factory import (
    SequenceRunner,
    _randomize_small_params_,
    hf_greedy,
    load_hf_model,
    load_ours,
    random_prompt,
    write_gguf_model,
)

CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mistral": transformers.MistralConfig,
}


def write_model(folder, arch="llama", seed=0, dtype=torch.float32, edit=None, drop=(), **kw):
    """A random transformers model saved in `folder` (config.json then edited: `edit` keys
    set, `drop` keys removed); returns (folder, the transformers model read back)."""
    args = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg = CONFIGS[arch](**{**args, **kw})
    cfg.architectures = [CONFIGS[arch].__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = getattr(transformers, cfg.architectures[0])(cfg).float().eval()
    _randomize_small_params_(model, seed)
    folder = str(folder)
    model.to(dtype).save_pretrained(folder)
    if edit or drop:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            saved = json.load(f)
        saved.update(edit or {})
        for key in drop:
            saved.pop(key, None)
        with open(path, "w") as f:
            json.dump(saved, f)
    return folder, load_hf_model(folder)


def ours_vs_hf(path, hf, n: int = 40, n_decode: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(our logits, transformers' logits) of one prompt: a prefill, then decode steps."""
    ids = random_prompt(n, hf.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    runner = SequenceRunner(load_ours(path))
    got = [runner.extend({"a": ids[: n - n_decode]})["a"]]
    got += [runner.extend({"a": [t]})["a"] for t in ids[n - n_decode :]]
    return torch.cat(got), ref


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(ours, ref, atol=1e-4 * scale, rtol=0)


def refusal(path) -> str:
    with pytest.raises(InvalidArgument) as e:
        load_ours(path)
    assert e.value.field == "model_path"
    return str(e.value)


SHAPES = {
    "llama_head_dim_32_one_kv_head": dict(head_dim=32, num_key_value_heads=1, vocab_size=251),
    "llama_head_dim_8_kv_equal_heads": dict(head_dim=8, num_key_value_heads=4),
    "qwen2_tied_one_kv_head": dict(arch="qwen2", tie_word_embeddings=True, num_key_value_heads=1),
    "qwen3_head_dim_24_odd_vocab": dict(arch="qwen3", head_dim=24, vocab_size=263),
    "mistral_head_dim_24": dict(arch="mistral", sliding_window=None, head_dim=24),
    "mistral_window_past_context": dict(
        arch="mistral", sliding_window=4096, max_position_embeddings=96
    ),
    "llama_bf16_checkpoint": dict(dtype=torch.bfloat16, tie_word_embeddings=True),
    "qwen2_fp16_checkpoint": dict(arch="qwen2", dtype=torch.float16),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_match_transformers(tmp_path, shape):
    assert_logits_close(*ours_vs_hf(*write_model(tmp_path, **SHAPES[shape])))


T = 100.0  # (a low theta: the short prompts turn through every scaled band)
ROPES = {
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": T}),
    "linear_legacy_key": dict(
        edit={"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": T}
    ),
    "yarn": dict(
        arch="qwen2",
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": T,
            "original_max_position_embeddings": 64,
        },
    ),
    "yarn_attention_factor_betas": dict(
        arch="qwen3",
        rope_parameters={
            "rope_type": "yarn",
            "factor": 3.0,
            "rope_theta": T,
            "original_max_position_embeddings": 32,
            "attention_factor": 1.3,
            "beta_fast": 8,
            "beta_slow": 2,
            "truncate": False,
        },
    ),
    "yarn_mscale": dict(
        arch="mistral",
        sliding_window=None,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": T,
            "original_max_position_embeddings": 64,
            "mscale": 2.0,
            "mscale_all_dim": 1.0,
        },
    ),
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_scaling_types_match_transformers(tmp_path, rope):
    folder, hf = write_model(tmp_path / "m", **ROPES[rope])
    ours, ref = ours_vs_hf(folder, hf)
    assert_logits_close(ours, ref)
    # the scaling matters at these positions: ignoring it would fail the check above
    kw = {k: v for k, v in ROPES[rope].items() if k not in ("edit", "rope_parameters")}
    default = {"rope_type": "default", "rope_theta": T}
    plain, _ = write_model(tmp_path / "p", **kw, rope_parameters=default)  # (same weights)
    assert (ours_vs_hf(plain, hf)[0] - ref).abs().max() > 1e-2


def test_dynamic_rope_is_the_default_rotation_within_the_context(tmp_path):
    """transformers' dynamic NTK scaling changes nothing before max_position_embeddings,
    which the engine's context never passes."""
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": T}
    assert_logits_close(*ours_vs_hf(*write_model(tmp_path, rope_parameters=rope)))


def test_a_rope_type_without_an_implementation_is_refused_naming_it(tmp_path):
    rope = {
        "rope_type": "longrope",
        "rope_theta": T,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64,
    }
    folder, _ = write_model(tmp_path, rope_parameters=rope)
    assert "rope scaling type 'longrope' is not supported" in refusal(folder)


def test_llama3_rope_without_original_context_defaults_to_max_positions(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    folder, _ = write_model(tmp_path, rope_parameters={**rope, "rope_theta": T})
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["rope_parameters"].pop("original_max_position_embeddings")
    with open(path, "w") as f:
        json.dump(cfg, f)
    assert_logits_close(*ours_vs_hf(folder, load_hf_model(folder)))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0},
    ],
    ids=["llama3", "yarn"],
)
def test_a_top_level_original_context_wins_as_in_transformers(tmp_path, rope):
    """Phi-3-style configs keep original_max_position_embeddings beside rope_parameters, not
    in it: transformers rotates with that value, not with max_position_embeddings."""
    folder, _ = write_model(tmp_path, rope_parameters={**rope, "rope_theta": T})
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["rope_parameters"]["original_max_position_embeddings"] = cfg["max_position_embeddings"]
    cfg["original_max_position_embeddings"] = 16
    with open(path, "w") as f:
        json.dump(cfg, f)
    hf = load_hf_model(folder)
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 16
    assert_logits_close(*ours_vs_hf(folder, hf))


def test_keys_config_json_omits_take_transformers_defaults(tmp_path):
    """rms_norm_eps absent: transformers' 1e-6 for these models."""
    folder, hf = write_model(tmp_path, rms_norm_eps=1e-6, drop=("rms_norm_eps",))
    assert hf.config.rms_norm_eps == 1e-6
    assert_logits_close(*ours_vs_hf(folder, hf))


ABSENT_HEAD_KEYS = {
    # (each default differs from what the head count alone gives)
    "qwen3_head_dim_128_and_32_kv_heads": dict(
        arch="qwen3", num_attention_heads=32, num_key_value_heads=32, head_dim=128
    ),
    "mistral_8_kv_heads": dict(
        arch="mistral", sliding_window=None, num_attention_heads=16, num_key_value_heads=8
    ),
    "qwen2_32_kv_heads": dict(
        arch="qwen2", hidden_size=128, num_attention_heads=64, num_key_value_heads=32
    ),
}


@pytest.mark.parametrize("case", list(ABSENT_HEAD_KEYS))
def test_absent_head_keys_take_the_model_types_defaults_as_transformers_does(tmp_path, case):
    """config.json without num_key_value_heads or head_dim: transformers' defaults per model
    type (Qwen3's heads are 128 wide whatever the hidden size), not the head count's."""
    folder, hf = write_model(
        tmp_path, **ABSENT_HEAD_KEYS[case], drop=("num_key_value_heads", "head_dim")
    )
    assert_logits_close(*ours_vs_hf(folder, hf))


def test_an_absent_kv_head_count_whose_default_does_not_fit_is_refused_naming_it(tmp_path):
    folder, _ = write_model(tmp_path, arch="qwen2", num_key_value_heads=4)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("num_key_value_heads")
    with open(path, "w") as f:
        json.dump(cfg, f)
    assert "num_key_value_heads is absent and qwen2's default (32)" in refusal(folder)


def test_qwen2_biases_q_k_v_whatever_its_attention_bias_key(tmp_path):
    folder, hf = write_model(tmp_path, arch="qwen2", edit={"attention_bias": False})
    assert_logits_close(*ours_vs_hf(folder, hf))


def test_swish_is_silu(tmp_path):
    assert_logits_close(*ours_vs_hf(*write_model(tmp_path, hidden_act="swish")))


def test_another_activation_is_refused_naming_it(tmp_path):
    folder, _ = write_model(tmp_path, hidden_act="gelu")
    assert "hidden_act 'gelu' is not supported" in refusal(folder)


def test_sliding_window_on_no_layer_runs_and_on_some_layer_is_refused(tmp_path):
    """Qwen2 slides only layers from max_window_layers on (transformers' layer_types)."""
    window = dict(arch="qwen2", use_sliding_window=True, sliding_window=8)
    folder, hf = write_model(tmp_path / "none", **window, max_window_layers=2)
    assert_logits_close(*ours_vs_hf(folder, hf))  # (40 tokens: past the window)
    folder, _ = write_model(tmp_path / "one", **window, max_window_layers=1)
    assert "sliding_window 8 < max_position_embeddings 2048, on layers [1]" in refusal(folder)
    folder, _ = write_model(tmp_path / "mistral", arch="mistral", sliding_window=8)
    assert "sliding-window attention" in refusal(folder)


def test_an_untied_checkpoint_without_lm_head_is_refused_naming_the_setting(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = write_model(tmp_path)
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    del state["lm_head.weight"]
    save_file(state, path, metadata={"format": "pt"})
    message = refusal(folder)
    assert "lm_head.weight" in message and "tie_word_embeddings" in message


def _gguf_with_rope_scaling(monkeypatch, path, folder, kind, factor: float):
    """write_gguf_model, with llama.cpp's rope.scaling.type / factor keys added."""
    add_base = gguf.GGUFWriter.add_rope_freq_base

    def add(self, value):
        add_base(self, value)
        self.add_rope_scaling_type(kind)
        self.add_rope_scaling_factor(factor)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", add)
    return write_gguf_model(path, folder)


def test_gguf_linear_rope_scaling_matches_transformers(tmp_path, monkeypatch):
    rope = {"rope_type": "linear", "factor": 3.0, "rope_theta": T}
    folder, _ = write_model(tmp_path / "hf", rope_parameters=rope, num_key_value_heads=1)
    path, state = _gguf_with_rope_scaling(
        monkeypatch, tmp_path / "m.gguf", folder, gguf.RopeScalingType.LINEAR, 3.0
    )
    assert_logits_close(*ours_vs_hf(path, load_hf_model(folder, state)))


def test_gguf_yarn_is_refused_naming_it(tmp_path, monkeypatch):
    folder, _ = write_model(tmp_path / "hf")
    path, _ = _gguf_with_rope_scaling(
        monkeypatch, tmp_path / "m.gguf", folder, gguf.RopeScalingType.YARN, 4.0
    )
    assert "rope scaling 'yarn' is not supported" in refusal(path)


yarn, linear = ROPES["yarn"]["rope_parameters"], ROPES["linear"]["rope_parameters"]


@pytest.mark.parametrize(
    "shape",
    [
        dict(
            arch="qwen3", head_dim=32, num_key_value_heads=1, vocab_size=301, rope_parameters=yarn
        ),
        dict(tie_word_embeddings=True, vocab_size=199, rope_parameters=linear),
    ],
    ids=["qwen3_yarn", "llama_tied_linear"],
)
def test_engine_greedy_matches_transformers_generate(tmp_path, shape):
    """Prompts longer than a page, run in chunks, against transformers' greedy tokens."""
    folder, hf = write_model(tmp_path, **shape)
    vocab = hf.config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (5, 37, 70)]
    refs = [hf_greedy(hf, p, 12) for p in prompts]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(
        model_path=folder,
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        page_size=16,
        chunked_prefill_size=32,
        max_total_tokens=1024,
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == refs


def test_rope_parameters_per_layer_type_are_refused_naming_them(tmp_path):
    rope = {"rope_type": "default", "rope_theta": T}
    nested = {"full_attention": rope, "sliding_attention": {**rope, "rope_theta": 10.0}}
    folder, _ = write_model(tmp_path, edit={"rope_parameters": nested})
    assert "per layer type (full_attention, sliding_attention)" in refusal(folder)
