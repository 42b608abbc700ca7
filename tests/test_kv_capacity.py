"""How many tokens the KV cache holds on a GPU: mem_fraction_static's share of the device's
memory, less the weights already loaded and the largest decode step's logits (a tree verifies
every node of every running request, each a row of vocabulary-sized logits)."""

from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig
from specserve.errors import InvalidArgument
from specserve.runtime import capacity
from specserve.runtime.capacity import kv_pages, step_reserve_bytes

GIB = 2**30


def test_the_largest_step_is_kept_out_of_the_kv_cache(monkeypatch):
    """80 GiB device, 10 GiB of it taken: a plain SmolLM2-vocabulary step at 256 requests
    needs little; the 6/8/64 tree at 256 requests needs 16,384 rows of logits."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 80 * GIB))
    cfg = EngineConfig(mem_fraction_static=0.85, page_size=1)
    dev = torch.device("cuda")
    plain = step_reserve_bytes(256, 1, 49152)
    tree = step_reserve_bytes(256, 64, 49152)
    assert plain < 2.7 * GIB and 11 * GIB < tree < 12 * GIB
    # (exactly what a 16,384-row step holds at its peak, and the filters' block)
    assert tree == 16384 * 49152 * 13 + 2**25 * 48
    per_token = 1024
    pages_plain, (_, tokens_plain, why) = kv_pages(cfg, dev, per_token, step_reserve=plain)
    pages_tree, (_, tokens_tree, _) = kv_pages(cfg, dev, per_token, step_reserve=tree)
    headroom = 0.15 * 80 * GIB
    assert tokens_plain == pytest.approx((70 * GIB - headroom - plain) / per_token, abs=2)
    assert tokens_tree == pytest.approx((70 * GIB - headroom - tree) / per_token, abs=2)
    assert "for the largest decode step's logits" in why
    # a step larger than the memory left is refused by name, with what would help
    with pytest.raises(InvalidArgument) as err:
        kv_pages(cfg, dev, per_token, step_reserve=60 * GIB)
    assert err.value.field == "mem_fraction_static" and "max_running_requests" in str(err.value)


def test_a_requested_kv_size_is_taken_as_given(monkeypatch):
    monkeypatch.setattr(capacity, "_tokens_in_free_memory", lambda *a: pytest.fail("measured"))
    cfg = EngineConfig(max_total_tokens=4096, page_size=16)
    _, (_, tokens, why) = kv_pages(cfg, torch.device("cuda"), 1024, step_reserve=10 * GIB)
    assert tokens == 4096 and why.startswith("4096 requested")
