"""Edges of the prefix cache and of tensor parallelism: shared prefixes of every length around
the page size, whole prompts served from the cache, the cache's bookkeeping under random
traffic, and tp_size 2 on shapes the main suite does not run (GQA with fewer KV heads than
ranks under EAGLE3, odd vocabularies, tied embeddings), aborts and shutdown."""

from __future__ import annotations

import random
import subprocess
import time

import pytest
import torch

from specserve import Engine
from specserve.errors import InvalidArgument
from specserve.kv.allocator import PageAllocator
from specserve.kv.prefix_cache import PrefixCache
from specserve.kv.table import KVTable
from specserve.model.config import PRESETS
from specserve.model.loader import read_model_config
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, mixed_prompts, spec_args, write_dummy_config

SP = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
CPU = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", load_format="dummy")


# ---- the cache alone, under random traffic ---------------------------------------------------------
def _traffic(seed: int, ps: int, next_token_in_key: bool, steps: int = 250) -> None:
    """Requests that match, lock, adopt, reserve, insert and release as the scheduler does, with
    evictions and flushes between: every matched page holds the request's tokens, every page
    counted evictable really comes free, and nothing leaks."""
    rng = random.Random(seed)
    x = next_token_in_key
    alloc = PageAllocator(40, ps)
    table = KVTable(alloc)
    cache = PrefixCache(alloc, x)
    table.cache = cache
    written: dict[int, tuple[int, ...]] = {}  # page -> the key its KV was computed for
    live: dict[str, tuple[list[int], object, int]] = {}
    bases = [[rng.randrange(4) for _ in range(rng.randrange(1, 4 * ps + 3))] for _ in range(3)]

    def key(tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * ps : (i + 1) * ps + x])

    for step in range(steps):
        op = rng.random()
        if op < 0.4 and len(live) < 5:
            base = rng.choice(bases)
            tokens = base[: rng.randrange(len(base) + 1)]
            tokens += [rng.randrange(4) for _ in range(rng.randrange(2, 2 * ps + 3))]
            rid = f"r{step}"
            pages, node, boundary = cache.match(tokens, rng.randrange(len(tokens)))
            for i, p in enumerate(pages):
                # a boundary page matches its tokens, not the token after them
                n = ps if boundary and i == len(pages) - 1 else ps + x
                assert written[p][:n] == key(tokens, i)[:n]
            if boundary:
                pages, node = pages[:-1], cache.shorter(node)
            cache.lock(node)
            table.adopt(rid, pages)
            if not table.reserve(rid, len(tokens) + 1):
                cache.unlock(node)
                table.release(rid)
                continue
            own = table.pages(rid)
            for i in range(len(pages), len(own)):
                written[own[i]] = key(tokens, i)
            held = cache.insert(tokens, own, len(tokens) - 1, node)
            cache.lock(held)
            cache.unlock(node)
            live[rid] = (tokens, held, len(tokens) - 1)
        elif op < 0.75 and live:
            rid = rng.choice(list(live))
            tokens, held, n = live.pop(rid)
            cache.insert(tokens, table.pages(rid), n, held, releasing=True)
            cache.unlock(held)
            table.release(rid)
        elif op < 0.85:
            cache.evict(rng.randrange(1, 6))
        elif op < 0.9:
            cache.flush()
        else:  # every page counted available can be taken
            assert table.reserve("all", table.available_pages * ps)
            table.release("all")
        table.check_invariants(set(live))
        cache.check_locks([held for _, held, _ in live.values()])
    for rid, (tokens, held, n) in live.items():
        cache.insert(tokens, table.pages(rid), n, held, releasing=True)
        cache.unlock(held)
        table.release(rid)
    cache.flush()
    assert alloc.num_free_pages == alloc.num_usable_pages


@pytest.mark.parametrize("next_token_in_key", [False, True])
@pytest.mark.parametrize("page_size", [1, 2, 3])
def test_cache_bookkeeping_under_random_traffic(page_size, next_token_in_key):
    for seed in range(12):
        _traffic(seed, page_size, next_token_in_key)


# ---- the engine: prefixes of every length around the page size ------------------------------------
@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("eagle")), PRESETS["tiny"], "EAGLE"
    )


