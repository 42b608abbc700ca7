"""Checkpoints as users get them: every quantization type a GGUF may hold, weight or
tokenizer files that are truncated, corrupt or not there at all (a Git LFS pointer), and
checkpoints this engine cannot compute (quantized safetensors, values out of range), each
refused naming what the user wrote."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest

from specserve import Engine, InvalidArgument
from specserve.model.gguf_loader import read_gguf
from tests.model_factory import write_gguf_model, write_hf_model

LOAD = dict(device="cpu", dtype="float32")
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:0123abcd\nsize 12345\n"
# (what llama.cpp quantizes to; each row below is three blocks of the type)
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
QTYPES += ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _refused(**kwargs) -> str:
    with pytest.raises(InvalidArgument) as info:
        Engine(**{**LOAD, **kwargs})
    assert info.value.field == "model_path", str(info.value)
    return str(info.value)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("hf") / "m", sharded=True, vocab_size=300)


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("hf") / "t", vocab_size=300, with_tokenizer=True)


# ---- quantization types --------------------------------------------------------------------
def test_every_quantization_type_dequantizes_as_the_gguf_package_does(tmp_path):
    """Random bytes per block (any scale, any quant): the values must be those of
    `gguf.quants.dequantize`, whole and in a tensor-parallel rank's rows or block columns."""
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    path = str(tmp_path / "q.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for name in QTYPES:
        qtype = gguf.GGMLQuantizationType[name]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (4, 3 * type_size), dtype=np.uint8)
        if name == "F32":  # (random bytes include NaNs, which compare unequal)
            raw = rng.standard_normal((4, 3), dtype=np.float32).view(np.uint8)
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    ours = read_gguf(path)
    reference = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert [t.name for t in ours.tensors] == QTYPES
    for t in ours.tensors:
        ref = reference[t.name]
        block = gguf.GGML_QUANT_SIZES[ref.tensor_type][0]
        with np.errstate(invalid="ignore", over="ignore"):  # (random scales: inf * 0)
            expected = dequantize(ref.data, ref.tensor_type).reshape(t.shape)
            got = ours.tensor_float32(t)
            rows = ours.tensor_float32(t, (0, 1, 3))
            cols = ours.tensor_float32(t, (1, block, 3 * block))
        assert got.shape == (4, 3 * block), t.name
        np.testing.assert_array_equal(got, expected, err_msg=t.name)
        np.testing.assert_array_equal(rows, expected[1:3], err_msg=t.name)
        np.testing.assert_array_equal(cols, expected[:, block:], err_msg=t.name)


# ---- weight files that are not whole ---------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "corrupt_header"])
def test_a_damaged_safetensors_shard_is_refused_naming_the_file(tmp_path, sharded, damage):
    """safetensors' own error names no file: of four shards, the user could not tell which
    one to download again."""
    folder = str(tmp_path / "m")
    shutil.copytree(sharded, folder)
    shard = os.path.join(folder, "model-00003-of-00004.safetensors")
    data = open(shard, "rb").read()
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # a byte of the JSON header that is no UTF-8
        data = data[:20] + b"\xff" + data[21:]
    open(shard, "wb").write(data)
    error = _refused(model_path=folder, skip_tokenizer_init=True)
    assert "model-00003-of-00004.safetensors cannot be read as safetensors" in error


def test_a_git_lfs_pointer_in_place_of_a_safetensors_file_is_refused_saying_so(tmp_path, sharded):
    folder = str(tmp_path / "m")
    shutil.copytree(sharded, folder)
    open(os.path.join(folder, "model-00002-of-00004.safetensors"), "w").write(LFS_POINTER)
    error = _refused(model_path=folder, skip_tokenizer_init=True)
    assert "model-00002-of-00004.safetensors" in error and "Git LFS pointer" in error


def test_a_git_lfs_pointer_in_place_of_a_gguf_file_is_refused_saying_so(tmp_path):
    path = str(tmp_path / "m.gguf")
    open(path, "w").write(LFS_POINTER)
    error = _refused(model_path=path, skip_tokenizer_init=True)
    assert path in error and "Git LFS pointer" in error


# ---- tokenizers whose vocabulary does not hold together -------------------------------------
def test_a_tokenizer_json_merging_a_token_it_lacks_is_refused_naming_the_folder(
    tmp_path, with_tokenizer
):
    """The tokenizers binding raised a bare Exception ('Token `h` out of vocabulary')."""
    folder = str(tmp_path / "m")
    shutil.copytree(with_tokenizer, folder)
    tok = json.load(open(f"{folder}/tokenizer.json"))
    first = tok["model"]["merges"][0]
    del tok["model"]["vocab"][first[0] if isinstance(first, list) else first.split()[0]]
    json.dump(tok, open(f"{folder}/tokenizer.json", "w"))
    error = _refused(model_path=folder)
    assert folder in error and "tokenizer.json" in error and "out of vocabulary" in error


