"""A step that runs the device out of memory retracts the started requests and runs fewer at
once: every request still finishes with the output it would have had, and only a request that
ran out of memory alone fails, saying so."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.server.metrics import ServerMetrics
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, mixed_prompts, spec_args

GREEDY = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("eagle") / "e"), PRESETS["tiny"], "EAGLE", seed=4
    )


def out_of_memory_above(engine: Engine, most: int) -> list[int]:
    """Make the engine's decode launches raise as a device would with more than `most`
    requests in a step; returns the batch sizes that raised."""
    worker = engine.core.worker
    launch, raised = worker.launch_decode, []

    def launch_decode(reqs, *args, **kwargs):
        if len(reqs) > most:
            raised.append(len(reqs))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return launch(reqs, *args, **kwargs)

    worker.launch_decode = launch_decode
    return raised


def run(prompts, sp, most: int | None, **kw):
    with Engine(**dict(TINY, debug_check_invariants=True, **kw)) as e:
        raised = out_of_memory_above(e, most) if most is not None else []
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        stats = e.stats()
        assert stats["kv_used_tokens"] == 0 and not e.core.requests
        assert e.failure is None
    return [o["output_ids"] for o in outs], [o["meta_info"] for o in outs], stats, raised


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("tree", [None, (4, 3, 10)])
def test_requests_retracted_after_running_out_of_memory_finish_as_they_would_have(
    eagle, overlap, tree
):
    prompts = mixed_prompts(8, 512, seed=31, min_len=2, max_len=30)
    kw = dict(page_size=4, disable_overlap_schedule=not overlap, max_running_requests=8)
    if tree:
        kw.update(spec_args(eagle, *tree))
    sampled = [dict(GREEDY, temperature=0.8, seed=i) if i % 2 else GREEDY for i in range(8)]
    want, _, _, _ = run(prompts, sampled, None, **kw)
    got, meta, stats, raised = run(prompts, sampled, 3, **kw)
    assert got == want
    assert all(m["finish_reason"]["type"] == "length" for m in meta)
    assert raised and stats["num_out_of_memory_retractions"] >= 1
    assert stats["max_running_requests"] <= 3  # (halved until a step fits)


def test_a_request_that_runs_out_of_memory_alone_fails_saying_so_and_the_engine_lives():
    with Engine(**TINY) as e:
        raised = out_of_memory_above(e, 0)
        out = e.generate(input_ids=[3, 4, 5], sampling_params=GREEDY)
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "out of memory running it alone" in reason["message"]
        assert raised == [1] and e.failure is None
        e.core.worker.launch_decode = type(e.core.worker).launch_decode.__get__(e.core.worker)
        again = e.generate(input_ids=[3, 4, 5], sampling_params=GREEDY)
        assert again["meta_info"]["finish_reason"]["type"] == "length"


def test_a_prefill_that_runs_out_of_memory_is_retried_with_fewer_requests():
    prompts = mixed_prompts(6, 512, seed=33, min_len=4, max_len=40)
    want, _, _, _ = run(prompts, GREEDY, None, max_running_requests=6)
    with Engine(**dict(TINY, debug_check_invariants=True, max_running_requests=6)) as e:
        worker = e.core.worker
        prefill, raised = worker.prefill, []

        def prefill_once_too_many(chunks):
            if len(chunks) > 2 and not raised:
                raised.append(len(chunks))
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return prefill(chunks)

        worker.prefill = prefill_once_too_many
        outs = e.generate(input_ids=prompts, sampling_params=GREEDY)
        assert raised and e.stats()["num_out_of_memory_retractions"] == 1
        assert e.stats()["kv_used_tokens"] == 0 and e.failure is None
        metrics = ServerMetrics(e, lambda: {"inflight": 0}).render().decode()
        assert "specserve_out_of_memory_retractions_total 1.0" in metrics
    assert [o["output_ids"] for o in outs] == want
