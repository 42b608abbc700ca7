"""The device mirror of the page table: slots by row equal the host table's, through page
allocation, truncation, release and row reuse, and through growth of the row tensors."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.kv.allocator import PageAllocator
from specserve.kv.request_rows import PAD_ROW, RequestRows
from specserve.kv.table import KVTable


def check(table: KVTable, rows: RequestRows) -> int:
    rows.flush()
    checked = 0
    for rid in table.owners():
        cap = table.capacity(rid)
        if cap == 0:
            continue
        row = torch.tensor([rows.row(rid)])
        got = rows.slots(row, cap)[0]
        assert torch.equal(got, table.slots(rid, 0, cap)), rid
        checked += 1
    return checked


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_mirror_follows_the_table_and_grows(page_size):
    rng = random.Random(page_size)
    table = KVTable(PageAllocator(400, page_size))
    # start tiny so rows and page columns both have to grow
    rows = RequestRows(torch.device("cpu"), page_size, max_pages=2, rows=2)
    table.mirror = rows
    live: dict[str, int] = {}
    checked = 0
    for step in range(300):
        op = rng.random()
        if op < 0.5 or not live:
            rid = f"r{step}" if rng.random() < 0.3 or not live else rng.choice(list(live))
            want = live.get(rid, 0) + rng.randint(1, 3 * page_size)
            if table.reserve(rid, want):
                live[rid] = want
        elif op < 0.7:
            rid = rng.choice(list(live))
            live[rid] = max(1, live[rid] - rng.randint(0, 2 * page_size))
            table.truncate(rid, live[rid])
        else:
            rid = rng.choice(list(live))
            table.release(rid)
            del live[rid]
        if step % 7 == 0:
            checked += check(table, rows)
    assert checked > 50 and rows.version > 0  # it grew, and stayed right
    assert PAD_ROW not in {rows.row(r) for r in live}


def test_state_by_row_and_padding_row_slots_are_scratch():
    rows = RequestRows(torch.device("cpu"), page_size=4, max_pages=8, rows=4)
    pad = torch.tensor([PAD_ROW, PAD_ROW])
    assert torch.equal(rows.slots(pad, 10), torch.arange(10).remainder(4).expand(2, 10))
    rows.on_pages_added("a", 0, [5, 6])
    rows.flush()
    r = torch.tensor([rows.row("a")])
    rows.set_state(r, torch.tensor([7]), torch.tensor([42]))
    assert rows.kv_lens[r].item() == 7 and rows.roots[r].item() == 42
    assert torch.equal(rows.slots(r, 8)[0], torch.tensor([20, 21, 22, 23, 24, 25, 26, 27]))


@pytest.mark.parametrize("page_size", [1, 4])
def test_reserving_for_a_batch_gives_each_request_what_one_reserve_each_would(page_size):
    """A decode step reserves for its whole batch at once: each request gets the pages that
    one `reserve` per request, in order, would give it, the mirror follows, and a batch that
    does not fit takes nothing (evicting cached pages only where the batch then fits)."""
    rng = random.Random(page_size)
    one, batch = (KVTable(PageAllocator(300, page_size)) for _ in range(2))
    rows = RequestRows(torch.device("cpu"), page_size, max_pages=2, rows=2)
    batch.mirror = rows
    rids = [f"r{i}" for i in range(6)]
    wants = {r: 0 for r in rids}
    for _ in range(20):
        for r in rids:
            wants[r] += rng.randint(0, 2 * page_size)
        bounds = [wants[r] for r in rids]
        for r, n in zip(rids, bounds):
            assert one.reserve(r, n)
        assert batch.reserve_all(rids, bounds)
        assert [batch.pages(r) for r in rids] == [one.pages(r) for r in rids]
        check(batch, rows)
    free = batch.allocator.num_free_pages
    held = {r: batch.pages(r) for r in rids}
    too_much = [wants[r] + (free // len(rids) + 2) * page_size for r in rids]
    assert not batch.reserve_all(rids, too_much)
    assert batch.allocator.num_free_pages == free and {r: batch.pages(r) for r in rids} == held


def test_reserving_for_a_batch_evicts_cached_pages_nobody_uses():
    from specserve.kv.prefix_cache import PrefixCache

    alloc = PageAllocator(10, page_size=1)
    table = KVTable(alloc)
    table.cache = PrefixCache(alloc)
    pages = alloc.alloc(5)
    table.cache.insert([1, 2, 3, 4, 5], pages, 5)
    alloc.free(pages)  # the cache alone holds them: 4 free pages, 5 evictable
    assert table.reserve_all(["a", "b"], [3, 4])  # 7 pages: 3 of them evicted
    assert len(table.pages("a")) == 3 and len(table.pages("b")) == 4
    assert table.cache.num_pages == 2 and alloc.num_free_pages == 0
    assert not table.reserve_all(["a", "c"], [4, 2])  # 3 more: only 2 evictable
    assert table.cache.num_pages == 2 and table.pages("c") == []


def test_sampling_parameters_stay_in_their_rows_as_the_rows_grow_and_go_with_a_release():
    rows = RequestRows(torch.device("cpu"), 1, max_pages=2, rows=2)
    table = KVTable(PageAllocator(64, 1))
    table.mirror = rows
    table.reserve("a", 2)
    a = rows.row("a")
    rows.set_sampling([a], [(0.7, 0.9, 0.05)], [(20, 12345, 1)], ["tag-a"])
    for i in range(5):  # more requests than rows: the row tensors are reallocated
        table.reserve(f"r{i}", 2)
    assert rows.num_rows > 2
    assert rows.sampling_floats[:, a].tolist() == pytest.approx([0.7, 0.9, 0.05])
    assert rows.sampling_ints[:, a].tolist() == [20, 12345, 1]
    assert rows.sampling_tag(a) == "tag-a"
    # the padding row samples greedily, unfiltered, speculating
    assert rows.sampling_floats[:, PAD_ROW].tolist() == [0.0, 1.0, 0.0]
    assert rows.sampling_ints[:, PAD_ROW].tolist() == [0, 0, 0]
    table.release("a")
    assert rows.sampling_tag(a) is None  # its next holder writes its own
