"""On CUDA, with decode graphs replayed: a request the KV cache cannot hold with its tree's
window, left alone, decodes plainly to where plain decoding with the same cache ends (its
tree's other positions written into the scratch page through the replayed graph)."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import GPU_TINY, spec_args

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = {"temperature": 0.0, "max_new_tokens": 60, "ignore_eos": True}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("adaptive", [False, True])
def test_a_lone_request_outgrowing_the_cache_ends_where_plain_decoding_does(
    tmp_path, page_size, adaptive
):
    eagle = write_random_eagle_checkpoint(str(tmp_path / "e"), PRESETS["tiny"], "EAGLE", seed=2)
    args = dict(GPU_TINY, context_length=128, page_size=page_size, max_total_tokens=72)
    prompts = [list(range(10, 50)), list(range(60, 75))]  # (the second one waits, retracted)
    with Engine(**args) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    spec = spec_args(eagle, 4, 3, 10, speculative_adaptive=adaptive)
    with Engine(**args, **spec) as e:
        got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert got == want
        assert e.stats()["num_decoded_plainly_to_fit"] >= 1
        assert e.stats()["num_graph_captures"] > 0
        e.flush_cache()
        e.core.check_invariants()
        alloc = e.core.table.allocator
        assert alloc.num_free_pages == alloc.num_usable_pages
