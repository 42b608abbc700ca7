"""The sampler's filters (top-k, top-p, min-p) as a per-row search kernel against its torch
reference, and the reference against a plain walk down each sorted row."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the filter kernel needs the triton package")

from specserve.config.kernels import REFERENCE, Kernels  # noqa: E402
from specserve.ops.sampling import SamplingTensors, filter_logits, noise_keys, sample  # noqa: E402
from specserve.ops.triton_filter import filter_floor, filter_floor_reference  # noqa: E402
from specserve.ops.triton_gumbel import gumbel_argmax, gumbel_argmax_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_rows(rows: int, vocab: int, seed: int, ties: bool = False, dtype=torch.float32):
    """Logits and per-row filters, each filter off in some rows and at edge values in others."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(rows, vocab, generator=g)
    if ties:  # whole numbers: runs of equal values everywhere, at the max too
        logits = logits.round()
    masked = torch.rand(rows, vocab, generator=g) < 0.1  # (a grammar's or a bias's -inf)
    masked[:, 0] = False
    logits = logits.masked_fill(masked, float("-inf"))
    temps = 0.3 + 1.5 * torch.rand(rows, generator=g)
    top_ks = torch.randint(-1, vocab + 3, (rows,), generator=g)
    top_ks[::5] = -1
    top_ks[1::7] = 1
    top_ps = 0.05 + 0.95 * torch.rand(rows, generator=g)
    top_ps[::3] = 1.0
    top_ps[2::9] = 1e-9
    min_ps = torch.rand(rows, generator=g) * 0.3
    min_ps[::2] = 0.0
    min_ps[4::11] = 1.0
    return [t.to(DEVICE) for t in (logits.to(dtype), temps, top_ks, top_ps, min_ps)]


def walk_down(scaled_row: torch.Tensor, k: int, p: float, min_p: float) -> float:
    """The floor of one row of distinct values the way the filters are defined: down the
    sorted row, keep a token while it is among the top k, the top-k mass above it is below p
    of that mass, and it is at least min_p times as likely as the first."""
    probs = torch.softmax(scaled_row.double(), dim=-1)
    values, order = scaled_row.sort(descending=True)
    ranked = probs[order]
    k = k if 0 < k < len(ranked) else len(ranked)
    kept_mass = ranked[:k].sum().item()
    floor, above = values[0].item(), 0.0
    for rank in range(1, k):
        above += ranked[rank - 1].item()
        if above >= p * kept_mass or ranked[rank].item() < min_p * ranked[0].item():
            break
        floor = values[rank].item()
    return floor


@pytest.mark.parametrize(
    "rows, vocab, ties", [(16, 1, False), (16, 7, True), (24, 700, False), (20, 1500, True)]
)
def test_kernel_floor_equals_the_reference(rows, vocab, ties):
    args = random_rows(rows, vocab, seed=rows * vocab, ties=ties)
    got = filter_floor(*args)
    want = filter_floor_reference(*args)
    assert torch.equal(got, want), (got, want)


def test_kernel_floor_of_strided_16_bit_rows():
    logits, *params = random_rows(12, 900, seed=5, dtype=torch.bfloat16)
    wide = torch.zeros(12, 1300, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 200:1100] = logits
    got = filter_floor(wide[:, 200:1100], *params)
    assert torch.equal(got, filter_floor_reference(logits, *params))


def test_a_rows_floor_is_the_same_alone_and_in_a_batch():
    args = random_rows(10, 600, seed=9)
    batch = filter_floor(*args)
    for i in (0, 3, 9):
        assert torch.equal(filter_floor(*(a[i : i + 1] for a in args)), batch[i : i + 1])


def test_reference_floor_is_the_walk_down_the_sorted_row():
    logits, temps, top_ks, top_ps, min_ps = (a.cpu() for a in random_rows(40, 300, seed=2))
    logits = logits.masked_fill(logits == float("-inf"), -50.0)  # distinct values only
    floor = filter_floor_reference(logits, temps, top_ks, top_ps, min_ps)
    for i in range(len(logits)):
        scaled = logits[i] / temps[i]
        want = walk_down(scaled, top_ks[i].item(), top_ps[i].item(), min_ps[i].item())
        assert floor[i].item() == want, i


