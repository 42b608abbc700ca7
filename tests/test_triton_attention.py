"""TritonAttentionBackend against TorchAttentionBackend on random paged layouts.

On a machine without CUDA the kernels run in Triton's interpreter (numpy on CPU tensors), so
the CPU cases stay small; bigger shapes and 16-bit dtypes are GPU-only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported (the kernels are decorated at import time).
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="TritonAttentionBackend needs the triton package")

from specserve.kv.pool import KVCache  # noqa: E402
from specserve.ops.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402
from specserve.ops.triton_attention import TritonAttentionBackend  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
LAYER = 1  # a non-zero layer, so per-layer indexing is exercised
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass
class Req:
    q_len: int
    prefix: int  # cached KV visible to every query
    extra: int | None = None  # masked trailing KV; defaults to q_len (plain extend)


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata
    cache_ref: KVCache
    cache_tri: KVCache


def random_tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask [n, n] of a random forest with parent[i] < i."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = int(torch.randint(-1, i, (1,), generator=g))  # -1: a root under the prefix
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def make_case(
    reqs: list[Req],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    page_size: int = 1,
    dtype: torch.dtype = torch.float32,
    tree_mask: bool = False,
    seed: int = 0,
    index_dtype: torch.dtype = torch.int64,
) -> Case:
    """Scatter each request's logical positions over random non-overlapping pages of a cache
    filled with random K/V. New tokens take the last q_len positions of each request."""
    g = torch.Generator().manual_seed(seed)
    extras = [r.q_len if r.extra is None else r.extra for r in reqs]
    kv_lens = [r.prefix + e for r, e in zip(reqs, extras)]
    pages_per_req = [-(-n // page_size) for n in kv_lens]
    num_pages = 2 * sum(pages_per_req) + 3  # spare pages: slots nobody may read
    page_perm = torch.randperm(num_pages, generator=g)

    kv_slots, out_loc, masks = [], [], []
    next_page = 0
    for r, extra, kv_len, n_pages in zip(reqs, extras, kv_lens, pages_per_req):
        assert r.q_len <= kv_len
        pages = page_perm[next_page : next_page + n_pages]
        next_page += n_pages
        pos = torch.arange(kv_len)
        slots = pages[pos // page_size] * page_size + pos % page_size
        kv_slots.append(slots)
        out_loc.append(slots[kv_len - r.q_len :])
        if tree_mask:
            # The last q_len extra columns are this forward's tree; earlier extra columns
            # (tree drafting: nodes of previous steps) are visible at random.
            block = torch.rand(r.q_len, extra, generator=g) < 0.5
            tree_cols = min(r.q_len, extra)
            block[:, extra - tree_cols :] = random_tree_mask(r.q_len, g)[:, -tree_cols:]
            masks.append(block.flatten())

    qo, kv, mask_ptr = [0], [0], [0]
    for r, extra, kv_len in zip(reqs, extras, kv_lens):
        qo.append(qo[-1] + r.q_len)
        kv.append(kv[-1] + kv_len)
        mask_ptr.append(mask_ptr[-1] + r.q_len * extra)

    def dev(x):
        return torch.as_tensor(x, dtype=index_dtype).to(DEVICE)

    meta = AttentionMetadata(
        qo_indptr=dev(qo),
        kv_indptr=dev(kv),
        kv_indices=dev(torch.cat(kv_slots)),
        extra_lens=dev(extras),
        out_cache_loc=torch.cat(out_loc).to(DEVICE),
        custom_mask=torch.cat(masks).to(DEVICE) if tree_mask else None,
        mask_indptr=dev(mask_ptr) if tree_mask else None,
        host_qo_indptr=qo,
        host_kv_indptr=kv,
        host_extra_lens=extras,
        host_mask_indptr=mask_ptr if tree_mask else None,
    )
    num_slots = num_pages * page_size
    cache_ref = KVCache(2, num_slots, kv_heads, head_dim, dtype, DEVICE)
    cache_tri = KVCache(2, num_slots, kv_heads, head_dim, dtype, DEVICE)
    for layer in range(2):
        for a, b in ((cache_ref.k, cache_tri.k), (cache_ref.v, cache_tri.v)):
            a[layer].copy_(torch.randn(a[layer].shape, generator=g).to(dtype))
            b[layer].copy_(a[layer])
    t = qo[-1]

    def rnd(h):
        return torch.randn(t, h, head_dim, generator=g).to(dtype).to(DEVICE)

    return Case(rnd(heads), rnd(kv_heads), rnd(kv_heads), meta, cache_ref, cache_tri)


def check(case: Case, backend: TritonAttentionBackend | None = None) -> torch.Tensor:
    backend = backend or TritonAttentionBackend()
    ref = TorchAttentionBackend().forward(LAYER, case.q, case.k, case.v, case.cache_ref, case.meta)
    out = backend.forward(LAYER, case.q, case.k, case.v, case.cache_tri, case.meta)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    tol = TOL[case.q.dtype]
    # Requests with q_len == 0 have no rows; every row is compared.
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    for layer in range(2):  # written layer matches; the other layer is untouched
        assert torch.equal(case.cache_tri.k[layer], case.cache_ref.k[layer])
        assert torch.equal(case.cache_tri.v[layer], case.cache_ref.v[layer])
    loc = case.meta.out_cache_loc
    assert torch.equal(case.cache_tri.k[LAYER][loc], case.k.to(case.cache_tri.k[LAYER].dtype))
    assert torch.equal(case.cache_tri.v[LAYER][loc], case.v.to(case.cache_tri.v[LAYER].dtype))
    return out


# Shape variants: (page_size, gqa ratio, head_dim); kv_heads = 2 everywhere on CPU. Heads
# narrower than 16 are padded to 16 lanes (tl.dot needs it on a GPU).
SHAPES = [(1, 1, 16), (3, 2, 32), (16, 4, 64), (2, 2, 8)]


@pytest.mark.parametrize("page_size,group,head_dim", SHAPES)
def test_decode_batch(page_size, group, head_dim):
    reqs = [Req(1, n) for n in (0, 5, 77, 130)]
    case = make_case(
        reqs, heads=2 * group, head_dim=head_dim, page_size=page_size, seed=11 + page_size
    )
    check(case)


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_decode_forced_splits(splits):
    # More splits than some requests have KV for: empty chunks must get zero weight.
    reqs = [Req(1, n) for n in (300, 2, 64, 129)]
    check(make_case(reqs, heads=8, page_size=16, seed=20 + splits), TritonAttentionBackend(splits))


def test_decode_more_splits_than_one_merge_pass():
    """Past MERGE_BLOCK_S splits the merge takes several passes with a running max; a request
    shorter than the others leaves whole passes empty."""
    from specserve.ops.triton_kernels.decode import MERGE_BLOCK_S

    reqs = [Req(1, n) for n in (1250, 5, 700)]
    backend = TritonAttentionBackend(num_kv_splits=20)
    check(make_case(reqs, heads=4, kv_heads=2, head_dim=16, page_size=16, seed=24), backend)
    assert backend._plan is not None and backend._plan.num_splits > MERGE_BLOCK_S


def test_decode_long_context_batch_one():
    # The host heuristic (4 "SMs" on CPU) splits a single long request several ways.
    backend = TritonAttentionBackend(min_kv_per_split=64)
    case = make_case([Req(1, 900)], heads=4, kv_heads=1, head_dim=16, page_size=3, seed=3)
    check(case, backend)
    assert backend._plan is not None and backend._plan.num_splits > 1


@pytest.mark.parametrize("page_size,group,head_dim", SHAPES)
def test_prefill_no_prefix(page_size, group, head_dim):
    reqs = [Req(37, 0), Req(1, 0), Req(70, 0)]
    case = make_case(
        reqs, heads=2 * group, head_dim=head_dim, page_size=page_size, seed=30 + page_size
    )
    check(case)


@pytest.mark.parametrize("page_size,group,head_dim", SHAPES)
def test_extend_over_cached_prefix(page_size, group, head_dim):
    reqs = [Req(20, 50), Req(3, 130), Req(65, 7)]
    case = make_case(
        reqs, heads=2 * group, head_dim=head_dim, page_size=page_size, seed=40 + page_size
    )
    check(case)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("tree", [False, True])
def test_extend_split_prefix(splits, tree):
    # Prefix split across programs; one request without prefix (all splits but the last are
    # empty for it), one with q_len 0, one shorter than the split size.
    reqs = [Req(7, 200), Req(12, 0), Req(0, 30), Req(1, 3, extra=4), Req(30, 90)]
    case = make_case(reqs, heads=4, page_size=3, tree_mask=tree, seed=130 + splits)
    backend = TritonAttentionBackend(num_kv_splits=splits)
    check(case, backend)
    assert backend._plan is not None and 1 < backend._plan.num_splits <= splits


@pytest.mark.parametrize("tree", [False, True])
def test_extend_prefix_in_more_splits_than_one_merge_pass(tree):
    from specserve.ops.triton_kernels.decode import MERGE_BLOCK_S

    # (no prefix: every split but the last is empty, so the merge's first pass is all empty)
    reqs = [Req(3, 1250, extra=3), Req(2, 40), Req(5, 900), Req(4, 0)]
    case = make_case(reqs, heads=4, kv_heads=2, head_dim=16, page_size=3, tree_mask=tree, seed=7)
    backend = TritonAttentionBackend(num_kv_splits=20)
    check(case, backend)
    assert backend._plan is not None and backend._plan.num_splits > MERGE_BLOCK_S


def test_tree_verify_batch_one_splits_automatically():
    # 2 programs unsplit < 4 "SMs" on CPU: the heuristic splits the 600-long prefix.
    backend = TritonAttentionBackend(min_prefix_per_split=64)
    case = make_case([Req(16, 600)], heads=4, kv_heads=1, head_dim=16, tree_mask=True, seed=140)
    check(case, backend)
    assert backend._plan is not None and backend._plan.num_splits > 1


def test_mixed_batch_with_empty_request():
    # Decode, prefill, extend and a request with no queries (skipped) in one batch.
    reqs = [Req(1, 90), Req(33, 0), Req(0, 12), Req(1, 1), Req(17, 40)]
    check(make_case(reqs, heads=8, page_size=3, seed=50))


def test_causal_extra_not_equal_q_len():
    # extra > q_len: queries also see earlier masked entries causally shifted; extra < q_len:
    # the first queries see only the prefix.
    reqs = [Req(5, 10, extra=12), Req(6, 20, extra=2), Req(4, 9, extra=0)]
    check(make_case(reqs, heads=4, page_size=16, seed=60))


@pytest.mark.parametrize("page_size,group,head_dim", SHAPES)
def test_tree_verify(page_size, group, head_dim):
    reqs = [Req(64, 45), Req(9, 0), Req(23, 130)]
    case = make_case(
        reqs,
        heads=2 * group,
        head_dim=head_dim,
        page_size=page_size,
        tree_mask=True,
        seed=70 + page_size,
    )
    check(case)


@pytest.mark.parametrize("q_len,group", [(3, 4), (5, 4), (2, 2), (7, 4)])
@pytest.mark.parametrize("tree", [False, True])
def test_short_verify_takes_a_small_tile_and_splits_like_decode(q_len, group, tree):
    """A chain's verify (few queries x a GQA group, under 64 rows) runs 16- or 32-row tiles,
    splitting the cached prefix while the grid is short of a program per SM."""
    from specserve.ops.triton_kernels.extend import extend_block_m

    assert extend_block_m(q_len * group) == max(16, 1 << (q_len * group - 1).bit_length())
    reqs = [Req(q_len, n) for n in (300, 0, 41)]
    backend = TritonAttentionBackend(min_prefix_per_split=64)
    case = make_case(
        reqs, heads=group, kv_heads=1, head_dim=32, page_size=3, tree_mask=tree, seed=q_len
    )
    check(case, backend)
    # 3 requests x 1 KV head = 3 programs, fewer than the interpreter's 4 "SMs": split
    assert backend._plan is not None and backend._plan.num_splits > 1


@pytest.mark.parametrize("group,q_len", [(3, 30), (7, 13), (5, 14), (6, 11)])
def test_causal_extend_with_a_group_that_does_not_divide_the_tile(group, q_len):
    """With a GQA group of 3, 5, 6 or 7 a 64-row tile ends partway through a query's heads;
    that query must still see its last causal key."""
    case = make_case([Req(q_len, 10), Req(q_len, 0)], heads=group, kv_heads=1, head_dim=16)
    check(case, TritonAttentionBackend(num_kv_splits=1))


def test_tree_draft_extra_longer_than_q():
    # Drafting: extra holds earlier draft levels (random visibility) plus this level's nodes.
    reqs = [Req(8, 30, extra=24), Req(4, 0, extra=12), Req(16, 5, extra=16)]
    check(make_case(reqs, heads=8, page_size=3, tree_mask=True, seed=80))


def test_custom_mask_single_query():
    # q_len 1 with a custom mask must take the masked path, not decode.
    reqs = [Req(1, 40, extra=9), Req(1, 0, extra=1), Req(1, 3, extra=5)]
    backend = TritonAttentionBackend()
    check(make_case(reqs, heads=4, page_size=1, tree_mask=True, seed=90), backend)
    assert backend._plan is not None and not backend._plan.is_decode


def test_int32_indices_and_strided_q():
    case = make_case([Req(12, 30), Req(1, 8)], heads=4, seed=100, index_dtype=torch.int32)
    # q as a view into a wider projection output (as qkv_proj(...).split gives).
    wide = torch.randn(case.q.shape[0], case.q.shape[1] * 2, case.q.shape[2], device=DEVICE)
    wide[:, : case.q.shape[1]] = case.q
    case.q = wide[:, : case.q.shape[1]]
    assert not case.q.is_contiguous()
    check(case)


def test_same_backend_across_layers_and_forwards():
    # The launch plan is cached per metadata object: a new forward must not reuse it.
    backend = TritonAttentionBackend()
    check(make_case([Req(1, 50), Req(1, 7)], seed=110), backend)
    check(make_case([Req(9, 4), Req(1, 7)], seed=111), backend)
    check(make_case([Req(1, 3)], seed=112), backend)


def test_forward_does_not_read_device_tensors(monkeypatch):
    case = make_case([Req(1, 20), Req(6, 10)], seed=120)

    def forbidden(*args, **kwargs):
        raise AssertionError("host-device sync inside forward")

    backend = TritonAttentionBackend()
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    backend.forward(LAYER, case.q, case.k, case.v, case.cache_tri, case.meta)
    monkeypatch.undo()


# ---- GPU only: bigger shapes, 16-bit dtypes, a real synchronisation check ----------------


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_decode_long(dtype, page_size):
    reqs = [Req(1, n) for n in (4000, 17, 1025, 2500, 1)]
    case = make_case(reqs, heads=32, kv_heads=8, head_dim=128, page_size=page_size, dtype=dtype)
    check(case)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_prefill_and_extend(dtype):
    reqs = [Req(1500, 0), Req(300, 2000), Req(1, 700), Req(77, 3)]
    case = make_case(reqs, heads=32, kv_heads=8, head_dim=128, page_size=16, dtype=dtype)
    check(case)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (8, 128)])
def test_gpu_tree_verify(dtype, group, head_dim):
    reqs = [Req(64, 3000), Req(60, 17), Req(1, 500, extra=1), Req(48, 900, extra=80)]
    case = make_case(
        reqs,
        heads=4 * group,
        kv_heads=4,
        head_dim=head_dim,
        page_size=16,
        dtype=dtype,
        tree_mask=True,
    )
    check(case)


@gpu
@needs_cuda
@pytest.mark.parametrize("tree", [False, True])
def test_gpu_no_synchronisation(tree):
    reqs = [Req(1, 3000), Req(1, 200)] if not tree else [Req(32, 1000), Req(8, 10)]
    case = make_case(reqs, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, tree_mask=tree)
    backend = TritonAttentionBackend()
    backend.forward(LAYER, case.q, case.k, case.v, case.cache_tri, case.meta)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward(LAYER, case.q, case.k, case.v, case.cache_tri, case.meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_tree_verify_batch_one_long_context(dtype):
    # The latency case of speculative decoding: 64 nodes over 8k cached tokens, where the
    # backend splits the prefix across programs.
    case = make_case(
        [Req(64, 8000)], heads=32, kv_heads=8, head_dim=128, page_size=16, dtype=dtype,
        tree_mask=True,
    )  # fmt: skip
    backend = TritonAttentionBackend()
    check(case, backend)
    assert backend._plan is not None and backend._plan.num_splits > 1
