"""Our Llama-family model against Hugging Face transformers on the same weights (float32).

Tiny random models are saved by transformers itself (tests/model_factory.py), loaded by our
loader, and compared: logits of prefill, of decode steps after a prefill, of a prompt fed in
three chunks over its cached prefix, of several requests in one flat batch; the residual
stream captured for chosen layers; and greedy tokens of the Engine against `generate`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve import Engine, InvalidArgument
from tests.model_factory import (
    SequenceRunner,
    hf_greedy,
    load_hf_model,
    load_ours,
    random_prompt,
    write_hf_model,
)

VOCAB = 256
VARIANTS = {
    "llama": dict(arch="llama"),
    "llama_tied": dict(arch="llama", tie_word_embeddings=True, seed=1),
    # theta 100 at head_dim 16 puts frequencies in all three llama3 bands (kept, blended,
    # divided by 8) with wavelengths the short test prompts actually rotate through.
    "llama3_rope": dict(arch="llama", rope_scaling_llama3=True, rope_theta=100.0, seed=2),
    "qwen2": dict(arch="qwen2", seed=3),
    # head_dim 32 with hidden 64 and 4 heads: q/o widths differ from hidden_size.
    "qwen3": dict(arch="qwen3", head_dim=32, seed=4),
    "sharded": dict(arch="llama", sharded=True, num_layers=3, seed=5),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """variant name -> (folder, transformers model); written once per module."""
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(name: str):
        if name not in cache:
            folder = write_hf_model(
                tmp_path_factory.mktemp(name), vocab_size=VOCAB, **VARIANTS[name]
            )
            cache[name] = (folder, load_hf_model(folder))
        return cache[name]

    return get


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(ours, ref, atol=1e-4 * scale, rtol=0)


@torch.no_grad()
def hf_full(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_decode_and_chunked_prefill_match_transformers(model_dir, variant):
    folder, hf = model_dir(variant)
    ours = SequenceRunner(load_ours(folder))
    prompt = random_prompt(21, VOCAB, seed=1)
    follow = random_prompt(4, VOCAB, seed=2)
    ref = hf_full(hf, prompt + follow)

    # prefill, then one token at a time
    got = [ours.extend({"a": prompt})["a"]]
    for t in follow:
        got.append(ours.extend({"a": [t]})["a"])
    assert_logits_close(torch.cat(got), ref)

    # the same prompt in three chunks, each attending to the cached chunks before it
    chunks = [prompt[:6], prompt[6:15], prompt[15:]]
    got = [ours.extend({"b": c})["b"] for c in chunks]
    assert_logits_close(torch.cat(got), ref[: len(prompt)])


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_mixed_flat_batch_matches_transformers(model_dir, variant):
    """A prefill, a chunk over a cached prefix and a decode token in one forward."""
    folder, hf = model_dir(variant)
    ours = SequenceRunner(load_ours(folder))
    p = {
        k: random_prompt(n, VOCAB, seed=10 + i) for i, (k, n) in enumerate(zip("abc", (9, 17, 12)))
    }
    ours.extend({"b": p["b"][:10], "c": p["c"][:11]})
    out = ours.extend({"a": p["a"], "b": p["b"][10:], "c": p["c"][11:]})
    assert_logits_close(out["a"], hf_full(hf, p["a"]))
    assert_logits_close(out["b"], hf_full(hf, p["b"])[10:])
    assert_logits_close(out["c"], hf_full(hf, p["c"])[11:])


def test_llama3_scaling_is_exercised(model_dir, tmp_path):
    """The llama3 variant's logits differ clearly from the same weights without scaling, so
    the parity test above would catch scaling being ignored or misapplied."""
    folder, hf = model_dir("llama3_rope")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 100.0}
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            os.symlink(os.path.join(folder, name), plain / name)
    (plain / "config.json").write_text(json.dumps(cfg))
    prompt = random_prompt(24, VOCAB, seed=3)
    scaled = SequenceRunner(load_ours(folder)).extend({"a": prompt})["a"]
    unscaled = SequenceRunner(load_ours(plain)).extend({"a": prompt})["a"]
    assert (scaled - unscaled).abs().max() > 1e-2
    assert_logits_close(unscaled, hf_full(load_hf_model(plain), prompt))


def test_capture_layers_returns_residual_entering_each_layer(tmp_path):
    folder = write_hf_model(tmp_path / "m", num_layers=4, vocab_size=VOCAB, seed=7)
    hf = load_hf_model(folder)
    ours = SequenceRunner(load_ours(folder))
    prompt, nxt = random_prompt(13, VOCAB, seed=4), random_prompt(1, VOCAB, seed=5)
    with torch.no_grad():
        states = hf(torch.tensor([prompt + nxt]), output_hidden_states=True).hidden_states
    layers = frozenset({0, 2, 3})
    for sl, toks in ((slice(0, 13), prompt), (slice(13, 14), nxt)):
        out = ours.extend({"a": toks}, capture_layers=layers)["_output"]
        assert len(out.aux_hidden) == len(layers)
        for h, layer in zip(out.aux_hidden, sorted(layers)):
            torch.testing.assert_close(h.float(), states[layer][0, sl], atol=1e-5, rtol=1e-5)
        # the final hidden (after the last norm) is HF's last hidden state
        torch.testing.assert_close(out.hidden.float(), states[-1][0, sl], atol=1e-5, rtol=1e-5)
    # nothing captured unless asked
    assert ours.extend({"b": prompt})["b"].shape == (13, VOCAB)


ENGINE_PROMPTS = [random_prompt(n, VOCAB, seed=20 + n) for n in (5, 23, 40)]
ENGINE_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def generate_refs(model_dir):
    """variant -> transformers' greedy continuations of ENGINE_PROMPTS (computed once)."""
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            hf = model_dir(name)[1]
            cache[name] = [hf_greedy(hf, p, ENGINE_NEW_TOKENS) for p in ENGINE_PROMPTS]
        return cache[name]

    return get