def test_a_gguf_token_list_missing_a_merged_token_is_refused_naming_the_file(
    tmp_path, with_tokenizer
):
    import gguf

    path, _ = write_gguf_model(tmp_path / "m.gguf", with_tokenizer)
    reader = gguf.GGUFReader(path)
    merges = reader.fields["tokenizer.ggml.merges"]
    first = bytes(merges.parts[merges.data[0]]).decode().split()[0]
    tokens = reader.fields["tokenizer.ggml.tokens"]
    index = next(i for i in tokens.data if bytes(tokens.parts[i]).decode() == first)
    with open(path, "r+b") as f:  # rename the token in place (same length): the file stays whole
        f.seek(_offset_of(reader, tokens.parts[index]))
        f.write(b"\x01" * len(first.encode()))
    error = _refused(model_path=path)
    assert path in error and "tokenizer.ggml" in error and "out of vocabulary" in error


def _offset_of(reader, part: np.ndarray) -> int:
    """Byte offset in the file of a view `GGUFReader` returned into its memory map."""
    return part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]


# ---- checkpoints this engine cannot compute, named as the user wrote them ---------------------
def _edit_config(folder: str, **values) -> str:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(values)
    with open(path, "w") as f:
        json.dump(cfg, f)  # (json writes float("inf") as Infinity, as it reads it)
    return folder


def _edit_tensors(folder: str, edit) -> str:
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("dtype", ["int32", "float8_e4m3fn", "int8"])
def test_a_quantized_or_integer_weight_is_refused_naming_the_tensor_and_its_dtype(tmp_path, dtype):
    """Cast to float, such a tensor would run as garbage weights (its scales elsewhere)."""
    import torch

    def quantize(state):
        name = "model.layers.0.mlp.down_proj.weight"
        state[name] = state[name].to(getattr(torch, dtype))

    message = _refused(model_path=_edit_tensors(write_hf_model(tmp_path / "m"), quantize))
    assert "down_proj" in message and dtype in message and "quantized" in message, message


def test_a_quantized_piece_of_a_fused_weight_is_refused_naming_it(tmp_path):
    """q/k/v and gate/up are stacked into one parameter on load: each piece is checked."""
    import torch

    def quantize(state):
        name = "model.layers.1.mlp.up_proj.weight"
        state[name] = state[name].to(torch.int8)

    message = _refused(model_path=_edit_tensors(write_hf_model(tmp_path / "m"), quantize))
    assert "up_proj" in message and "int8" in message, message


def test_a_quantization_config_is_refused_naming_it(tmp_path):
    folder = _edit_config(
        write_hf_model(tmp_path / "m"), quantization_config={"quant_method": "fp8"}
    )
    message = _refused(model_path=folder)
    assert "quantization_config" in message and "fp8" in message, message


def test_an_extra_projection_tensor_is_named_as_the_checkpoint_names_it(tmp_path):
    """Not as the engine's fused q/k/v parameter, which is in no file the user has."""
    import torch

    def add_bias(state):
        state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)

    message = _refused(model_path=_edit_tensors(write_hf_model(tmp_path / "m"), add_bias))
    assert "'model.layers.0.self_attn.q_proj.bias'" in message and "qkv_proj" not in message


@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta"])
def test_an_infinite_norm_epsilon_or_rope_base_is_refused_naming_it(tmp_path, key):
    message = _refused(model_path=_edit_config(write_hf_model(tmp_path / "m"), **{key: math.inf}))
    assert f"{key} must be a positive finite number" in message, message


def test_a_vocabulary_too_large_to_allocate_is_refused_naming_the_model_path(tmp_path):
    folder = _edit_config(write_hf_model(tmp_path / "m"), vocab_size=10**13)
    message = _refused(model_path=folder)
    assert "parameters" in message and "could allocate" in message, message


@pytest.mark.parametrize("value", [256, [2, 999]])
def test_an_end_of_text_id_outside_the_vocabulary_is_refused_naming_it(tmp_path, value):
    # (a token the model can never emit would never end a request)
    folder = _edit_config(write_hf_model(tmp_path / "m"), eos_token_id=value)
    message = _refused(model_path=folder)
    assert "eos_token_id" in message and "vocab_size = 256" in message, message


def test_an_end_of_text_id_of_generation_config_outside_the_vocabulary_names_that_file(tmp_path):
    folder = write_hf_model(tmp_path / "m")
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 300]}, f)
    message = _refused(model_path=folder)
    assert "generation_config.json" in message and "vocab_size = 256" in message, message