def test_equal_values_share_their_fate():
    logits = torch.tensor([[2.0, 5.0, 5.0, 1.0, 0.0], [3.0, 3.0, 3.0, 0.0, -1.0]], device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    for fn in (filter_floor, filter_floor_reference):
        # top-1 keeps both maxima; top-2 of [3, 3, 3, ...] keeps all three threes
        floor = fn(logits, ones, torch.tensor([1, 2], device=DEVICE), ones, 0 * ones)
        assert floor.tolist() == [5.0, 3.0]
        # top-p 1e-9 keeps only the likeliest value, and all its copies
        tiny = torch.full((2,), 1e-9, device=DEVICE)
        floor = fn(logits, ones, torch.tensor([-1, -1], device=DEVICE), tiny, 0 * ones)
        assert floor.tolist() == [5.0, 3.0]


def test_no_filter_keeps_every_token_and_min_p_one_keeps_the_likeliest():
    logits, temps, _, _, _ = random_rows(6, 400, seed=4)
    logits[:3] = logits[:3].masked_fill(logits[:3] == float("-inf"), -80.0)
    off = torch.full((6,), -1, dtype=torch.int64, device=DEVICE)
    ones, zeros = torch.ones(6, device=DEVICE), torch.zeros(6, device=DEVICE)
    scaled = logits / temps[:, None]
    assert torch.equal(filter_floor(logits, temps, off, ones, zeros), scaled.amin(dim=-1))
    assert torch.equal(filter_floor(logits, temps, off, ones, ones), scaled.amax(dim=-1))


def test_draws_below_the_floor_never_happen_and_match_the_torch_draw():
    logits, temps, top_ks, top_ps, min_ps = random_rows(16, 500, seed=11)
    keys = noise_keys(torch.arange(16, device=DEVICE) * 31 + 7, torch.arange(16, device=DEVICE))
    floor = filter_floor(logits, temps, top_ks, top_ps, min_ps)
    got = gumbel_argmax(logits, temps, keys, floor)
    scaled = logits / temps[:, None]
    assert (scaled.gather(1, got[:, None]).squeeze(1) >= floor).all()
    want = gumbel_argmax_reference(logits, temps, keys, floor)
    assert (got == want).float().mean() >= 0.9  # (equal but where the noise's logs round)


@pytest.mark.parametrize("search_min_rows", [1, 10**9])
def test_sampler_with_the_kernel_draws_what_the_torch_path_draws(search_min_rows, monkeypatch):
    """`sample` with the Triton reductions (the floor from the search kernel, or for few rows
    from the sort, then the kernel's draw above it) and without (the reference's -inf mask,
    then torch's noise): the same tokens."""
    import specserve.ops.sampling as sampling

    monkeypatch.setattr(sampling, "FILTER_SEARCH_MIN_ROWS", search_min_rows)
    logits, temps, top_ks, top_ps, min_ps = random_rows(16, 800, seed=21)
    st = SamplingTensors(
        temperatures=temps,
        top_ks=top_ks,
        top_ps=top_ps,
        min_ps=min_ps,
        seeds=torch.arange(16, device=DEVICE) * 3 + 1,
        all_greedy=False,
        needs_filter=True,
    )
    positions = torch.arange(16, device=DEVICE) + 40
    fast = sample(logits, st, positions, Kernels(sampling_reductions=True, filter_search=True))
    plain = sample(logits, st, positions, REFERENCE)
    assert (fast == plain).float().mean() >= 0.9
    kept = filter_logits(logits / temps[:, None], st) > float("-inf")
    assert kept.gather(1, fast[:, None]).all()


def test_a_seeded_rows_draw_is_the_same_alone_and_in_a_batch_that_runs_the_search(monkeypatch):
    """A row alone takes its floor from the sort, the same row in a batch of as many rows as
    FILTER_SEARCH_MIN_ROWS from the search: the two find the same floor, so the draw does not
    depend on the batch, and deterministic inference runs the search as the default does."""
    import specserve.ops.sampling as sampling
    import specserve.ops.triton_filter as triton_filter
    from specserve.config.kernels import resolve_kernels

    resolve = dict(on_gpu=True, half_precision=True, triton=True, disabled=False)
    default, _ = resolve_kernels(**resolve, torch_version=(2, 11))
    deterministic, _ = resolve_kernels(**resolve, torch_version=(2, 11), deterministic=True)
    assert default.filter_search and deterministic.filter_search

    searched = []
    search = triton_filter.filter_floor

    def counted(*args):
        searched.append(args[0].shape[0])
        return search(*args)

    monkeypatch.setattr(sampling, "FILTER_SEARCH_MIN_ROWS", 12)
    monkeypatch.setattr(triton_filter, "filter_floor", counted)
    rows = 12
    logits, temps, top_ks, top_ps, min_ps = random_rows(rows, 900, seed=31, ties=True)
    st = SamplingTensors(
        temps, top_ks, top_ps, min_ps, torch.arange(rows, device=DEVICE) * 5 + 2, False, True
    )
    positions = torch.arange(rows, device=DEVICE) + 17
    kernels = Kernels(sampling_reductions=True, filter_search=True)
    together = sample(logits, st, positions, kernels)
    assert searched == [rows]
    alone = [
        sample(logits[i : i + 1], st.take(slice(i, i + 1)), positions[i : i + 1], kernels)
        for i in range(rows)
    ]
    assert searched == [rows]  # (alone: the sort)
    assert torch.equal(torch.cat(alone), together)


def top_p_where_float_sums_disagree(values: torch.Tensor, rows: int) -> float:
    """A top_p at which a float32 sum of the row's probability weights taken alone and the same
    sum inside a batch of `rows` (torch orders a sum by the batch's shape) put a token on
    different sides of the top-p boundary."""
    e = torch.exp(values - values[0])
    alone = e[None].sum(-1)[0]
    together = e[None].expand(rows, len(e)).contiguous().sum(-1)[0]
    if alone == together:  # (one thread sums both alike: take another order)
        together = e.flip(0).sum()
    above = torch.cumsum(e, 0) - e
    for rank in range(1, 200):
        p = (above[rank] / alone).item()
        for _ in range(8):
            t = torch.tensor(p, dtype=torch.float32)
            if (above[rank] < t * alone) != (above[rank] < t * together):
                return t.item()
            p = float(np.nextafter(np.float32(p), np.float32(1 if above[rank] >= t * alone else 0)))
    raise AssertionError("no top_p separates the two sums")


def test_a_seeded_rows_draw_is_the_same_alone_and_in_a_batch_on_the_sort_path():
    """What deterministic inference runs at any row count (and a CPU always), at a top_p
    where a float32 kept mass would move the boundary with the batch: the kept mass is an
    integer sum, so no draw does."""
    rows, vocab = 64, 128256
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (with one, torch sums a row alone and in a batch alike)
    try:
        _draws_alone_and_together(rows, vocab)
    finally:
        torch.set_num_threads(threads)


def _draws_alone_and_together(rows: int, vocab: int) -> None:
    row = 3.0 * torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    top_p = top_p_where_float_sums_disagree(row[0].sort(descending=True).values, rows)
    batch = row.expand(rows, vocab).contiguous().to(DEVICE)
    ones = torch.ones(rows, device=DEVICE)
    st = SamplingTensors(
        temperatures=ones,
        top_ks=torch.full((rows,), -1, device=DEVICE),
        top_ps=torch.full((rows,), top_p, device=DEVICE),
        min_ps=0 * ones,
        seeds=torch.arange(rows, device=DEVICE) * 7919 + 3,
        all_greedy=False,
        needs_filter=True,
    )
    positions = torch.full((rows,), 100, device=DEVICE)
    together = sample(batch, st, positions)
    alone = [
        sample(batch[i : i + 1], st.take(slice(i, i + 1)), positions[i : i + 1])
        for i in range(rows)
    ]
    assert torch.equal(torch.cat(alone), together)


def test_nan_logits_count_as_minus_infinity_in_the_floor_and_an_empty_batch_draws_nothing():
    logits, temps, top_ks, top_ps, min_ps = random_rows(6, 200, seed=41)
    logits[:, 7] = float("nan")
    logits[2] = float("nan")
    logits[2, 3] = 1.0
    want = filter_floor_reference(
        logits.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")),
        temps,
        top_ks,
        top_ps,
        min_ps,
    )
    assert torch.equal(filter_floor_reference(logits, temps, top_ks, top_ps, min_ps), want)
    assert torch.equal(filter_floor(logits, temps, top_ks, top_ps, min_ps), want)
    st = SamplingTensors(temps, top_ks, top_ps, min_ps, torch.arange(6, device=DEVICE), False, True)
    for kernels in (REFERENCE, Kernels(sampling_reductions=True, filter_search=True)):
        drawn = sample(logits, st, torch.arange(6, device=DEVICE), kernels)  # (no error)
        if kernels.sampling_reductions:  # (the kernel's draw never takes a NaN)
            assert drawn[2].item() == 3 and (drawn != 7).all()
        empty = sample(logits[:0], st.take(slice(0, 0)), torch.arange(0, device=DEVICE), kernels)
        assert empty.shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's expf needs a GPU")
def test_the_kernels_weights_are_torchs_bit_for_bit():
    """Both floors weigh a value by CUDA's expf: the kernel through libdevice, torch.exp by
    itself. Equal bits are what make the sort's floor and the search's agree on every row."""
    import triton
    import triton.language as tl

    from specserve.ops.triton_filter import _exp

    @triton.jit
    def exp_kernel(X, Y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + i, _exp(tl.load(X + i, mask=i < n), True), mask=i < n)

    g = torch.Generator(device="cuda").manual_seed(0)
    x = -90.0 * torch.rand(1 << 22, device="cuda", generator=g)
    y = torch.empty_like(x)
    exp_kernel[(triton.cdiv(len(x), 1024),)](x, y, len(x), BLOCK=1024)
    assert torch.equal(y, torch.exp(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="many rows: too slow interpreted")
def test_sort_and_search_floors_agree_on_many_rows():
    args = random_rows(2048, 4096, seed=77)
    assert torch.equal(filter_floor(*args), filter_floor_reference(*args))
    args = random_rows(1024, 3000, seed=78, ties=True)
    assert torch.equal(filter_floor(*args), filter_floor_reference(*args))
