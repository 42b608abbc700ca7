"""The prefix cache: exact reuse of earlier requests' KV (the draft's included), shared pages
counted right, eviction under pressure, and a hit rate that speculation does not lower."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, TimeoutError

import pytest
import torch

from specserve import Engine
from specserve.config import EngineConfig
from specserve.kv.allocator import PageAllocator
from specserve.kv.prefix_cache import PrefixCache
from specserve.kv.table import KVTable
from specserve.model.config import PRESETS
from specserve.runtime.engine_core import EngineCore
from specserve.runtime.request import Request
from specserve.sampling_params import SamplingParams
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, assert_kv_matches_plain_prefill, spec_args

SP = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}


# ---- the cache alone ---------------------------------------------------------------------------
def test_cache_matches_whole_pages_and_counts_its_references():
    alloc = PageAllocator(16, page_size=2)
    table = KVTable(alloc)
    cache = PrefixCache(alloc)
    table.cache = cache
    assert table.reserve("a", 7)  # 4 pages
    a_pages = table.pages("a")
    cache.lock(cache.insert([1, 2, 3, 4, 5, 6, 7], a_pages, 7))  # 3 full pages kept
    table.check_invariants({"a"})
    assert cache.num_pages == 3 and cache.evictable == 0
    pages, node, _ = cache.match([1, 2, 3, 4, 9, 9], max_tokens=6)
    assert pages == a_pages[:2]  # the third page's tokens differ
    cache.lock(node)
    table.adopt("b", pages)
    table.check_invariants({"a", "b"})
    assert alloc.refs[pages[0]] == 3  # a, b and the cache
    pages, _, _ = cache.match([1, 2, 3, 4, 5, 6], max_tokens=5)
    assert len(pages) == 2  # never past max_tokens
    table.release("a")
    table.release("b")
    cache.unlock(node)
    table.check_invariants(set())
    assert cache.evictable == 0  # a's lock holds its whole path
    cache.unlock(cache.match([1, 2, 3, 4, 5, 6, 7], 7)[1])  # a's own lock
    assert cache.evictable == 3
    table.check_invariants(set())
    assert cache.flush() == 3 and alloc.num_free_pages == alloc.num_usable_pages
    table.check_invariants(set())


def test_a_request_that_computed_cached_pages_again_locks_only_pages_it_holds():
    """A request computing positions the cache already holds (prompt log-probs limit what it
    may take from the cache) must not lock the cached copies: it never reads them, and they
    would stay pinned while it runs. Unread, the cache swaps them for the request's copies;
    read by another request, the insert stops where the copies part."""
    alloc = PageAllocator(32, page_size=2)
    table = KVTable(alloc)
    cache = PrefixCache(alloc)
    table.cache = cache
    tokens = list(range(1, 13))  # 6 full pages
    assert table.reserve("a", 12)
    cache.lock(cache.insert(tokens, table.pages("a"), 12))
    table.release("a")  # a finished: its pages stay cached, its lock is still held
    cache.unlock(cache.match(tokens, 12)[1])
    # b computed the same six pages itself: the cache takes b's copies, frees a's
    assert table.reserve("b", 12)
    b_node = cache.insert(tokens, table.pages("b"), 12)
    cache.lock(b_node)
    assert cache.match(tokens, 12)[0] == table.pages("b") and b_node.depth == 6
    assert cache.num_pages == 6 and alloc.num_free_pages == 32 - 1 - 6
    table.check_invariants({"b"})
    # c reuses the first two pages (b's), then computes the rest again while b runs
    pages, c_node, _ = cache.match(tokens, 4)
    cache.lock(c_node)
    table.adopt("c", pages)
    assert table.reserve("c", 12)
    c_last = cache.insert(tokens, table.pages("c"), 12, c_node)
    assert c_last.depth == 2  # b reads pages 3..6 of the cache: c's copies stay its own
    cache.lock(c_last)
    cache.unlock(c_node)
    table.check_invariants({"b", "c"})
    cache.unlock(b_node)
    table.release("b")
    assert cache.evictable == 4  # b's cached pages: c locks only the two it reads
    cache.unlock(c_last)
    table.release("c")
    assert cache.flush() == 6 and alloc.num_free_pages == alloc.num_usable_pages


def test_a_lone_request_computing_cached_pages_again_is_not_cut_short():
    """Its prompt is cached from an earlier request; asking for prompt log-probs from
    position 50 it recomputes the rest, and the budget holds it only if the cached copies
    it does not read can be evicted."""
    prompt = [3 + (i * 37) % 500 for i in range(200)]
    sp = {"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True}
    with Engine(**TINY, debug_check_invariants=True, max_total_tokens=300) as e:
        first = e.generate(input_ids=prompt, sampling_params=sp)
        again = e.generate(
            input_ids=prompt, sampling_params=sp, return_logprob=True, logprob_start_len=50
        )
    assert again["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    assert again["output_ids"] == first["output_ids"]


def test_eviction_takes_least_recently_used_leaves_first():
    alloc = PageAllocator(8, page_size=1)
    cache = PrefixCache(alloc)
    for tokens in ([1, 2], [1, 3], [4]):
        pages = alloc.alloc(len(tokens))
        cache.insert(tokens, pages, len(tokens))
        alloc.free(pages)  # the cache alone holds them
    cache.match([1, 3], 2)  # used last
    assert cache.evict(1) == 1
    assert cache.match([1, 2], 2)[0].__len__() == 1  # [1, 2]'s leaf went first
    assert len(cache.match([1, 3], 2)[0]) == 2
    assert cache.evict(10) == 3 and cache.num_pages == 0  # [1], [1, 3], [4]


def _tree(cache: PrefixCache) -> dict:
    """The cache as nested {first page's key: (tokens, pages, last use, subtree)}."""

    def walk(node):
        return {k: (c.tokens, c.pages, c.last_use, walk(c)) for k, c in node.children.items()}

    return walk(cache.root)


@pytest.mark.parametrize("next_token_in_key", [False, True])
@pytest.mark.parametrize("page_size", [1, 3])
def test_an_insert_resumed_from_a_held_node_keeps_what_a_full_walk_keeps(
    next_token_in_key, page_size
):
    """A request's later insert starts at the node it holds; the cache ends up as if it had
    walked from the root, also when the held node is a boundary (its tokens with another
    next token, as a match may return) or deeper than what is inserted now."""
    g = torch.Generator().manual_seed(page_size)
    shared = torch.randint(0, 50, (7 * page_size,), generator=g).tolist()
    histories = [shared + torch.randint(0, 50, (9 * page_size,), generator=g).tolist()
                 for _ in range(3)]  # fmt: skip
    prompt = 5 * page_size
    caches = []
    for resume in (False, True):
        alloc = PageAllocator(200, page_size)
        cache = PrefixCache(alloc, next_token_in_key)
        for h in histories:
            pages = alloc.alloc(len(h) // page_size + 1)
            held = cache.insert(h, pages, prompt)
            cache.lock(held)
            start = held
            if next_token_in_key:  # another request's prompt, equal but for the next token:
                # it reused the cached pages but the last (a boundary: its copy is its own)
                other = h[:prompt] + [h[prompt] + 1]
                start = cache.insert(other, pages[:4] + alloc.alloc(1), prompt)
                assert start.parent is held.parent and start is not held
            node = cache.insert(h, pages, len(h) - 1, start if resume else None)
            cache.lock(node)
            cache.unlock(held)
            shorter = cache.insert(h, pages, 2 * page_size, node if resume else None)
            assert shorter.depth == 2  # never deeper than asked
            cache.unlock(node)
        caches.append((_tree(cache), cache.num_pages, cache.evictable, list(alloc.refs)))
    assert caches[0] == caches[1]


@pytest.mark.parametrize("next_token_in_key", [False, True])
def test_nodes_number_about_the_branch_points_not_the_cached_tokens(next_token_in_key):
    """A node holds a run of pages: 200 requests of 1,000 tokens sharing a 500-token prefix
    at page size 1 (a page per token) make about a node each, not 1,000."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 1000, (500,), generator=g).tolist()
    alloc = PageAllocator(200 * 501 + 600, page_size=1)
    cache = PrefixCache(alloc, next_token_in_key)
    for r in range(200):
        tokens = shared + [1000 + r] + torch.randint(0, 1000, (500,), generator=g).tolist()
        # As the scheduler does: match, lock, insert, lock the insert's node, unlock.
        cached, node, boundary = cache.match(tokens, 999)
        if boundary:  # the shared prefix's last page: its draft KV is computed anew
            cached, node = cached[:-1], cache.shorter(node)
        assert len(cached) == (0 if r == 0 else 500 - next_token_in_key)
        cache.lock(node)
        pages = cached + alloc.alloc(1000 - len(cached))
        held = cache.insert(tokens, pages, 1000, node)
        cache.lock(held)
        cache.unlock(node)
        cache.unlock(held)
        alloc.free(pages[len(cached) :])
    kept = 500 - next_token_in_key + 200 * (500 + next_token_in_key)
    assert cache.num_pages == kept
    # The root, the shared prefix (its last page split off with the next token in the key)
    # and a leaf per request.
    assert cache.num_nodes() <= 3 + 200
    assert cache.evict(250) == 250 and cache.num_pages == kept - 250
    assert cache.flush() == kept - 250 and cache.num_pages == 0


def test_with_the_next_token_in_the_key_a_page_differing_only_there_is_a_boundary():
    """An EAGLE draft's KV at a page's last position depends on the token after the page:
    pages are exact for a request only if that token is its own too."""
    alloc = PageAllocator(16, page_size=2)
    cache = PrefixCache(alloc, next_token_in_key=True)
    a = alloc.alloc(3)
    cache.insert([1, 2, 3, 4, 5, 6, 7], a, 6)  # pages [1,2|3] [3,4|5] [5,6|7]
    pages, node, boundary = cache.match([1, 2, 3, 4, 5, 6, 7], 6)
    assert pages == a and not boundary
    pages, node, boundary = cache.match([1, 2, 3, 4, 9, 9, 9], 6)
    assert pages == a[:2] and boundary  # [3,4] matches, its draft KV's last entry is for 5
    pages, node, boundary = cache.match([1, 2, 3, 4, 5, 6, 8], 6)
    assert pages == a and boundary
    pages, node, boundary = cache.match([1, 2, 3, 9], 3)
    assert pages == [a[0]] and not boundary


# ---- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("eagle")), PRESETS["tiny"], "EAGLE"
    )


def shared_prefix_prompts(n: int, prefix_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 500, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 500, (1 + i % 7,), generator=g).tolist() for i in range(n)]


def run(prompts, waves: int = 2, **kw):
    """The prompts in `waves` rounds (the later ones find the earlier ones cached): outputs,
    per-request speculative histograms and cached tokens, and the engine's hit counters."""
    outs, hists, cached = [], [], []
    with Engine(**{**TINY, "debug_check_invariants": True, **kw}) as e:
        for _ in range(waves):
            for o in e.generate(input_ids=prompts, sampling_params=SP):
                outs.append(o["output_ids"])
                hists.append(o["meta_info"].get("spec_accept_histogram"))
                cached.append(o["meta_info"]["cached_tokens"])
        stats = e.stats()
        e.flush_cache()
        alloc = e.core.table.allocator
        assert alloc.num_free_pages == alloc.num_usable_pages  # nothing live: all free
        e.core.check_invariants()
    return outs, hists, cached, stats


@pytest.mark.parametrize("page_size", [1, 4, 3])
@pytest.mark.parametrize("draft", [None, "eagle-chain", "eagle-tree", "standalone"])
def test_outputs_identical_with_the_cache_on_and_off(eagle, page_size, draft):
    spec = {
        None: {},
        "eagle-chain": spec_args(eagle, 1, 3, 4),
        "eagle-tree": spec_args(eagle, 3, 3, 8),
        "standalone": spec_args("tiny", 2, 2, 5),
    }[draft]
    prompts = shared_prefix_prompts(6, 21, seed=page_size)
    kw = dict(page_size=page_size, **spec)
    on = run(prompts, **kw)
    off = run(prompts, disable_radix_cache=True, **kw)
    assert on[0] == off[0]
    assert on[1] == off[1]  # the same drafts accepted: the draft's KV was reused exactly
    assert sum(on[2]) > 0 and sum(off[2]) == 0
    assert on[3]["prefix_cache_hit_tokens"] == sum(on[2])


@pytest.mark.parametrize("overlap", [True, False])
def test_eviction_and_retraction_under_a_small_budget(eagle, overlap):
    """A KV budget far too small for the load: the cache gives its pages back, requests are
    retracted and resumed, outputs stay those of an unconstrained run without a cache."""
    prompts = shared_prefix_prompts(12, 30, seed=7)
    kw = dict(page_size=4, disable_overlap_schedule=not overlap, **spec_args(eagle, 2, 3, 6))
    small = run(prompts, waves=2, max_total_tokens=160, **kw)
    ref = run(prompts, waves=2, disable_radix_cache=True, **kw)
    assert small[0] == ref[0]  # (a resumed request's histogram counts its re-prefill: no compare)
    assert small[3]["num_retractions"] > 0 and sum(small[2]) > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_second_turn_reuses_the_history_with_and_without_speculation(eagle, page_size):
    g = torch.Generator().manual_seed(page_size)
    first = torch.randint(3, 500, (70,), generator=g).tolist()
    hits = {}
    for name, spec in (("plain", {}), ("eagle", spec_args(eagle, 4, 3, 10))):
        with Engine(**TINY, page_size=page_size, **spec) as e:
            turn1 = e.generate(input_ids=first, sampling_params=SP)
            history = first + turn1["output_ids"]
            turn2 = e.generate(input_ids=history + [7, 8, 9], sampling_params=SP)
            cached = turn2["meta_info"]["cached_tokens"]
            assert cached >= len(history) - page_size, (name, cached, len(history))
            hits[name] = cached
            assert assert_kv_matches_plain_prefill(e.core) == 0  # (nothing running now)
    assert hits["eagle"] == hits["plain"]


def test_cached_kv_equals_a_plain_prefill_while_requests_run(eagle):
    prompts = shared_prefix_prompts(5, 33, seed=3)
    checked = []
    with Engine(**TINY, page_size=4, **spec_args(eagle, 2, 3, 6)) as e:
        e.generate(input_ids=prompts[:1], sampling_params=SP)
        e.step_hooks.append(lambda core: checked.append(assert_kv_matches_plain_prefill(core)))
        e.generate(input_ids=prompts[1:], sampling_params=SP)
    assert sum(checked) > 0


def test_flush_cache_frees_what_nobody_uses():
    with Engine(**TINY, page_size=2) as e:
        e.generate(input_ids=[list(range(3, 40))], sampling_params=SP)
        stats = e.stats()
        assert stats["kv_cached_tokens"] > 0 and stats["kv_used_tokens"] == 0  # reclaimable
        assert e.flush_cache() > 0
        assert e.stats()["kv_cached_tokens"] == 0
        alloc = e.core.table.allocator
        assert alloc.num_free_pages == alloc.num_usable_pages


def test_server_reports_cached_tokens_flushes_and_counts_hits():
    from fastapi.testclient import TestClient

    from specserve.server.app import create_app
    from specserve.server.server_config import ServerConfig

    with Engine(**TINY, page_size=2) as e, TestClient(create_app(e, ServerConfig())) as client:
        history = list(range(3, 60))
        body = {"model": "tiny", "prompt": history, "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        body["prompt"] = history + [5, 6]
        usage = client.post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= len(history) - 2
        metrics = client.get("/metrics").text
        assert "specserve_prefix_cache_hit_tokens_total" in metrics
        r = client.post("/flush_cache")
        assert r.status_code == 200 and r.json()["flushed_pages"] > 0
        r = client.get("/flush_cache")  # SGLang takes GET too; nothing is left to flush
        assert r.status_code == 200 and r.json()["flushed_pages"] == 0


def test_multiturn_bench_hit_rate_is_the_same_with_speculation(eagle, capsys):
    """`specserve bench multiturn`: later turns hit the cache, an EAGLE draft does not lower
    the hit rate, and without the cache nothing hits."""
    from specserve import cli

    argv = ["bench", "multiturn", "--model-path", "tiny", "--load-format", "dummy",
            "--skip-tokenizer-init", "--dtype", "float32", "--device", "cpu", "--page-size", "4",
            "--conversations", "3", "--turns", "3", "--system-len", "30", "--user-len", "5",
            "--answer-len", "6", "--speculative-algorithm", "EAGLE",
            "--speculative-draft-model-path", eagle, "--speculative-num-steps", "2",
            "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    import json

    out = capsys.readouterr().out
    rows = {r["system"]: r for r in json.loads(out[: out.index("\n]") + 2])}
    plain, spec = rows["specserve plain"], rows["specserve spec"]
    assert plain["hit_rate"] > 0.5 and spec["hit_rate"] == plain["hit_rate"]
    assert rows["specserve plain-nocache"]["hit_rate"] == 0
    assert spec["accept_length"] is not None and plain["accept_length"] is None


def test_a_growing_draft_vocabulary_takes_the_cached_prompt_tokens(eagle, tmp_path):
    """With --speculative-token-map-growth a request's prompt tokens join the draft's
    vocabulary while it runs; those of a cached prefix too (they were never prefilled for it)."""
    import json

    token_map = tmp_path / "map.json"
    token_map.write_text(json.dumps(list(range(100))))
    prefix = list(range(400, 420))  # outside the map
    kw = dict(speculative_token_map=str(token_map), speculative_token_map_growth=64)
    with Engine(**TINY, page_size=4, **spec_args(eagle, 2, 2, 4, **kw)) as e:
        vocab = e.core.worker.drafter.head.vocab
        e.generate(input_ids=prefix + [5], sampling_params=SP)
        seen = []
        e.step_hooks.append(
            lambda core: core.scheduler.running and seen.append(sum(t in vocab for t in prefix))
        )
        out = e.generate(input_ids=prefix + [6, 7], sampling_params=SP)
    assert out["meta_info"]["cached_tokens"] > 0
    assert seen and min(seen) == len(prefix)


def draft_kv_of(core, rid: str, n: int):
    """The draft's K and V of a request's first n positions, every layer."""
    slots = core.table.slots(rid, 0, n)
    kv = core.worker.drafter.kv
    return kv.buffer[:, :, slots].clone()


def test_draft_kv_of_a_prefix_shared_by_branches_equals_a_plain_prefill(eagle):
    """Requests branching off a cached prefix at different tokens: every position's draft KV
    of a later request equals what it is without the cache (interior pages included)."""
    x = list(range(40, 48))
    a, b = x + [20, 21, 22], x + [30, 31, 32, 33, 34, 35]
    c = b + [40, 41]
    seen = {}
    for cache_off in (False, True):
        with Engine(**TINY, page_size=4, disable_radix_cache=cache_off,
                    **spec_args(eagle, 2, 2, 4)) as e:  # fmt: skip
            for p in (a, b):
                e.generate(input_ids=p, sampling_params=SP)
            got = []

            def grab(core, got=got):
                for r in core.scheduler.running:
                    if r.prompt_ids == c and not got:
                        got.append(draft_kv_of(core, r.rid, len(c) - 1))

            e.step_hooks.append(grab)
            e.generate(input_ids=c, sampling_params=SP)
            seen[cache_off] = got[0]
    torch.testing.assert_close(seen[False], seen[True], atol=1e-5, rtol=1e-5)


def test_a_prompt_needing_every_page_still_starts_when_its_prefix_is_cached(eagle):
    """The copy of a boundary page needs one page more than computing it: without that page,
    the request starts without the copy instead of waiting forever."""
    with Engine(**TINY, page_size=4, max_total_tokens=32, debug_check_invariants=True,
                **spec_args(eagle, 1, 1, 2)) as e:  # fmt: skip
        prompt = list(range(50, 50 + e.core.scheduler.max_prompt_tokens()))
        sp = {"temperature": 0.0, "max_new_tokens": 1}
        first = e.generate(input_ids=prompt, sampling_params=sp)
        with ThreadPoolExecutor(1) as pool:  # (a request that never starts would hang)
            second = pool.submit(e.generate, input_ids=prompt, sampling_params=sp)
            try:
                second = second.result(timeout=60)
            except TimeoutError:
                e.abort(e.core.scheduler.waiting[0].rid)
                pytest.fail("the second request never started")
    assert second["output_ids"] == first["output_ids"]


def test_a_reused_boundary_page_is_not_held_for_the_requests_life(eagle):
    """With the cache on, a request that reused a prefix has as much room to grow as without."""
    lengths = {}
    for cache_off in (False, True):
        with Engine(**TINY, page_size=4, max_total_tokens=32, disable_radix_cache=cache_off,
                    **spec_args(eagle, 1, 1, 2)) as e:  # fmt: skip
            prompt = list(range(60, 70))
            e.generate(input_ids=prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 1})
            out = e.generate(input_ids=prompt + [5], sampling_params={"temperature": 0.0,
                                                                      "max_new_tokens": 40})  # fmt: skip
            lengths[cache_off] = len(out["output_ids"])
    assert lengths[False] == lengths[True]


def test_a_copied_boundary_page_is_not_held_through_a_chunked_prefill(eagle):
    """Once a boundary page is copied the request no longer reads the cached one: a lone
    request that fits the cache finishes although its prefill is chunked (the cached page
    stayed locked until the prefill completed, and the last chunk never found room)."""
    core = EngineCore(EngineConfig.from_kwargs(
        **TINY, page_size=4, max_total_tokens=32, chunked_prefill_size=4,
        debug_check_invariants=True, **spec_args(eagle, 1, 1, 2)).resolve())  # fmt: skip
    x = list(range(10, 18))
    n = core.scheduler.max_prompt_tokens()
    for rid, prompt in (("a", x + [100]), ("b", x + [200] + list(range(300, 300 + n - 9)))):
        req = Request(rid, prompt, SamplingParams(max_new_tokens=1, **{"temperature": 0.0}), seed=0)
        core.add_request(req)
        for _ in range(100):
            if not core.has_work():
                break
            core.step()
        assert req.finished, f"{rid} never finished"
    assert req.cached_tokens == 8  # "b" copied the boundary page [14..17] (next token 100)


@pytest.mark.parametrize("spec", [False, True])
def test_a_next_turn_sent_while_a_step_is_in_flight_finds_the_whole_history(eagle, spec):
    """Overlap: a request finishing in a step is still in the step launched ahead and is
    reaped a step later. Its next turn (prompt + output + more), sent as the output comes,
    is admitted before then: it must find the output's pages cached too (they are final),
    not only the prompt's. Another request keeps the pipeline from draining."""
    kw = spec_args(eagle, 2, 2, 4) if spec else {}
    core = EngineCore(EngineConfig.from_kwargs(**TINY, page_size=4, debug_check_invariants=True,
                                               **kw).resolve())  # fmt: skip
    assert core.overlap
    sp = lambda n: SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)  # noqa: E731
    core.add_request(Request("long", list(range(100, 120)), sp(60), seed=0))
    first = Request("first", [7, 8, 9], sp(10), seed=0)  # less than a page: no prompt pages
    core.add_request(first)
    turn = None
    for _ in range(200):
        touched = core.step()
        if turn is None and first in touched and first.finished:
            turn = Request("turn", first.all_ids + [5], sp(4), seed=0)
            core.add_request(turn)
        if not core.has_work():
            break
    assert turn is not None and turn.finished
    assert turn.cached_tokens >= len(first.all_ids) - 4


def test_a_request_that_computed_a_prefix_another_reads_caches_its_later_pages():
    """Two requests of one batch compute the same prefix; the cache keeps the first's copy,
    which that one still reads. When the second finishes, its later pages (the rest of its
    prompt, its answer) are cached under that copy: its next turn finds its whole history,
    not only the shared prefix."""
    core = EngineCore(EngineConfig.from_kwargs(**TINY, page_size=3, disable_overlap_schedule=True,
                                               debug_check_invariants=True).resolve())  # fmt: skip
    sp = lambda n: SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)  # noqa: E731
    shared = list(range(200, 206))  # two pages
    first = Request("first", shared + [10, 11, 12], sp(40), seed=0)  # still running at the end
    second = Request("second", shared + [20, 21, 22], sp(6), seed=0)
    core.add_request(first)
    core.add_request(second)
    turn = None
    for _ in range(300):
        core.step()
        if turn is None and second.finished:
            turn = Request("turn", second.all_ids + [5], sp(3), seed=0)
            core.add_request(turn)
        if not core.has_work():
            break
    assert turn is not None and turn.finished
    # every full page the second computed (its last token's KV never is): 12, where the
    # cache kept only the shared 6
    assert turn.cached_tokens == (len(second.all_ids) - 1) // 3 * 3 == 12
