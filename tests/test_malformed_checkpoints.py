"""Checkpoints, configs and metadata that are malformed are refused with an error naming the
file, tensor or key and what is allowed: never loaded into a silently wrong model, never a
Python traceback from deep inside the loader."""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import Engine, InvalidArgument
from specserve.model.config import ModelConfig
from specserve.model.sharding import CheckpointShard
from tests.model_factory import write_gguf_model, write_hf_model

LOAD = dict(skip_tokenizer_init=True, device="cpu", dtype="float32")
Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
V = "model.layers.0.self_attn.v_proj.weight"
GATE = "model.layers.1.mlp.gate_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"


def _refused(field: str = "model_path", **kwargs) -> str:
    with pytest.raises(InvalidArgument) as info:
        Engine(**{**LOAD, **kwargs})
    assert info.value.field == field, str(info.value)
    return str(info.value)


def _loads(**kwargs) -> list[int]:
    with Engine(**{**LOAD, **kwargs}) as engine:
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    return out["output_ids"]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny Llama (hidden 64, 4 heads of 16, 2 KV heads, intermediate 128)."""
    return write_hf_model(tmp_path_factory.mktemp("hf") / "m")


@pytest.fixture(scope="module")
def state(hf_model):
    return load_file(os.path.join(hf_model, "model.safetensors"))


def _with_state(tmp_path, hf_model, state, **tensors) -> str:
    folder = str(tmp_path / "edited")
    shutil.copytree(hf_model, folder)
    save_file({**state, **tensors}, os.path.join(folder, "model.safetensors"))
    return folder


# ---- fused q/k/v and gate/up: each piece its own shape ----------------------------------------
@pytest.mark.parametrize(
    "shapes, named, expected",
    [
        # 80 + 16 + 32 rows add up to the fused 128: each piece must still be its own size
        ({Q: (80, 64), K: (16, 64)}, Q, "(64, 64)"),
        ({GATE: (156, 64), UP: (100, 64)}, GATE, "(128, 64)"),
        ({V: (32, 60)}, V, "(32, 64)"),
    ],
)
def test_a_fused_piece_of_the_wrong_shape_is_refused_naming_it(
    tmp_path, hf_model, state, shapes, named, expected
):
    bad = {name: torch.zeros(shape) for name, shape in shapes.items()}
    error = _refused(model_path=_with_state(tmp_path, hf_model, state, **bad))
    assert named in error and expected in error


def test_a_checkpoint_lacking_one_fused_piece_is_refused_naming_it(tmp_path, hf_model, state):
    folder = _with_state(tmp_path, hf_model, {k: v for k, v in state.items() if k != V})
    assert V in _refused(model_path=folder)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_gguf_projection_of_the_wrong_rows_is_refused_naming_the_gguf_tensor(
    tmp_path, hf_model, state, arch
):
    """(llama's q/k rows are unpermuted per head: 34 rows are not whole heads, and the
    reshape crashed)"""
    bad = {**state, Q: state[Q][:34]} if arch == "llama" else {**state, Q: torch.zeros(80, 64)}
    if arch == "qwen2":
        bad[K] = torch.zeros(16, 64)
    config = json.load(open(os.path.join(hf_model, "config.json")))
    path, _ = write_gguf_model(
        tmp_path / "m.gguf", bad, config=config, arch=arch, permute=False, with_tokenizer=False
    )
    error = _refused(model_path=str(path))
    assert "blk.0.attn_" in error and "expected [" in error


def test_a_tensor_parallel_rank_refuses_a_tensor_whose_slice_would_fit(state):
    """Rank 0 of 2 reads q rows [0, 32): a 48-row q_proj would give it 32 rows that fit."""
    cfg = ModelConfig(256, 64, 128, 2, 4, 2, 16)
    shard = CheckpointShard(cfg, types.SimpleNamespace(rank=0, size=2))
    assert shard.read(Q, state[Q]).shape == (32, 64)
    with pytest.raises(ValueError, match="q_proj.weight.*needs 64 along dim 0"):
        shard.read(Q, state[Q][:48])


# ---- which files hold the weights ----------------------------------------------------------
@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("sharded") / "m", sharded=True)


def test_only_the_files_the_index_names_are_read(tmp_path, sharded):
    """Mistral's folders ship consolidated.safetensors (other names, same weights) beside the
    indexed shards; a stale model.safetensors left beside them must not override them."""
    expected = _loads(model_path=sharded)
    folder = str(tmp_path / "m")
    shutil.copytree(sharded, folder)
    save_file(
        {"layers.0.attention.wq.weight": torch.zeros(64, 64)}, f"{folder}/consolidated.safetensors"
    )
    save_file({"model.norm.weight": torch.zeros(64)}, f"{folder}/model.safetensors")
    assert _loads(model_path=folder) == expected


def test_an_index_naming_a_missing_file_is_refused_naming_it(tmp_path, sharded):
    folder = str(tmp_path / "m")
    shutil.copytree(sharded, folder)
    os.remove(f"{folder}/model-00002-of-00004.safetensors")
    error = _refused(model_path=folder)
    assert "model.safetensors.index.json" in error and "model-00002-of-00004" in error


def test_a_tensor_in_two_files_is_refused_naming_both(tmp_path, hf_model, state):
    folder = _with_state(tmp_path, hf_model, state)
    save_file({"model.norm.weight": torch.zeros(64)}, f"{folder}/extra.safetensors")
    error = _refused(model_path=folder)
    assert "model.norm.weight" in error
    assert "extra.safetensors" in error and "model.safetensors" in error


# ---- config.json and generation_config.json -----------------------------------------------
DUMMY = dict(load_format="dummy")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3["original_max_position_embeddings"] = 64


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),  # (head_dim divides by it)
        ({"hidden_size": "32"}, "hidden_size"),
        ({"model_type": "mistral", "sliding_window": "8"}, "sliding_window"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 0},
            "sliding_window",
        ),
        ({"rope_scaling": {**LLAMA3, "factor": "8"}}, "rope_scaling.factor"),
        ({"rope_scaling": {**LLAMA3, "factor": 0}}, "rope_scaling.factor"),
        ({"rope_parameters": {**LLAMA3, "low_freq_factor": -1.0}}, "low_freq_factor"),
        ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor"),
        ({"rope_scaling": "linear"}, "rope_scaling must be an object"),
        ({"max_position_embeddings": None}, "max_position_embeddings"),
        ({"tie_word_embeddings": None}, "tie_word_embeddings"),
        ({"eos_token_id": "2"}, "eos_token_id"),
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"architectures": "LlamaForCausalLM"}, "architectures"),
    ],
)
def test_a_config_value_of_the_wrong_type_or_range_is_refused_naming_the_key(
    tmp_path, overrides, named
):
    from tests.engine_utils import write_dummy_config

    folder = write_dummy_config(str(tmp_path / "m"), **overrides)
    assert named in _refused(model_path=folder, **DUMMY)


def test_a_null_num_key_value_heads_means_one_per_query_head(tmp_path):
    """As transformers reads it (it crashed the attention's construction)."""
    from tests.engine_utils import write_dummy_config

    folder = write_dummy_config(str(tmp_path / "m"), num_key_value_heads=None)
    with Engine(model_path=folder, **DUMMY, **LOAD) as engine:
        assert engine.core.model_config.num_kv_heads == 4
        out = engine.generate(input_ids=[3, 4], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("text", ["[1, 2]", "{not json"])
def test_a_config_file_that_is_not_a_json_object_is_refused_naming_it(tmp_path, name, text):
    from tests.engine_utils import write_dummy_config

    folder = write_dummy_config(str(tmp_path / "m"))
    (tmp_path / "m" / name).write_text(text)
    assert name in _refused(model_path=folder, **DUMMY)


# ---- GGUF metadata and tensor types -----------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, hf_model):
    path, _ = write_gguf_model(tmp_path_factory.mktemp("gguf") / "m.gguf", hf_model)
    return str(path)


@pytest.mark.parametrize(
    "key, value",
    [
        ("llama.attention.head_count_kv", 0),
        ("llama.attention.head_count", "4"),
        ("llama.block_count", 1.5),
        ("llama.rope.freq_base", 0.0),
        ("llama.attention.layer_norm_rms_epsilon", "1e-5"),
        ("tokenizer.ggml.eos_token_id", 9999),  # (transformers' tokenizer indexed past the list)
    ],
)
def test_a_gguf_metadata_value_of_the_wrong_type_or_range_is_refused_naming_the_key(
    gguf_path, key, value
):
    from specserve.model.gguf_loader import load_gguf_config, read_gguf

    gf = read_gguf(gguf_path)
    gf.metadata[key] = value
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_gguf_config(gguf_path, gf)


def test_a_gguf_without_any_vocabulary_size_is_refused(gguf_path):
    from specserve.model.gguf_loader import load_gguf_config, read_gguf

    gf = read_gguf(gguf_path)
    del gf.metadata["llama.vocab_size"], gf.metadata["tokenizer.ggml.tokens"]
    gf.tensors = [t for t in gf.tensors if t.name != "token_embd.weight"]
    with pytest.raises(ValueError, match="vocabulary size is unknown"):
        load_gguf_config(gguf_path, gf)


@pytest.mark.parametrize("alignment", [0, 7])
def test_a_gguf_alignment_that_is_not_a_power_of_two_is_refused(tmp_path, alignment):
    import gguf

    path = str(tmp_path / "a.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("general.alignment", alignment)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert "general.alignment" in _refused(model_path=path)


@pytest.mark.parametrize("ggml_type", ["I32", "F64", "Q8_1", "Q8_K"])
def test_a_gguf_tensor_type_gguf_cannot_dequantize_is_refused_naming_tensor_and_type(
    tmp_path, gguf_path, ggml_type
):
    """(they passed the table's check and failed while loading, in the gguf package)"""
    import gguf

    first = gguf.GGUFReader(gguf_path).tensors[0]
    # a tensor table entry: name length, name, n_dims, dims, type, data offset
    at = first.field.offset + sum(part.nbytes for part in first.field.parts[:-2])
    data = bytearray(open(gguf_path, "rb").read())
    data[at : at + 4] = int(gguf.GGMLQuantizationType[ggml_type]).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    error = _refused(model_path=str(bad))
    assert first.name in error and ggml_type in error and "supported: " in error
    assert "Q8_0" in error.split("supported: ")[1]


# ---- EAGLE / EAGLE3 draft checkpoints -------------------------------------------------------
def _truncate(folder: str) -> None:
    path = f"{folder}/model.safetensors"
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _corrupt_bin(folder: str) -> None:
    os.remove(f"{folder}/model.safetensors")
    open(f"{folder}/pytorch_model.bin", "wb").write(b"not a checkpoint")


def _config(**changes):
    def edit(folder: str) -> None:
        path = f"{folder}/config.json"
        cfg = {**json.load(open(path)), **changes}
        json.dump(cfg, open(path, "w"))

    return edit


@pytest.mark.parametrize(
    "algorithm, corrupt, named",
    [
        ("EAGLE", _truncate, "model.safetensors"),
        ("EAGLE", _corrupt_bin, "pytorch_model.bin"),
        ("EAGLE3", _config(draft_vocab_size=-5), "draft_vocab_size"),
        ("EAGLE3", _config(draft_vocab_size="64"), "draft_vocab_size"),
        ("EAGLE3", _config(eagle_config=[1]), "eagle_config"),
        (
            "EAGLE3",
            _config(eagle_config={"eagle_aux_hidden_state_layer_ids": ["0", "1", "0"]}),
            "eagle_aux_hidden_state_layer_ids",
        ),
        ("EAGLE", _config(num_attention_heads="4"), "num_attention_heads"),
    ],
)
def test_a_malformed_draft_checkpoint_is_refused_naming_the_draft_and_the_fault(
    tmp_path, algorithm, corrupt, named
):
    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
    from tests.engine_utils import TINY

    folder = write_random_eagle_checkpoint(
        str(tmp_path / "d"), PRESETS["tiny"], algorithm, draft_vocab_size=64
    )
    corrupt(folder)
    error = _refused(
        "speculative_draft_model_path",
        **TINY,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=folder,
    )
    assert named in error


def test_a_draft_with_null_num_key_value_heads_has_one_per_query_head(tmp_path):
    """(it crashed building the head's attention)"""
    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import (
        load_eagle_head,
        write_random_eagle_checkpoint,
    )

    tiny = PRESETS["tiny"]
    mha = tiny.with_changes(num_kv_heads=tiny.num_heads)
    folder = write_random_eagle_checkpoint(str(tmp_path / "d"), mha, "EAGLE")
    _config(num_key_value_heads=None)(folder)
    target = types.SimpleNamespace(
        config=mha,
        model=types.SimpleNamespace(embed_tokens=torch.nn.Embedding(mha.vocab_size, 64)),
        lm_head_weight=torch.zeros(mha.vocab_size, 64),
    )
    head, _ = load_eagle_head(folder, "EAGLE", target)
    assert head.config.num_kv_heads == tiny.num_heads


# ---- tokenizers ---------------------------------------------------------------------------
def test_a_tokenizer_config_that_is_not_an_object_is_refused_naming_it(tmp_path, hf_model):
    from tests.model_factory import write_tokenizer

    folder = str(tmp_path / "m")
    shutil.copytree(hf_model, folder)
    write_tokenizer(folder, 256)
    open(f"{folder}/tokenizer_config.json", "w").write("[]")
    error = _refused(model_path=folder, skip_tokenizer_init=False)
    assert "tokenizer_config.json must hold a JSON object" in error


def test_a_gguf_tokenizer_transformers_cannot_build_is_refused_naming_the_argument(tmp_path):
    """Merges of the wrong form raised a TypeError from the tokenizers binding."""
    import gguf

    from tests.engine_utils import TINY

    path = str(tmp_path / "tok.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    w.add_token_types([gguf.TokenType.NORMAL] * 5)
    w.add_token_merges(["a"])
    w.add_bos_token_id(1), w.add_eos_token_id(2)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    error = _refused(
        "tokenizer_path", **{**TINY, "skip_tokenizer_init": False}, tokenizer_path=path
    )
    assert "tokenizer.ggml" in error
