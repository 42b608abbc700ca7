"""Structured output on CUDA, float32 (exact): with CUDA graphs on (constrained steps run
eagerly), speculative output under a grammar equals plain output under it, and the
unconstrained requests of the same batch decode as they would alone."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from specserve import Engine
from specserve.model.hf_loader import load_hf_config
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.model_factory import write_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        importlib.util.find_spec("xgrammar") is None, reason="needs xgrammar installed"
    ),
]

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
GRAMMARS = [{"regex": "(yes|no|maybe)"}, {"json_schema": SCHEMA}, {"regex": "[a-z]{2,5} [0-9]+"}]
PROMPTS = ["hello world", "the quick brown fox", "What is the capital of France?"]
GREEDY = {"temperature": 0, "max_new_tokens": 24}


def _batch():
    batch = [(p, {**g, **GREEDY}) for p in PROMPTS for g in GRAMMARS]
    return batch + [(p, dict(GREEDY)) for p in PROMPTS]


def test_structured_output_beside_graphs_is_lossless(tmp_path):
    folder = write_hf_model(tmp_path / "m", vocab_size=300, with_tokenizer=True)
    draft = write_random_eagle_checkpoint(str(tmp_path / "d"), load_hf_config(folder), "EAGLE")
    common = dict(model_path=folder, device="cuda", dtype="float32", max_total_tokens=8192)
    tree = dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=draft,
        speculative_num_steps=3,
        speculative_eagle_topk=4,
        speculative_num_draft_tokens=10,
    )
    batch = _batch()
    outputs = []
    for extra in ({}, tree):
        with Engine(**common, **extra) as engine:
            outs = engine.generate(
                prompt=[p for p, _ in batch], sampling_params=[sp for _, sp in batch]
            )
            outputs.append([o["output_ids"] for o in outs])
            alone = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in alone] == outputs[-1][-len(PROMPTS) :]
            assert engine.core.worker.graphs is not None  # (graphs on: constrained steps eager)
    assert outputs[0] == outputs[1]
