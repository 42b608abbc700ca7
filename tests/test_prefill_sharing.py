"""Requests arriving together with a shared prompt prefix compute it once: the later ones wait
for the prefill batch that caches it and start from the cache, with outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.runtime.prefill_sharing import SHARE_MIN_TOKENS, PrefillSharing
from specserve.runtime.request import Request
from specserve.sampling_params import SamplingParams
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, spec_args

SP = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def request(rid: str, ids: list[int]) -> Request:
    return Request(rid=rid, prompt_ids=list(ids), params=SamplingParams(max_new_tokens=4), seed=0)


def waits(sharing: PrefillSharing, r: Request, limit: int | None = None) -> bool:
    """(By default a request that may reuse all but its last token.)"""
    return sharing.should_wait(r, r.fill_len - 1 if limit is None else limit)


@pytest.mark.parametrize("page_size", [1, 4, 3, 64])
def test_a_request_waits_only_for_enough_shared_tokens_the_batch_computes(page_size):
    g = torch.Generator().manual_seed(page_size)
    system = torch.randint(0, 1000, (200,), generator=g).tolist()
    sharing = PrefillSharing(page_size)
    sharing.add(request("first", system + [1, 2, 3]), start=0)
    gain = -(-max(SHARE_MIN_TOKENS, page_size) // page_size) * page_size
    assert waits(sharing, request("same system", system + [4, 5]))
    assert waits(sharing, request("shares just enough", system[:gain] + [9] * 50))
    # the shared part is short, elsewhere, or the batch computes little of it
    assert not waits(sharing, request("short", system[: gain - 1] + [9] * 50))
    assert not waits(sharing, request("other", [7] + system))
    assert not waits(sharing, request("scoring", system + [4, 5]), limit=gain - 1)
    cached = PrefillSharing(page_size)
    cached.add(request("first", system + [1, 2, 3]), start=200)  # the rest was cached
    assert not waits(cached, request("same system", system + [4, 5]))
    assert not waits(PrefillSharing(page_size), request("alone", system))


def test_nobody_in_a_burst_waits_for_a_system_prompt_already_cached():
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 1000, (4000,), generator=g).tolist()
    reqs = [request(str(i), system + torch.randint(0, 1000, (100,), generator=g).tolist())
            for i in range(64)]  # fmt: skip
    sharing = PrefillSharing(1)
    for r in reqs:
        assert not waits(sharing, r)
        sharing.add(r, start=4000)  # each took the system prompt from the cache
    assert waits(sharing, request("a copy of one", reqs[5].prompt_ids + [1]))


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


def test_a_waiting_request_keeps_its_running_slot():
    """max_running_requests 2: B waits for A's shared prefix; C, unrelated and later, must not
    take B's slot (B would then wait for a whole request to finish, not one prefill)."""
    from specserve.config import EngineConfig
    from specserve.runtime.engine_core import EngineCore

    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 500, (96,), generator=g).tolist()
    other = torch.randint(3, 500, (50,), generator=g).tolist()

    def sp(n):
        return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)

    cfg = EngineConfig.from_kwargs(**TINY, max_running_requests=2, debug_check_invariants=True)
    core = EngineCore(cfg.resolve())
    a = Request("A", system + [7, 8], sp(40), seed=0)
    b = Request("B", system + [9, 10], sp(4), seed=0)
    c = Request("C", other, sp(40), seed=0)
    for r in (a, b, c):
        core.add_request(r)
    first: dict[str, int] = {}
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        for r in (a, b, c):
            if r.output_ids:
                first.setdefault(r.rid, steps)
    assert b.cached_tokens >= 96 - 1  # it waited, and took the prefix from the cache
    assert first["B"] < first["C"], first  # and kept its place ahead of C


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("speculative", [False, True])
def test_under_chunked_prefill_a_sharer_starts_where_the_computing_request_got_to(
    eagle, page_size, speculative
):
    """A 200-token prompt prefilled 16 tokens a batch, and a request sharing its first 150
    arriving with it: held back while the first computes their shared part, it then starts
    from the pages the finished chunks cached, not from nothing."""
    g = torch.Generator().manual_seed(page_size)
    long = torch.randint(3, 500, (200,), generator=g).tolist()
    prompts = [long, long[:150] + [7, 8, 9, 11, 12]]
    kw = dict(page_size=page_size, chunked_prefill_size=16)
    spec = spec_args(eagle, 2, 3, 6) if speculative else {}
    outs, cached, stats = burst(prompts, **kw, **spec)
    ref, _, _ = burst(prompts, disable_radix_cache=True, **kw, **spec)
    assert outs == ref
    assert cached[0] == 0 and cached[1] >= 150 - 2 * page_size, cached


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_request_held_back_for_a_prefix_does_not_stall_a_partial_prefill_behind_it(page_size):
    """A 100-token cache. C computes a 40-token prefix; S, sharing it, waits for C's batch;
    P, unrelated, takes the rest of the 64-token prefill budget (20 of its 60 tokens). Once
    C has finished, S (83 tokens, 43 beyond the cached prefix) does not fit beside P's 20:
    P's remaining chunks must go first, else nothing ever frees a page and both wait
    forever. Each request's output is its output alone."""
    from specserve.config import EngineConfig
    from specserve.runtime.engine_core import EngineCore

    g = torch.Generator().manual_seed(page_size)
    prefix = torch.randint(3, 500, (40,), generator=g).tolist()
    prompts = {
        "C": prefix + torch.randint(3, 500, (4,), generator=g).tolist(),
        "S": prefix + torch.randint(3, 500, (43,), generator=g).tolist(),
        "P": torch.randint(3, 500, (60,), generator=g).tolist(),
    }
    lengths = {"C": 5, "S": 3, "P": 3}
    kw = dict(TINY, page_size=page_size, max_total_tokens=100)
    cfg = EngineConfig.from_kwargs(
        **kw, chunked_prefill_size=64, disable_overlap_schedule=True, debug_check_invariants=True
    )
    core = EngineCore(cfg.resolve())
    reqs = {
        rid: Request(
            rid,
            ids,
            SamplingParams(temperature=0.0, max_new_tokens=lengths[rid], ignore_eos=True),
            0,
        )
        for rid, ids in prompts.items()
    }
    for r in reqs.values():
        core.add_request(r)
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 100, {r.rid: (r.state.value, r.kv_len) for r in reqs.values()}
    # it did wait for C's prefix (P's last chunks may have evicted the end of it)
    assert reqs["S"].cached_tokens >= 32
    with Engine(**kw, disable_radix_cache=True) as e:
        for rid, ids in prompts.items():
            sp = {"temperature": 0.0, "max_new_tokens": lengths[rid], "ignore_eos": True}
            assert (
                reqs[rid].output_ids == e.generate(input_ids=ids, sampling_params=sp)["output_ids"]
            )
