"""The one-kernel accepted-path KV compaction against torch's gather-then-scatter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the compaction kernel needs the triton package")

from specserve.ops.triton_kv_commit import commit_path  # noqa: E402
from specserve.speculative.kv_commit import commit_path_reference  # noqa: E402
from specserve.speculative.tree import accept  # noqa: E402
from tests.engine_utils import random_trees, target_following_random_paths  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "bsz,n,max_depth,layers,kv_heads,head_dim,dtype",
    [
        (1, 6, 5, 2, 1, 16, torch.float32),  # a chain
        (3, 16, 4, 3, 2, 32, torch.float16),
        (4, 64, 8, 2, 3, 64, torch.float32),  # rows wider than one block loop (192)
        (2, 9, 3, 1, 8, 128, torch.float16),  # 1024-wide rows
    ],
)
def test_commit_path_matches_reference(bsz, n, max_depth, layers, kv_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(bsz * 1000 + n)
    trees = random_trees(bsz, n, max_depth, g)
    acc = accept(trees, target_following_random_paths(trees, g))
    assert int(acc.accept_len.max()) > 2  # something moves
    window = n + 3
    num_slots = bsz * window + 7
    # each request's window in scattered, distinct slots (paged layouts look like this)
    window_slots = torch.randperm(num_slots, generator=g)[: bsz * window].view(bsz, window)
    buffer = torch.randn(2, layers, num_slots, kv_heads, head_dim, generator=g).to(dtype)
    expected = buffer.clone()
    commit_path_reference(expected, window_slots, acc.path)
    got = buffer.clone().to(DEVICE)
    commit_path(got, window_slots.to(DEVICE), acc.path.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    # the accepted path's rows really moved to the front of the window
    for b in range(bsz):
        for d in range(int(acc.accept_len[b])):
            src = window_slots[b, acc.path[b, d]]
            assert torch.equal(got[:, :, window_slots[b, d]].cpu(), buffer[:, :, src])
