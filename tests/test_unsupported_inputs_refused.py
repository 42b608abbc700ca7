"""Models, files and engine arguments the engine cannot run as asked are refused up front with
an error naming the argument, never loaded with other maths or failing deep inside."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import Engine, InvalidArgument
from specserve.cli import add_engine_args, engine_kwargs
from specserve.config import EngineConfig
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, write_dummy_config
from tests.model_factory import write_gguf_model, write_hf_model

CPU_DUMMY = dict(load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32")


def _refused(field: str, **kwargs) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        Engine(**kwargs)
    assert info.value.field == field, str(info.value)
    return info.value


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"model_type": "gemma"}, "gemma"),
        ({"model_type": "mistral", "sliding_window": 8}, "sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),  # a Llama's bias covers o_proj too
        ({"model_type": "qwen3", "head_dim": 16, "attention_bias": True}, "attention_bias"),
        # (shapes the attention cannot run: they crashed the first request, and every one after)
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_attention_heads": 2, "num_key_value_heads": 4}, "num_key_value_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"hidden_size": 28, "num_attention_heads": 4}, "head_dim"),  # (28 // 4 = 7)
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4},
            "sliding_window",
        ),
        ({"intermediate_size": None}, "intermediate_size"),
        ({"rope_theta": "10000"}, "rope_theta"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "low_freq_factor",
        ),
    ],
)
def test_a_model_whose_maths_the_engine_does_not_implement_is_refused(tmp_path, overrides, named):
    drop = [k for k, v in overrides.items() if v is None]
    folder = write_dummy_config(
        str(tmp_path / "m"), **{k: v for k, v in overrides.items() if v is not None}
    )
    if drop:
        path = os.path.join(folder, "config.json")
        cfg = json.load(open(path))
        for k in drop:
            del cfg[k]
        json.dump(cfg, open(path, "w"))
    error = _refused("model_path", model_path=folder, **CPU_DUMMY)
    assert named in str(error)


def test_a_sliding_window_that_is_switched_off_or_covers_the_context_loads(tmp_path):
    for i, overrides in enumerate(
        [
            {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4},
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 512},
            {"model_type": "mistral", "sliding_window": None},
        ]
    ):
        folder = write_dummy_config(str(tmp_path / f"m{i}"), **overrides)
        with Engine(model_path=folder, **CPU_DUMMY) as engine:
            out = engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2})
        assert len(out["output_ids"]) == 2


def _add_tensor(folder: str, name: str, make) -> None:
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    state[name] = make(state)
    save_file(state, path, metadata={"format": "pt"})


def test_a_tied_model_whose_checkpoint_carries_a_different_lm_head_is_refused(tmp_path):
    same = write_hf_model(tmp_path / "same", tie_word_embeddings=True)
    _add_tensor(same, "lm_head.weight", lambda s: s["model.embed_tokens.weight"].clone())
    with Engine(model_path=same, skip_tokenizer_init=True, device="cpu") as engine:
        out = engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2

    other = write_hf_model(tmp_path / "other", tie_word_embeddings=True)
    _add_tensor(other, "lm_head.weight", lambda s: s["model.embed_tokens.weight"] + 0.5)
    error = _refused("model_path", model_path=other, skip_tokenizer_init=True, device="cpu")
    assert "lm_head.weight" in str(error) and "tie_word_embeddings" in str(error)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    folder = write_hf_model(root / "hf", with_tokenizer=True)
    path, _ = write_gguf_model(root / "m.gguf", folder, qtype="F32")
    return str(path)


@pytest.mark.parametrize("keep_bytes", [0, 10, 30, 200])
def test_a_truncated_gguf_file_is_refused_naming_the_model_path(tmp_path, gguf_file, keep_bytes):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(open(gguf_file, "rb").read()[:keep_bytes])
    error = _refused("model_path", model_path=str(bad), skip_tokenizer_init=True, device="cpu")
    assert "bad.gguf" in str(error)


def test_a_gguf_tensor_of_an_unknown_type_is_refused_naming_the_tensor(tmp_path, gguf_file):
    import gguf

    reader = gguf.GGUFReader(gguf_file)
    first = reader.tensors[0]
    # a tensor table entry: name length, name, n_dims, dims, type, data offset
    type_offset = first.field.offset + sum(part.nbytes for part in first.field.parts[:-2])
    data = bytearray(open(gguf_file, "rb").read())
    assert int.from_bytes(data[type_offset : type_offset + 4], "little") == int(first.tensor_type)
    data[type_offset : type_offset + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    error = _refused("model_path", model_path=str(bad), skip_tokenizer_init=True, device="cpu")
    assert first.name in str(error) and "99" in str(error)


def test_an_upper_case_gguf_extension_loads_and_a_contradicting_load_format_is_refused(
    tmp_path, gguf_file
):
    upper = tmp_path / "M.GGUF"
    shutil.copy(gguf_file, upper)
    with Engine(model_path=str(upper), device="cpu") as engine:
        assert engine.tokenizer is not None
        out = engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2
    _refused("load_format", model_path=gguf_file, load_format="safetensors", device="cpu")
    folder = write_dummy_config(str(tmp_path / "hf"))
    _refused("load_format", model_path=folder, load_format="gguf", device="cpu")


def test_a_missing_tokenizer_path_and_a_missing_standalone_draft_name_their_own_argument(tmp_path):
    _refused("tokenizer_path", **dict(TINY, skip_tokenizer_init=False), tokenizer_path="/no/tok")
    _refused(
        "speculative_draft_model_path",
        **TINY,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(tmp_path / "missing"),
    )


@pytest.mark.parametrize("corrupt", ["past the vocabulary", "below zero", "larger vocabulary"])
def test_an_eagle3_draft_mapping_tokens_outside_the_target_vocabulary_is_refused(tmp_path, corrupt):
    folder = write_random_eagle_checkpoint(
        str(tmp_path / "d"), PRESETS["tiny"], "EAGLE3", draft_vocab_size=64
    )
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    if corrupt == "past the vocabulary":
        state["d2t"][-1] = PRESETS["tiny"].vocab_size
    elif corrupt == "below zero":
        state["d2t"][0] = -1
    else:
        state["d2t"] = torch.zeros(PRESETS["tiny"].vocab_size + 8, dtype=torch.int64)
        state["lm_head.weight"] = torch.zeros(PRESETS["tiny"].vocab_size + 8, 64)
        cfg = json.load(open(os.path.join(folder, "config.json")))
        cfg["draft_vocab_size"] = PRESETS["tiny"].vocab_size + 8
        json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    save_file(state, path, metadata={"format": "pt"})
    error = _refused(
        "speculative_draft_model_path",
        **TINY,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=folder,
    )
    assert "vocabulary" in str(error)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"disable_radix_cache": "false"}, "disable_radix_cache"),
        ({"speculative_adaptive": 1}, "speculative_adaptive"),
        ({"random_seed": -1}, "random_seed"),
        ({"random_seed": 2**64}, "random_seed"),
        ({"random_seed": "7"}, "random_seed"),
        ({"mem_fraction_static": "0.5"}, "mem_fraction_static"),
        ({"max_running_requests": 10**9}, "max_running_requests"),
        ({"log_level": "loud"}, "log_level"),
        ({"device": None}, "device"),
        ({"model_path": None}, "model_path"),
        ({"tokenizer_path": 5}, "tokenizer_path"),
    ],
)
def test_engine_arguments_of_the_wrong_type_or_range_are_refused(kwargs, field):
    with pytest.raises(InvalidArgument) as info:
        EngineConfig(**dict(TINY, **kwargs)).resolve(cuda_available=False)
    assert info.value.field == field


STANDALONE = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny")


@pytest.mark.parametrize("lag", ["8", 1.5, -1, 10**9])
def test_a_draft_lag_that_is_not_a_sane_integer_is_refused(lag):
    cfg = EngineConfig(
        **TINY, **STANDALONE, speculative_adaptive=True, speculative_adaptive_lag_tokens=lag
    )
    with pytest.raises(InvalidArgument) as info:
        cfg.resolve(cuda_available=False)
    assert info.value.field == "speculative_adaptive_lag_tokens"


def test_every_numeric_cli_flag_parses_as_its_fields_type():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--speculative-adaptive-lag-tokens", "8", "--mem-fraction-static", "0.5"]
        + ["--random-seed", "3", "--simulate-acc-len", "2.5"]
    )
    kwargs = engine_kwargs(args)
    assert kwargs["speculative_adaptive_lag_tokens"] == 8
    assert kwargs["mem_fraction_static"] == 0.5 and kwargs["random_seed"] == 3
    assert kwargs["simulate_acc_len"] == 2.5


def test_sglangs_other_spelling_of_a_flag_sets_the_same_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv in (["--tp-size", "2"], ["--tensor-parallel-size", "2"]):
        assert engine_kwargs(parser.parse_args(argv)) == {"tp_size": 2}


def test_a_fixed_simulated_token_without_the_fixed_mode_is_refused():
    cfg = EngineConfig(**TINY, **STANDALONE, simulate_acc_len=2.0, simulate_acc_fixed_token=7)
    with pytest.raises(InvalidArgument) as info:
        cfg.resolve(cuda_available=False)
    assert info.value.field == "simulate_acc_fixed_token"
    fixed = EngineConfig(
        **TINY,
        **STANDALONE,
        simulate_acc_len=2.0,
        simulate_acc_fixed_token=7,
        simulate_acc_token_mode="fixed",
    ).resolve(cuda_available=False)
    assert fixed.simulate_acc_fixed_token == 7


def test_the_bundled_draft_takes_lower_case_names_and_leaves_a_users_tree_size_to_be_checked():
    lower = EngineConfig(speculative_algorithm="eagle").resolve(cuda_available=False)
    assert lower.speculative_algorithm == "EAGLE"
    assert lower.speculative_draft_model_path is not None  # the bundled draft, not refused
    with pytest.raises(InvalidArgument) as info:
        EngineConfig(
            speculative_num_steps=2, speculative_eagle_topk=4, speculative_num_draft_tokens=1000
        ).resolve(cuda_available=False)
    assert info.value.field == "speculative_num_draft_tokens" and "[2, 21]" in str(info.value)
    # a chain's size is num_steps + 1, whatever is given (as in SGLang)
    chain = EngineConfig(speculative_num_draft_tokens=1000).resolve(cuda_available=False)
    assert chain.speculative_eagle_topk == 1
    assert chain.speculative_num_draft_tokens == chain.speculative_num_steps + 1


def test_a_context_longer_than_the_model_is_refused_and_resolved_args_report_what_runs():
    error = _refused("context_length", **TINY, context_length=10**6)
    assert str(PRESETS["tiny"].max_position_embeddings) in str(error)
    # (one prompt token and the token it is answered with need two)
    assert ">= 2" in str(_refused("context_length", **TINY, context_length=1))
    with Engine(**TINY, context_length=100, max_total_tokens=5, page_size=4) as engine:
        resolved = engine.resolved_args()
        assert resolved["context_length"] == 100 == engine.core.context_len
        assert resolved["max_total_tokens"] == 8 == engine.core.max_total_tokens
    with Engine(**TINY) as engine:
        resolved = engine.resolved_args()
        assert resolved["context_length"] == PRESETS["tiny"].max_position_embeddings
        assert resolved["max_total_tokens"] == engine.core.max_total_tokens
        reasons = {d["field"]: d["reason"] for d in resolved["decisions"]}
        assert "max_position_embeddings" in reasons["context_length"]


def test_a_mistral_folder_without_a_short_window_gives_transformers_logits(tmp_path):
    import transformers

    from tests.model_factory import (
        SequenceRunner,
        _randomize_small_params_,
        load_hf_model,
        load_ours,
        random_prompt,
    )

    cfg = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).float().eval()
    _randomize_small_params_(model, 0)
    model.save_pretrained(tmp_path / "mistral")
    ids = random_prompt(40, 256, seed=1)
    ours = SequenceRunner(load_ours(tmp_path / "mistral")).extend({"a": ids})["a"]
    with torch.no_grad():
        ref = load_hf_model(tmp_path / "mistral")(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_a_chat_on_a_model_without_tokenizer_is_a_one_line_cli_error(capsys):
    from specserve.cli import main

    rc = main(["generate", "hi", "--chat", "--model-path", "tiny", "--load-format", "dummy"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: messages:" in err and "tokenizer" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "command",
    [
        ["one-batch", "--output-len", "0"],
        ["one-batch", "--batch-size", "4", "0"],
        ["one-batch", "--repeats", "0"],
        ["multiturn", "--turns", "0"],
        ["multiturn", "--conversations", "x"],
    ],
)
def test_bench_counts_below_one_are_refused_naming_the_flag(command, capsys):
    from specserve.cli import main

    with pytest.raises(SystemExit) as info:
        main(["bench", *command, "--model-path", "tiny", "--load-format", "dummy"])
    assert info.value.code == 2
    flag = next(c for c in command if c.startswith("--"))
    assert f"argument {flag}: must be an integer >= 1" in capsys.readouterr().err


def test_adaptive_speculation_without_a_draft_is_refused():
    """Like every other speculative setting without speculative_algorithm (it was dropped
    silently, and the engine decoded plainly)."""
    cfg = EngineConfig(**TINY, speculative_adaptive=True)
    with pytest.raises(InvalidArgument) as info:
        cfg.resolve(cuda_available=False)
    assert info.value.field == "speculative_adaptive"
    assert "speculative_algorithm" in str(info.value)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_a_draft_head_of_a_shape_attention_cannot_run_is_refused_naming_the_draft(
    tmp_path, algorithm
):
    """A draft whose key/value heads do not divide its query heads failed the first request,
    and with it every request after (the engine's step broke), plain ones included."""
    target = write_dummy_config(str(tmp_path / "t"))
    with open(os.path.join(target, "config.json")) as f:
        from specserve.model.config import ModelConfig

        cfg = ModelConfig.from_hf_dict(json.load(f))
    draft = write_random_eagle_checkpoint(
        str(tmp_path / "d"), cfg.with_changes(num_kv_heads=3), algorithm
    )
    error = _refused(
        "speculative_draft_model_path",
        model_path=target,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=draft,
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
        **CPU_DUMMY,
    )
    assert "num_key_value_heads" in str(error)


def test_a_gguf_of_a_shape_attention_cannot_run_is_refused(tmp_path):
    folder = write_hf_model(str(tmp_path / "m"), num_heads=4, num_kv_heads=3)
    path, _ = write_gguf_model(str(tmp_path / "m.gguf"), folder, qtype="F32")
    error = _refused("model_path", model_path=path, dtype="float32", device="cpu")
    assert "num_key_value_heads" in str(error)


def test_a_kv_cache_the_device_cannot_allocate_is_refused_naming_what_sized_it():
    # (past any address space: refused even where memory is overcommitted)
    error = _refused("max_total_tokens", **TINY, max_total_tokens=10**13)
    assert "GiB" in str(error) and "cannot allocate" in str(error)
    error = _refused("page_size", **TINY, page_size=10**12)  # (one page past any cache)
    assert "cannot allocate" in str(error)
    # (a page larger than the tokens asked for is one page, as before)
    with Engine(**TINY, max_total_tokens=5, page_size=16) as engine:
        assert engine.resolved_args()["max_total_tokens"] == 16


@pytest.mark.parametrize("device", ["cudax", "cuda:abc", "cuda:-1", "cuda:", "gpu"])
def test_a_malformed_device_is_refused_naming_the_forms_taken(device):
    from specserve.config.engine_config import EngineConfig

    with pytest.raises(InvalidArgument) as info:
        EngineConfig(**{**TINY, "device": device}).resolve(cuda_available=True)
    assert info.value.field == "device" and "cuda:N" in str(info.value)
