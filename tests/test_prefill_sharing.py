"""Requests arriving together with a shared prompt prefix compute it once: the later ones wait
for the prefill batch that caches it and start from the cache, with outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.runtime.prefill_sharing import SHARE_MIN_TOKENS, PrefillSharing, common_prefix_len
from specserve.runtime.request import Request
from specserve.sampling_params import SamplingParams
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, spec_args

SP = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def request(rid: str, ids: list[int], cached: int | None = None) -> Request:
    """(A request that may reuse all but its last token.)"""
    r = Request(rid=rid, prompt_ids=list(ids), params=SamplingParams(max_new_tokens=4), seed=0)
    r.cached_tokens = cached
    return r


def test_common_prefix_len_at_every_split_and_limit():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 50, (300,), generator=g).tolist()
    for split in (0, 1, 63, 64, 65, 200, 299):
        b = a[:split] + [a[split] + 1] + a[split + 1 :]
        assert common_prefix_len(a, b, 300) == split
        assert common_prefix_len(a, b, 10) == min(split, 10)
    assert common_prefix_len(a, list(a), 300) == 300


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_a_request_waits_only_for_enough_uncached_shared_tokens(page_size):
    g = torch.Generator().manual_seed(page_size)
    system = torch.randint(0, 1000, (200,), generator=g).tolist()
    sharing = PrefillSharing(page_size)
    sharing.add(request("first", system + [1, 2, 3], cached=0))
    gain = max(SHARE_MIN_TOKENS, page_size)

    def waits(sharing, r, limit=None):
        return sharing.should_wait(r, r.fill_len - 1 if limit is None else limit)

    assert waits(sharing, request("same system", system + [4, 5]))
    # the shared part is short, or the cache already holds all but a little of it
    assert not waits(sharing, request("short", system[: gain - 1] + [9] * 50))
    assert not waits(sharing, request("other", [7] + system))
    # it may not take the shared part from the cache (its prompt log-probs are wanted)
    assert not waits(sharing, request("scoring", system + [4, 5]), limit=gain - 1)
    cached = PrefillSharing(page_size)
    cached.add(request("first", system + [1, 2, 3], cached=200 - gain + 1))
    assert not waits(cached, request("same system", system + [4, 5]))
    assert not waits(PrefillSharing(page_size), request("alone", system))


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("eagle")), PRESETS["tiny"], "EAGLE"
    )


def burst(prompts, **kw):
    with Engine(**{**TINY, "debug_check_invariants": True, **kw}) as e:
        outs = e.generate(input_ids=prompts, sampling_params=SP)
        stats = e.stats()
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], stats


@pytest.mark.parametrize("page_size", [1, 4, 3])
@pytest.mark.parametrize("speculative", [False, True])
def test_a_burst_sharing_a_system_prompt_computes_it_once(eagle, page_size, speculative):
    g = torch.Generator().manual_seed(page_size)
    system = torch.randint(3, 500, (96,), generator=g).tolist()
    prompts = [system + torch.randint(3, 500, (5 + i,), generator=g).tolist() for i in range(8)]
    spec = spec_args(eagle, 2, 3, 6) if speculative else {}
    outs, cached, stats = burst(prompts, page_size=page_size, **spec)
    ref, none, _ = burst(prompts, page_size=page_size, disable_radix_cache=True, **spec)
    assert outs == ref and sum(none) == 0
    # all but the first take the system prompt from the cache (its last page may be re-run)
    assert cached[0] == 0
    assert all(c >= 96 - 2 * page_size for c in cached[1:]), cached
    assert stats["prefix_cache_hit_tokens"] == sum(cached)
