"""Sampling parameters at their edges, as a user of vLLM or SGLang relies on them."""

from __future__ import annotations

import pytest

from specserve import Engine
from tests.engine_utils import TINY

SAMPLED = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    with Engine(**TINY) as e:
        yield e


def draw(engine, seed: int) -> list[int]:
    return engine.generate(input_ids=[5, 6, 7, 8], sampling_params=dict(SAMPLED, seed=seed))[
        "output_ids"
    ]


@pytest.mark.parametrize(
    "seed, other",
    [
        (3, 3 + 2**32),  # seeds that differ only above their low 32 bits
        (7, 7 + 5 * 2**32),
        (2**32 - 1, -1),  # -1 is 2**63 - 1 modulo 2**63: same low 32 bits
        (0, 2**62),
    ],
)
def test_distinct_seeds_draw_distinct_samples(engine, seed, other):
    """Every seed in [-2**63, 2**63) names its own stream (docs: drawn modulo 2**63): a seed
    that differs from another only in its high bits (e.g. `run << 32 | trial`) must not
    repeat that one's sample."""
    assert draw(engine, seed) != draw(engine, other)


def test_n_samples_past_2_32_do_not_repeat_a_small_seeds_sample(engine):
    """With n > 1, sample i draws with seed + i: from 2**32 - 1 that is 2**32, which must not
    draw what seed 0 draws; and it is still the same request with seed + i and n = 1."""
    seed = 2**32 - 1
    outs = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=dict(SAMPLED, seed=seed, n=2))
    assert [o["output_ids"] for o in outs] == [draw(engine, seed + i) for i in range(2)]
    assert outs[1]["output_ids"] != draw(engine, 0)