@pytest.mark.parametrize("page_size", [1, 5])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engine_greedy_matches_transformers_generate(model_dir, generate_refs, variant, page_size):
    folder, _ = model_dir(variant)
    prompts, refs = ENGINE_PROMPTS, generate_refs(variant)
    params = {"temperature": 0, "max_new_tokens": ENGINE_NEW_TOKENS, "ignore_eos": True}
    with Engine(
        model_path=folder,
        dtype="float32",
        device="cpu",
        skip_tokenizer_init=True,
        page_size=page_size,
        chunked_prefill_size=8,  # the 40-token prompt runs in five chunks
        max_total_tokens=512,
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == refs


def test_engine_text_and_chat_use_the_folder_tokenizer(tmp_path):
    folder = write_hf_model(tmp_path / "m", vocab_size=320, with_tokenizer=True, seed=8)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    hf = load_hf_model(folder)
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with Engine(model_path=folder, dtype="float32", device="cpu", max_total_tokens=256) as e:
        text = "the quick brown fox"
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        out = e.generate(prompt=text, sampling_params=params)
        assert out["output_ids"] == hf_greedy(hf, ids, 8)
        assert out["text"] == tok.decode(out["output_ids"])
        chat = e.tokenize_chat(messages)
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert chat == list(expected)
    assert tok.decode(chat).endswith("<|im_start|>assistant\n")


def test_an_eos_listed_in_generation_config_alone_stops_as_in_transformers(tmp_path):
    """Instruct models often list their end-of-turn token in generation_config.json alone;
    transformers' generate stops at it, and so must the engine."""
    folder = write_hf_model(tmp_path / "m", vocab_size=97)
    prompt, greedy = [5, 9, 11, 3, 7], {"temperature": 0, "max_new_tokens": 12}
    args = dict(model_path=folder, skip_tokenizer_init=True, dtype="float32", device="cpu")
    with Engine(**args) as e:
        free = e.generate(input_ids=prompt, sampling_params={**greedy, "ignore_eos": True})
    stop = next(t for t in free["output_ids"][2:] if t != 2)
    path = os.path.join(folder, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    with open(path, "w") as f:
        json.dump({**gen, "eos_token_id": [2, stop]}, f)
    hf = load_hf_model(folder)
    ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0)[
        0, len(prompt) :
    ].tolist()
    with Engine(**args) as e:
        out = e.generate(input_ids=prompt, sampling_params=greedy)
    assert ref[-1] == stop and len(ref) < 12  # (transformers stopped there)
    assert out["output_ids"] == ref
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    with open(path, "w") as f:
        json.dump({**gen, "eos_token_id": "two"}, f)
    with pytest.raises(InvalidArgument, match="eos_token_id must be an integer") as e:
        Engine(**args)
    assert e.value.field == "model_path"
