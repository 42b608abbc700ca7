"""The one-launch decode metadata kernel against the torch ops of build_device_metadata."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the metadata kernel needs the triton package")

from specserve.ops.attention_metadata import (  # noqa: E402
    _device_metadata_tensors_reference,
    build_device_metadata,
)
from specserve.ops.triton_metadata import MAX_BLOCK_B, device_metadata_tensors  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAMES = ("qo_indptr", "kv_indptr", "kv_indices", "extra_lens", "mask_indptr")


def random_inputs(bsz, width, slack, dtype, seed):
    """owned_slots as a column slice of a wider tensor (non-contiguous), random slot values;
    visible_lens in [0, width + 3] (0s, and lengths past width whose positions clamp), as a
    strided view; host upper bounds >= the lengths by up to `slack` each."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randint(0, 1 << 20, (bsz, width + 5), generator=g, dtype=dtype)
    owned = wide[:, 3 : 3 + width]
    assert bsz < 2 or not owned.is_contiguous()
    lens2 = torch.randint(0, width + 4, (bsz, 2), generator=g, dtype=torch.int64).to(dtype)
    if bsz > 1:
        lens2[0, 0] = 0
    lens = lens2[:, 0]
    upper = [int(n) + int(torch.randint(0, slack + 1, (1,), generator=g)) for n in lens]
    return owned, lens, upper


def assert_same(got, expected):
    for name, a, b in zip(NAMES, got, expected, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape)
        assert torch.equal(a.cpu(), b.cpu()), (name, a, b)


@pytest.mark.parametrize(
    "bsz,width,slack,dtype",
    [
        (1, 7, 0, torch.int64),
        (1, 1, 3, torch.int64),  # one slot: every position clamps to it
        (2, 9, 4, torch.int64),
        (3, 16, 2, torch.int32),
        (7, 5, 6, torch.int64),
        (64, 6, 3, torch.int64),
        (2 * MAX_BLOCK_B + 44, 4, 2, torch.int64),  # three chunks of the B loop, one partial
    ],
)
@pytest.mark.parametrize("q_len,extra_len,with_mask", [(1, 1, False), (5, 4, True), (3, 0, True)])
def test_kernel_matches_reference(bsz, width, slack, dtype, q_len, extra_len, with_mask):
    owned, lens, upper = random_inputs(bsz, width, slack, dtype, seed=bsz * 131 + width + slack)
    total_upper = sum(upper)
    expected = _device_metadata_tensors_reference(
        owned, lens, total_upper, q_len, extra_len, with_mask
    )
    got = device_metadata_tensors(
        owned.to(DEVICE), lens.to(DEVICE), total_upper, q_len, extra_len, with_mask
    )
    assert_same(got, expected)
    if slack:  # the upper bounds' slack is zeros at the tail
        total = int(lens.sum())
        assert total < total_upper and not got[2][total:].any()


@pytest.mark.parametrize("bsz", [0, 1, 3])
def test_kernel_total_upper_zero(bsz):
    """Nothing visible: no kv_indices, but the small tensors are still written (grid of 1)."""
    g = torch.Generator().manual_seed(bsz)
    owned = torch.randint(0, 100, (bsz, 4), generator=g)
    lens = torch.zeros(bsz, dtype=torch.int64)
    expected = _device_metadata_tensors_reference(owned, lens, 0, 2, 3, True)
    got = device_metadata_tensors(owned.to(DEVICE), lens.to(DEVICE), 0, 2, 3, True)
    assert_same(got, expected)
    assert got[2].numel() == 0


def test_kernel_when_lens_exceed_upper_bounds():
    """The bounds only size kv_indices: a real total past it is cut off as in torch."""
    owned = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(5))
    lens = torch.tensor([6, 7, 8])
    expected = _device_metadata_tensors_reference(owned, lens, 10, 1, 1, False)
    got = device_metadata_tensors(owned.to(DEVICE), lens.to(DEVICE), 10, 1, 1, False)
    assert_same(got, expected)


def _check_build(meta, owned, lens, upper, q_len, extra_len, mask):
    expected = _device_metadata_tensors_reference(
        owned.cpu(), lens.cpu(), sum(upper), q_len, extra_len, mask is not None
    )
    got = (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.extra_lens, meta.mask_indptr)
    assert_same(got, expected)
    bsz = owned.shape[0]
    assert meta.host_qo_indptr == [q_len * i for i in range(bsz + 1)]
    assert meta.host_kv_indptr == [sum(upper[:i]) for i in range(bsz + 1)]
    assert meta.host_extra_lens == [extra_len] * bsz
    if mask is None:
        assert meta.host_mask_indptr is None and meta.custom_mask is None
    else:
        assert meta.host_mask_indptr == [q_len * extra_len * i for i in range(bsz + 1)]
        assert meta.custom_mask is mask
    assert meta.host_kv_is_upper_bound


@pytest.mark.parametrize("with_mask", [False, True])
def test_build_device_metadata_matches_reference(with_mask):
    """Through the public function, on whichever path this machine takes."""
    owned, lens, upper = random_inputs(5, 12, 3, torch.int64, seed=11)
    owned, lens = owned.to(DEVICE), lens.to(DEVICE)
    q_len, extra_len = 4, 3
    mask = torch.ones(5 * q_len * extra_len, dtype=torch.bool, device=DEVICE) if with_mask else None
    out_loc = torch.arange(5 * q_len, device=DEVICE)
    meta = build_device_metadata(owned, lens, upper, q_len, extra_len, out_loc, mask)
    assert meta.out_cache_loc is out_loc
    _check_build(meta, owned, lens, upper, q_len, extra_len, mask)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["reference", "kernel"])
def test_build_device_metadata_either_way(use_kernel):
    """The caller's kernel choice: the one-launch kernel (the interpreter on CPU) or the torch
    ops build the same metadata."""
    owned, lens, upper = random_inputs(3, 10, 2, torch.int64, seed=3)
    owned, lens = owned.to(DEVICE), lens.to(DEVICE)
    meta = build_device_metadata(owned, lens, upper, 2, 2, None, use_kernel=use_kernel)
    _check_build(meta, owned, lens, upper, 2, 2, None)
