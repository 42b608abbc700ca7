"""Deterministic inference on CUDA in bf16, on the packaged SmolLM2 with its bundled draft:
greedy speculative output (the served tree and a chain) equals plain output token for token,
and a prompt's output alone equals its output inside a batch (the prefix cache on, so the
alone runs also start from cached chat-template pages).

    bash bench/gpu_tests.sh -k deterministic -m ""      # or:
    python3 -m pytest -q -m "" tests/test_gpu_deterministic.py
"""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from specserve import Engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bf16 kernels)"),
]

N_PROMPTS = 48
GREEDY = {"temperature": 0.0, "max_new_tokens": 128}
# a fixed KV size: the previous engine's memory may not be collected yet
DET = dict(enable_deterministic_inference=True, dtype="bfloat16", max_total_tokens=1 << 16)
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)


def heldout_prompts(n: int) -> list[str]:
    text = resources.files("specserve").joinpath("data/heldout_prompts.jsonl").read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()][:n]


@pytest.fixture(scope="module")
def chats() -> list[list[int]]:
    with Engine(**DET, no_default_draft=True) as e:  # the tokenizer only
        return [
            e.tokenize_chat([{"role": "user", "content": p}]) for p in heldout_prompts(N_PROMPTS)
        ]


def generate(prompts: list[list[int]], **kw) -> list[list[int]]:
    with Engine(**DET, **kw) as e:
        return [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def plain(chats) -> list[list[int]]:
    return generate(chats, no_default_draft=True)


def _mismatches(got, want) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, want)) if a != b]


@pytest.mark.parametrize("shape", ["served_tree", "chain"])
def test_speculative_output_equals_plain_output_bf16(chats, plain, shape):
    with Engine(**DET, **(CHAIN if shape == "chain" else {})) as e:
        assert e.core.cfg.speculative_algorithm is not None, "the bundled draft did not load"
        assert e.core.cfg.kernels.batch_invariant_matmul
        outs = e.generate(input_ids=chats, sampling_params=GREEDY)
    got = [o["output_ids"] for o in outs]
    accept = [o["meta_info"].get("spec_accept_length", 1.0) for o in outs]
    assert sum(accept) / len(accept) > 1.2, "the draft accepted nothing: not a test of verify"
    bad = _mismatches(got, plain)
    assert not bad, f"{len(bad)}/{len(chats)} speculative answers differ from plain: {bad}"


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "served_tree"])
def test_prompt_alone_equals_prompt_in_a_batch_bf16(chats, plain, spec):
    batch = chats[:16]
    kw = {} if spec else {"no_default_draft": True}
    with Engine(**DET, **kw) as e:
        together = [o["output_ids"] for o in e.generate(input_ids=batch, sampling_params=GREEDY)]
        alone = [
            e.generate(input_ids=[p], sampling_params=GREEDY)[0]["output_ids"] for p in batch[:6]
        ]
    bad = _mismatches(together, plain[:16])
    assert not bad, f"batch of 16 differs from the batch of {len(chats)} at {bad}"
    bad = _mismatches(alone, together)
    assert not bad, f"prompts {bad} decode differently alone than in a batch of 16"
