"""Penalties and logit bias on CUDA, float32 (exact): with CUDA graphs on (a batch holding a
penalized request replays its own graphs and is launched ahead), speculative output equals
plain output, greedy and seeded, and the requests without penalties decode as they would
alone."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from tests.engine_utils import GPU_TINY, mixed_prompts, spec_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}
PENALIZED = [
    {"frequency_penalty": 1.5, "presence_penalty": -0.5},
    {"repetition_penalty": 1.7, "logit_bias": {"7": 3.0, "11": -2.0}},
    {"repetition_penalty": 0.6, "temperature": 0.9, "seed": 3},
]


def test_penalties_beside_graphs_are_lossless():
    prompts = mixed_prompts(6, 512, seed=5, min_len=3, max_len=24)
    params = [dict(GREEDY, **PENALIZED[i // 2]) if i % 2 == 0 else GREEDY for i in range(6)]
    outputs = []
    for extra in ({}, spec_args("tiny", 3, 4, 10), spec_args("tiny", 1, 3, 4)):
        with Engine(**GPU_TINY, **extra) as engine:
            graphs = engine.core.worker.graphs
            at_start = set(graphs.graphs)
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            outputs.append([o["output_ids"] for o in outs])
            assert engine.stats()["num_decode_steps_launched_ahead"] > 0
            # (the sampling mode's last field in a graph's key: penalized)
            assert any(key[7] for key in graphs.graphs), list(graphs.graphs)
            # the penalty tables, attached for the first penalized request, are read by
            # penalized graphs alone: those captured at start are kept
            assert at_start and at_start <= set(graphs.graphs)
            alone = engine.generate(input_ids=prompts[1::2], sampling_params=GREEDY)
            assert [o["output_ids"] for o in alone] == outputs[-1][1::2]
    assert outputs[0] == outputs[1] == outputs[2]
    # (and the penalties changed the penalized requests' outputs)
    with Engine(**GPU_TINY) as engine:
        free = engine.generate(input_ids=prompts[0::2], sampling_params=GREEDY)
    assert [o["output_ids"] for o in free] != outputs[0][0::2]
