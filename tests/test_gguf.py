"""GGUF loading: tiny models written in llama.cpp's layout, every supported weight type.

Each file's logits must equal those of a transformers model holding the file's dequantized
weights (float32), through `load_model` and through the Engine.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from specserve import Engine
from specserve.model.gguf_loader import _unpermute, load_gguf_config, read_gguf
from specserve.model.loader import load_model
from tests.model_factory import (
    GGUF_QTYPES,
    SequenceRunner,
    hf_greedy,
    load_hf_model,
    load_ours,
    permute_qk,
    quantize_q6_k,
    random_prompt,
    write_gguf_model,
    write_hf_model,
)

VOCAB = 512
# Rows of 256 values everywhere (hidden 256, intermediate 512), so that every type, Q6_K's
# 256-value super-blocks included, quantizes every matrix.
SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("hf"), seed=11, **SHAPE)


@pytest.fixture(scope="module")
def gguf_file(hf_folder, tmp_path_factory):
    """qtype -> (path, dequantized state), written once per module."""
    cache: dict[str, tuple[str, dict]] = {}

    def get(qtype: str):
        if qtype not in cache:
            path = tmp_path_factory.mktemp("gguf") / f"tiny-{qtype}.gguf"
            cache[qtype] = write_gguf_model(path, hf_folder, qtype=qtype)
        return cache[qtype]

    return get


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(ours, ref, atol=1e-4 * scale, rtol=0)


@torch.no_grad()
def hf_full(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def prefill_and_decode(path, ids: list[int], n_decode: int = 3) -> torch.Tensor:
    r = SequenceRunner(load_ours(path))
    out = [r.extend({"a": ids[: len(ids) - n_decode]})["a"]]
    out += [r.extend({"a": [t]})["a"] for t in ids[len(ids) - n_decode :]]
    return torch.cat(out)


@pytest.mark.parametrize("qtype", GGUF_QTYPES)
def test_logits_match_transformers_on_dequantized_weights(hf_folder, gguf_file, qtype):
    path, state = gguf_file(qtype)
    meta = read_gguf(path)
    kinds = {t.name: gguf.GGMLQuantizationType(t.ggml_type).name for t in meta.tensors}
    assert kinds["blk.0.attn_q.weight"] == qtype and kinds["token_embd.weight"] == qtype
    assert kinds["blk.0.attn_norm.weight"] == "F32"  # norms stay F32, as in llama.cpp
    hf = load_hf_model(hf_folder, state)
    ids = random_prompt(19, VOCAB, seed=1)
    assert_logits_close(prefill_and_decode(path, ids), hf_full(hf, ids))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_engine_greedy_matches_transformers_generate(hf_folder, gguf_file, qtype):
    path, state = gguf_file(qtype)
    hf = load_hf_model(hf_folder, state)
    prompts = [random_prompt(n, VOCAB, seed=n) for n in (7, 30)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(
        model_path=str(path),
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        page_size=5,
        chunked_prefill_size=16,
        max_total_tokens=256,
    ) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]


def test_quantization_really_happened(hf_folder, gguf_file):
    """Guard on the test itself: the 4-bit weights differ from the originals, so matching
    the dequantized reference is not the same as matching the float model."""
    _, f32 = gguf_file("F32")
    _, q4 = gguf_file("Q4_0")
    w32, w4 = f32["model.layers.0.mlp.up_proj.weight"], q4["model.layers.0.mlp.up_proj.weight"]
    assert 1e-3 < (w32 - w4).abs().max() < 0.1 * w32.abs().max()


def test_qk_permutation_is_undone(hf_folder, tmp_path):
    """A file whose q/k rows were *not* permuted the llama.cpp way must give different
    logits: the loader un-permutes llama q/k (and only those)."""
    w = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    back = _unpermute(torch.from_numpy(permute_qk(w.numpy(), 2)), 2)
    assert torch.equal(back, w) and not torch.equal(torch.from_numpy(permute_qk(w.numpy(), 2)), w)

    hf = load_hf_model(hf_folder)
    ids = random_prompt(12, VOCAB, seed=2)
    ref = hf_full(hf, ids)
    good, _ = write_gguf_model(tmp_path / "good.gguf", hf_folder, qtype="F32")
    bad, _ = write_gguf_model(tmp_path / "bad.gguf", hf_folder, qtype="F32", permute=False)
    assert_logits_close(prefill_and_decode(good, ids), ref)
    assert (prefill_and_decode(bad, ids) - ref).abs().max() > 1e-2


def test_config_fields_are_read(gguf_file):
    path, _ = gguf_file("Q8_0")
    cfg = load_gguf_config(str(path))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (VOCAB, 256, 512)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 64)
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 2048
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert cfg.architecture == "llama"


def test_a_generation_ends_at_the_files_end_of_turn_token_too(hf_folder, tmp_path):
    """Chat models' conversions mark <|im_end|> / <|eot_id|> as tokenizer.ggml.eot_token_id
    beside the eos id; llama.cpp ends a generation at either, and so does the engine."""
    args = dict(skip_tokenizer_init=True, dtype="float32", device="cpu")
    prompt, greedy = [5, 9, 11, 3, 7], {"temperature": 0, "max_new_tokens": 10}
    path, _ = write_gguf_model(tmp_path / "plain.gguf", hf_folder)
    with Engine(model_path=str(path), **args) as e:
        free = e.generate(input_ids=prompt, sampling_params={**greedy, "ignore_eos": True})
    end = next(t for t in free["output_ids"][2:] if t != 2)
    path, _ = write_gguf_model(tmp_path / "chat.gguf", hf_folder, eot_token_id=end)
    assert load_gguf_config(str(path)).eos_token_ids == (2, end)
    with Engine(model_path=str(path), **args) as e:
        out = e.generate(input_ids=prompt, sampling_params=greedy)
    stop = free["output_ids"].index(end)
    assert out["output_ids"] == free["output_ids"][: stop + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": end}


@pytest.mark.parametrize(
    "variant",
    [
        dict(arch="llama", tie_word_embeddings=True),
        dict(arch="llama", rope_scaling_llama3=True, rope_theta=100.0),
        dict(arch="qwen2"),
        dict(arch="qwen3"),
    ],
    ids=["tied", "llama3_rope", "qwen2", "qwen3"],
)
def test_architecture_variants(tmp_path, variant):
    """Tied output (no output.weight), llama3 rope (llama.cpp's rope_freqs tensor), Qwen2
    (qkv bias, no q/k permutation) and Qwen3 (q/k norm) files."""
    folder = write_hf_model(tmp_path / "hf", seed=12, **SHAPE, **variant)
    path, state = write_gguf_model(tmp_path / "m.gguf", folder, qtype="Q8_0")
    cfg = load_gguf_config(str(path))
    assert cfg.architecture == variant["arch"]
    assert cfg.tie_word_embeddings == variant.get("tie_word_embeddings", False)
    assert cfg.attention_bias == (variant["arch"] == "qwen2")
    assert cfg.qk_norm == (variant["arch"] == "qwen3")
    if variant.get("rope_scaling_llama3"):
        assert cfg.rope_scaling is not None and len(cfg.rope_scaling.freq_factors) == 32
        assert cfg.rope_scaling.factor == pytest.approx(8.0)
    ids = random_prompt(20, VOCAB, seed=3)
    assert_logits_close(prefill_and_decode(path, ids), hf_full(load_hf_model(folder, state), ids))


def test_unknown_architecture_raises_a_clear_error(hf_folder, tmp_path):
    path, _ = write_gguf_model(tmp_path / "x.gguf", hf_folder, arch="falcon", qtype="F32")
    with pytest.raises(ValueError, match=r"architecture 'falcon' is not supported.*llama"):
        load_model(str(path), "auto", torch.float32, torch.device("cpu"), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="falcon"):
        Engine(model_path=str(path), dtype="float32", device="cpu", skip_tokenizer_init=True)


def test_a_file_rotating_part_of_each_head_is_refused(hf_folder, tmp_path, monkeypatch):
    """llama.cpp's n_rot (rope.dimension_count) below the head size rotates part of each
    head (Qwen-style partial rotary); the engine rotates all of it, so such a file, which
    loaded and ran every dimension rotated, is refused naming the key."""
    import gguf

    rotated = gguf.GGUFWriter.add_rope_dimension_count

    def half_rotated(self, n):  # (the head size stated as attention.key_length)
        rotated(self, n // 2)
        self.add_key_length(n)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", half_rotated)
    path, _ = write_gguf_model(tmp_path / "half.gguf", hf_folder)
    with pytest.raises(ValueError, match=r"rope.dimension_count is \d+, not the head size"):
        load_model(str(path), "auto", torch.float32, torch.device("cpu"), skip_tokenizer_init=True)


def test_not_a_gguf_file_raises(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_config(str(bad))


def test_reader_agrees_with_gguf_package(gguf_file):
    """Our metadata/tensor-table reader against gguf.GGUFReader on the same file."""
    path, _ = gguf_file("Q4_1")
    ours = read_gguf(str(path), keep_string_arrays=("tokenizer.ggml.tokens",))
    ref = gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        if key == "tokenizer.ggml.merges":  # skipped string array: length only
            assert len(got) == len(want)
        elif isinstance(want, float):
            assert got == pytest.approx(want)
        else:
            assert got == want, key
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.name == b.name and a.ggml_type == int(b.tensor_type)
        assert a.shape == tuple(reversed(b.shape.tolist()))
        got = ours.tensor_float32(a)
        want = dequantize(b.data, b.tensor_type).reshape(a.shape)
        np.testing.assert_array_equal(got, want)


def test_q6_k_writer_round_trips():
    """The factory's Q6_K encoder against gguf's reference decoder (a layout bug would give
    errors of the size of the weights, not of a 6-bit step)."""
    x = np.random.default_rng(0).normal(0, 0.08, (4, 512)).astype(np.float32)
    back = dequantize(quantize_q6_k(x), gguf.GGMLQuantizationType.Q6_K)
    assert np.abs(back - x).max() < np.abs(x).max() / 40


def test_tokenizer_and_chat_template_come_from_the_file(gguf_file):
    from transformers import AutoTokenizer

    path, _ = gguf_file("Q8_0")
    messages = [{"role": "user", "content": "the quick brown fox"}]
    folder, name = os.path.split(path)
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with Engine(model_path=str(path), dtype="float32", device="cpu", max_total_tokens=128) as e:
        assert e.tokenizer.encode("hello world") == ref.encode("hello world")
        chat = e.tokenize_chat(messages)
        params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
        out = e.generate(prompt="hello world", sampling_params=params)
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert chat == list(expected)
    assert ref.decode(chat).startswith("<|im_start|>user\nthe quick brown fox<|im_end|>")
    assert len(out["output_ids"]) == 3
