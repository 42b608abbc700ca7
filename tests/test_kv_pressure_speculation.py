"""A KV cache too small for a request's speculative window near its end: the request, left
alone, decodes plainly from there (its tree's other positions written into the scratch page),
so its output is the one plain decoding gives with the same cache, never shorter; and the
longest prompt a speculative engine takes is a plain engine's."""

from __future__ import annotations

import random

import pytest

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, spec_args

GREEDY = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("eagle")), PRESETS["tiny"], "EAGLE", seed=1
    )


def outputs(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], dict]]:
    got = engine.generate(input_ids=prompts, sampling_params=[GREEDY] * len(prompts))
    return [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in got]


def assert_all_pages_free(engine: Engine) -> None:
    engine.flush_cache()
    engine.core.check_invariants()
    alloc = engine.core.table.allocator
    assert alloc.num_free_pages == alloc.num_usable_pages


@pytest.mark.parametrize("page_size, budget", [(1, 40), (16, 36), (5, 45)])
@pytest.mark.parametrize("tree", ["chain 16", "tree 2/4/10", "eagle 3/4/10"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_lone_request_outgrowing_the_cache_ends_where_plain_decoding_does(
    eagle, page_size, budget, tree, overlap
):
    kind, shape = tree.split()
    steps, topk, ndt = (16, 1, 17) if shape == "16" else map(int, shape.split("/"))
    draft = eagle if kind == "eagle" else "tiny"
    args = dict(TINY, context_length=64, page_size=page_size, max_total_tokens=budget,
                disable_overlap_schedule=not overlap)  # fmt: skip
    prompt = list(range(10, 34))  # 24 tokens: with 40 more, more than the cache holds
    with Engine(**args) as plain:
        want = outputs(plain, [prompt])
    with Engine(**args, **spec_args(draft, topk, steps, ndt), debug_check_invariants=True) as e:
        # (the longest prompt is a plain engine's too; a standalone draft keeps its root)
        longest = plain.core.scheduler.max_prompt_tokens() - (kind != "eagle")
        assert e.core.scheduler.max_prompt_tokens() == longest
        got = outputs(e, [prompt])
        assert got == want, (got, want)
        assert e.stats()["num_decoded_plainly_to_fit"] == 1
        assert_all_pages_free(e)


@pytest.mark.parametrize("seed", [0, 1])
def test_requests_under_pressure_with_adaptive_speculation_and_the_cache(eagle, seed):
    """Retractions, plain-to-fit tails, the prefix cache and load-adaptive speculation
    together: outputs equal a plain engine's with the same cache."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 25))] for _ in range(6)]
    prompts.append(prompts[0] + [7, 8])  # (a prefix the cache holds)
    args = dict(TINY, context_length=64, page_size=rng.choice([1, 4]), max_total_tokens=48)
    with Engine(**args) as plain:
        want = outputs(plain, prompts)
    spec = spec_args(eagle, 4, 3, 10, speculative_adaptive=True)
    with Engine(**args, **spec, debug_check_invariants=True) as e:
        assert outputs(e, prompts) == want
        assert e.stats()["num_decoded_plainly_to_fit"] >= 1
        assert_all_pages_free(e)
