"""Two engines in one process on one GPU, used at once from two threads: each captures CUDA
graphs at shapes it meets while the other one serves, allocates and synchronizes."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from specserve import Engine
from tests.engine_utils import GPU_TINY, spec_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPEC = spec_args("tiny", topk=4, steps=3, ndt=8)  # the target as its own draft, a tree


def serve_varied_batches(engine: Engine, seed: int, rounds: int, failures: list):
    """Batches of new sizes and prompt lengths, so that every few calls a step meets a shape
    no graph covers yet (captured while the other engine runs)."""
    rng = random.Random(seed)
    try:
        for _ in range(rounds):
            batch = rng.choice([1, 3, 8, 17, 33])
            prompts = [
                [rng.randrange(1, 500) for _ in range(rng.randrange(4, 700))] for _ in range(batch)
            ]
            want = rng.randrange(4, 60)
            sp = {"temperature": 0.0, "max_new_tokens": want, "ignore_eos": True}
            for out in engine.generate(input_ids=prompts, sampling_params=sp):
                reason = out["meta_info"]["finish_reason"]
                if reason["type"] != "length" or len(out["output_ids"]) != want:
                    failures.append(reason)
    except Exception as e:  # a broken capture surfaces here, as the request's error
        failures.append(repr(e))


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "tree"])
def test_two_engines_capture_while_the_other_serves(draft):
    kwargs = dict(GPU_TINY, max_total_tokens=1 << 15, **(SPEC if draft else {}))
    with Engine(**kwargs) as a, Engine(**kwargs) as b:
        captured_at_start = sum(e.stats()["num_graph_captures"] for e in (a, b))
        failures = []
        threads = [
            threading.Thread(target=serve_varied_batches, args=(e, seed, 12, failures))
            for seed, e in enumerate((a, b))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "an engine stopped answering"
        assert failures == []
        # (the workload did capture while both engines ran)
        assert sum(e.stats()["num_graph_captures"] for e in (a, b)) > captured_at_start
        # both still serve
        for e in (a, b):
            out = e.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
            assert len(out["output_ids"]) == 3
