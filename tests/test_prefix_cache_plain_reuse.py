"""Under load-adaptive speculation plain steps skip the draft, so a request's draft KV may stop
short of its target KV. The cache keeps the rest as target-only pages: a request that will
decode plainly reuses them (and decodes plainly to its end), a speculating one stops before
them; an exact copy replaces a target-only one, never the other way round. Outputs stay
those of an engine without a cache."""

from __future__ import annotations

import pytest

from specserve.kv.allocator import PageAllocator
from specserve.kv.prefix_cache import PrefixCache
from specserve.kv.table import KVTable
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import TINY, check_plain_next_turn_reuse

GREEDY = {"temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True}


# ---- the cache alone ---------------------------------------------------------------------------
@pytest.mark.parametrize("next_token_in_key", [False, True])
def test_target_only_pages_serve_plain_requests_and_exact_copies_replace_them(next_token_in_key):
    alloc = PageAllocator(64, page_size=2)
    table = KVTable(alloc)
    cache = PrefixCache(alloc, next_token_in_key)
    table.cache = cache
    tokens = list(range(1, 16))  # 7 full pages and one more token
    # a: draft exact for its first 6 tokens (3 pages), target KV for 12 (6 pages)
    assert table.reserve("a", 12)
    a_pages = table.pages("a")
    cache.insert(tokens, a_pages, 12, exact_tokens=6)
    table.release("a")
    table.check_invariants(set())
    pages, node, _ = cache.match(tokens, 14)
    assert pages == a_pages[:3]  # a speculating request stops before the target-only pages
    pages, node, _ = cache.match(tokens, 14, plain=True)
    assert pages == a_pages[:6] and cache.exact_pages(node) == 3

    # b computed the same tokens with its draft current: its exact copies replace a's (the
    # unread ones, as any copy the request holds does)
    assert table.reserve("b", 12)
    b_pages = table.pages("b")
    cache.insert(tokens, b_pages, 12)
    table.release("b")
    table.check_invariants(set())
    pages, node, _ = cache.match(tokens, 14)
    assert pages == b_pages[:6] and cache.exact_pages(node) == 6

    # c's target-only copies do not replace them
    assert table.reserve("c", 12)
    cache.insert(tokens, table.pages("c"), 12, exact_tokens=0, releasing=True)
    table.release("c")
    table.check_invariants(set())
    pages, node, _ = cache.match(tokens, 14)
    assert pages == b_pages[:6] and cache.exact_pages(node) == 6
    assert cache.flush() == 6 and alloc.num_free_pages == alloc.num_usable_pages


def test_a_match_stopped_by_a_target_only_node_takes_no_boundary_page():
    """With the next token in the key, a speculating request's match that a target-only node
    stops reports no boundary page (the scheduler would copy a page it did not take)."""
    alloc = PageAllocator(32, page_size=2)
    cache = PrefixCache(alloc, next_token_in_key=True)
    pages = alloc.alloc(3)
    cache.insert([5, 6, 7, 8, 9, 10, 11], pages, 6, exact_tokens=2)  # page 0 exact only
    # page 1's tokens match, not its next token; its only sibling is target-only
    taken, _, boundary = cache.match([5, 6, 7, 8, 99, 1], 4)
    assert taken == [pages[0]] and not boundary
    taken, _, boundary = cache.match([5, 6, 7, 8, 99, 1], 4, plain=True)
    assert taken == pages[:2] and boundary  # (a plain request takes it, as a boundary page)
    only = PrefixCache(PageAllocator(32, page_size=2), next_token_in_key=True)
    only.insert([5, 6, 7, 8, 9, 10, 11], only.allocator.alloc(3), 6, exact_tokens=0)
    assert only.match([5, 6, 99, 1, 2], 4)[::2] == ([], False)


def test_a_request_whose_draft_caught_up_makes_its_own_pages_exact():
    alloc = PageAllocator(32, page_size=2)
    table = KVTable(alloc)
    cache = PrefixCache(alloc)
    table.cache = cache
    tokens = list(range(1, 12))
    assert table.reserve("a", 10)
    node = cache.insert(tokens, table.pages("a"), 10, exact_tokens=4)  # plain steps ran
    cache.lock(node)
    assert len(cache.match(tokens, 10)[0]) == 2
    node2 = cache.insert(tokens, table.pages("a"), 10, start=node)  # caught up since
    cache.lock(node2)
    cache.unlock(node)
    assert cache.match(tokens, 10)[0] == table.pages("a")[:5]
    cache.unlock(node2)
    table.release("a")
    table.check_invariants(set())


# ---- through the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    return write_random_eagle_checkpoint(
        str(tmp_path_factory.mktemp("eagle")), PRESETS["tiny"], "EAGLE", seed=3
    )


@pytest.mark.parametrize("page_size", [1, 3])
def test_the_next_turn_of_a_plainly_decoded_answer_reuses_it(eagle, page_size):
    """A plain next turn reuses a plainly decoded answer; a speculating one stops at the
    prompt (`check_plain_next_turn_reuse`); the cache's invariants hold every step."""
    check_plain_next_turn_reuse(dict(TINY, debug_check_invariants=True), eagle, page_size, GREEDY)
