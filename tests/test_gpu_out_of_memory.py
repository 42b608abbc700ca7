"""Out-of-memory retraction on CUDA: the caching allocator's own error (a real allocation too
large for the device), raised in a decode step or a prefill of an engine replaying CUDA
graphs, retracts the started requests; they finish as they would have, and the engine keeps
serving."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from tests.engine_utils import GPU_TINY, mixed_prompts, spec_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def allocate_too_much() -> None:
    """Ask the CUDA allocator for more than any device holds: it raises OutOfMemoryError."""
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")


def run(prompts, sp, most_in_decode: int | None = None, prefill_once: bool = False, **kw):
    with Engine(**dict(GPU_TINY, debug_check_invariants=True, **kw)) as e:
        worker, raised = e.core.worker, []
        launch, prefill = worker.launch_decode, worker.prefill

        def launch_decode(reqs, *args, **kwargs):
            if most_in_decode is not None and len(reqs) > most_in_decode:
                raised.append(len(reqs))
                allocate_too_much()
            return launch(reqs, *args, **kwargs)

        def prefill_first_batch(chunks):
            if prefill_once and len(chunks) > 1 and not raised:
                raised.append(len(chunks))
                allocate_too_much()
            return prefill(chunks)

        worker.launch_decode, worker.prefill = launch_decode, prefill_first_batch
        outs = e.generate(input_ids=prompts, sampling_params=sp)
        stats = e.stats()
        assert e.failure is None and stats["kv_used_tokens"] == 0
        assert worker.graphs is not None and worker.graphs.num_captures > 0
    return [o["output_ids"] for o in outs], stats, raised


@pytest.mark.parametrize("tree", [None, ("tiny", 4, 3, 10)])
def test_a_decode_step_out_of_memory_on_cuda_retracts_and_outputs_stay_the_same(tree):
    prompts = mixed_prompts(8, 512, seed=41, min_len=2, max_len=30)
    kw = dict(page_size=4, max_running_requests=8)
    if tree:
        kw.update(spec_args(*tree))
    sampled = [dict(GREEDY, temperature=0.7, seed=i) if i % 2 else GREEDY for i in range(8)]
    want, _, _ = run(prompts, sampled, **kw)
    got, stats, raised = run(prompts, sampled, most_in_decode=3, **kw)
    assert got == want
    assert raised and stats["num_out_of_memory_retractions"] >= 1
    assert stats["max_running_requests"] <= 3


def test_a_prefill_out_of_memory_on_cuda_is_retried_and_outputs_stay_the_same():
    prompts = mixed_prompts(6, 512, seed=43, min_len=4, max_len=40)
    want, _, _ = run(prompts, GREEDY, max_running_requests=6)
    got, stats, raised = run(prompts, GREEDY, prefill_once=True, max_running_requests=6)
    assert got == want
    assert raised and stats["num_out_of_memory_retractions"] == 1