def _rand(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefix_workload(e: Engine, ps: int) -> list:
    """Per prefix length L around the page size: a request caching P + 2 tokens, three
    branching off P, the same prompt again and P alone; (outputs, cached tokens) of each."""
    out = []
    for L in sorted({1, ps - 1, ps, ps + 1, 2 * ps} - {0}):
        P = _rand(L, L * 7 + ps)
        first = P + [500, 501]
        prompts = [first, *[P + [505 + i] + _rand(i, i) for i in range(3)], first, P]
        for p in prompts[:1], prompts[1:4], prompts[4:5], prompts[5:]:
            for o in e.generate(input_ids=p, sampling_params=SP):
                out.append((L, len(p[0]) if len(p) == 1 else None, o["output_ids"],
                            o["meta_info"]["cached_tokens"]))  # fmt: skip
    return out


def _run_prefixes(ps: int, cache: bool, spec: dict) -> list:
    with Engine(**TINY, page_size=ps, disable_radix_cache=not cache,
                debug_check_invariants=True, **spec) as e:  # fmt: skip
        out = _prefix_workload(e, ps)
        e.flush_cache()
        alloc = e.core.table.allocator
        assert alloc.num_free_pages == alloc.num_usable_pages
    return out


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("draft", [None, "eagle"])
def test_prefixes_around_the_page_size_hit_exactly_their_whole_pages(eagle, page_size, draft):
    spec = spec_args(eagle, 2, 2, 4) if draft else {}
    on = _run_prefixes(page_size, True, spec)
    off = _run_prefixes(page_size, False, {})
    assert [o[2] for o in on] == [o[2] for o in off]  # speculative + cached == plain
    assert all(o[3] == 0 for o in off)
    for i, (L, _, _, cached) in enumerate(on):
        kind = i % 6  # first, three branches, the same prompt again, P alone
        want = {
            0: 0,
            4: (L + 1) // page_size * page_size,  # all but the last token, in whole pages
            5: (L - 1) // page_size * page_size,
        }.get(kind, L // page_size * page_size)  # the shared prefix's whole pages
        assert cached == want, (L, kind, cached, want)


# ---- tensor parallelism ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, named",
    [
        (dict(intermediate_size=33), "intermediate size 33"),
        (dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=24), "3 attention heads"),
        (dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48), "3 KV heads"),
    ],
)
def test_a_model_tp_size_does_not_divide_is_refused_before_any_rank_starts(tmp_path, shape, named):
    path = write_dummy_config(str(tmp_path), **shape)
    started = time.perf_counter()
    with pytest.raises(InvalidArgument) as e:
        Engine(model_path=path, tp_size=2, **CPU)
    assert e.value.field == "tp_size"
    assert named in str(e.value) and "allowed: 1" in str(e.value)
    assert time.perf_counter() - started < 5


def _rank_processes() -> list[str]:
    """This process's children that are tensor-parallel ranks (spawned interpreters)."""
    import os

    out = subprocess.run(
        ["ps", "-o", "pid=,stat=,args=", "--ppid", str(os.getpid())],
        capture_output=True,
        text=True,
    ).stdout
    return [
        line
        for line in out.splitlines()
        if "multiprocessing.spawn" in line and " Z" not in line.split(None, 2)[1]
    ]


def _generate_twice(args: dict, prompts, params) -> list:
    with Engine(**args, debug_check_invariants=True) as e:
        if e.core.tp is not None:
            e.step_hooks.append(lambda core: core.worker.check_replicas(core.table.owners()))
        out = []
        for _ in range(2):  # the second round from the prefix cache
            out += [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
        e.flush_cache()
        alloc = e.core.table.allocator
        assert alloc.num_free_pages == alloc.num_usable_pages
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, algorithm",
    [
        # 1 KV head for 2 ranks, tied embeddings, an odd vocabulary
        (dict(vocab_size=61, num_key_value_heads=1, tie_word_embeddings=True), "EAGLE3"),
        (dict(vocab_size=67, num_key_value_heads=1, intermediate_size=50), "STANDALONE"),
    ],
)
def test_tp2_equals_tp1_on_gqa_with_fewer_kv_heads_than_ranks(tmp_path, shape, algorithm):
    path = write_dummy_config(str(tmp_path / "m"), **shape)
    if algorithm == "STANDALONE":
        spec = spec_args(path, 2, 2, 5, algorithm=algorithm)
    else:
        draft = write_random_eagle_checkpoint(
            str(tmp_path / "d"), read_model_config(path, "dummy"), algorithm, seed=5
        )
        spec = spec_args(draft, 2, 2, 4, algorithm=algorithm)
    args = dict(CPU, model_path=path, page_size=3, max_total_tokens=120, **spec)
    prompts = mixed_prompts(4, shape["vocab_size"], seed=11, max_len=20)
    params = [SP] * 3 + [dict(SP, temperature=0.8, top_k=20, seed=7)]
    want = _generate_twice(args, prompts, params)
    assert _generate_twice(dict(args, tp_size=2), prompts, params) == want
    assert not _rank_processes()


@pytest.mark.slow
def test_tp2_abort_and_shutdown_in_flight_leave_no_rank_behind(tmp_path):
    path = write_dummy_config(str(tmp_path), vocab_size=61)
    long = {"temperature": 0.0, "max_new_tokens": 5000, "ignore_eos": True}
    e = Engine(model_path=path, tp_size=2, page_size=2, **CPU)
    try:
        outs: list[dict] = []
        rid = e.submit([5, 6, 7, 8], long, outs.append)
        e.submit([9, 10, 11], long, lambda _: None)
        time.sleep(0.5)
        e.abort(rid)
        again = e.generate(input_ids=[5, 6, 7, 9], sampling_params=SP)
        assert len(again["output_ids"]) == 6
        assert outs[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        e.shutdown()  # with the second request still decoding
    assert not _rank_processes()
