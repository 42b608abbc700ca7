"""Log-probs on CUDA: decode steps replayed from CUDA graphs (keyed by the log-prob mode)
report what eager steps report, speculative or not, without host syncs inside the step."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from tests.engine_utils import GPU_TINY, mixed_prompts, wait_for_idle_captures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU = GPU_TINY
SPEC = dict(
    speculative_algorithm="STANDALONE",
    speculative_draft_model_path="tiny",
    speculative_num_steps=3,
    speculative_eagle_topk=4,
    speculative_num_draft_tokens=8,
)
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}


def run(prompts, **kw):
    with Engine(**GPU, **kw) as e:
        graphs = e.core.worker.graphs
        at_start = (
            set(graphs.graphs) if graphs is not None else set()
        )  # (greedy and sampled, no log-probs)
        for _ in range(2):  # the second run replays the graphs of every shape the first met
            outs = e.generate(
                input_ids=prompts,
                sampling_params=GREEDY,
                return_logprob=True,
                top_logprobs_num=5,
                logprob_start_len=0,
            )
            if graphs is not None:
                wait_for_idle_captures(graphs, timeout=120)
        if graphs is not None:
            keys = [k for k in graphs.graphs if k not in at_start]  # those the requests met
            assert keys and all(k[4:6] == (True, 8) for k in keys)  # (log-probs, top-k)
    return outs


@pytest.mark.parametrize("spec", [False, True])
def test_graph_replays_report_eager_logprobs(spec):
    prompts = mixed_prompts(4, 512, seed=9)
    extra = SPEC if spec else {}
    graphed = run(prompts, **extra)
    eager = run(prompts, disable_cuda_graph=True, **extra)
    for g, e in zip(graphed, eager):
        assert g["output_ids"] == e["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            got = [v for v, _, _ in g["meta_info"][key] if v is not None]
            want = [v for v, _, _ in e["meta_info"][key] if v is not None]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
        assert [[t for _, t, _ in top] for top in g["meta_info"]["output_top_logprobs"]] == [
            [t for _, t, _ in top] for top in e["meta_info"]["output_top_logprobs"]
        ]
