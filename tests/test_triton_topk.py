"""Split-row top-k of log_softmax and argmax against torch, ties and -inf rows included."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the top-k kernels need the triton package")

from specserve.ops.triton_topk import (  # noqa: E402
    plan_chunks,
    row_argmax,
    row_argmax_reference,
    row_topk_logprobs,
    row_topk_logprobs_reference,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # the interpreter handles bf16 too
TOL = dict(rtol=1e-5, atol=1e-5)

# (T, V, k, chunk, block); None = plan_chunks. Covers V = 1, V < block, V = block + 1 (a
# last chunk of one column, fewer columns than k), many chunks, several tiles per chunk.
CASES = [
    (1, 1, 1, None, None),
    (3, 7, 4, None, None),
    (4, 65, 16, 64, 64),
    (6, 1025, 2, None, None),
    (3, 5000, 16, None, None),
    (2, 4099, 8, 1024, 256),
    (9, 777, 1, 256, 64),
]


def random_logits(rows, vocab, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, vocab, generator=g)).to(dtype).to(DEVICE)


def expected(logits, k):
    """The tie rule made explicit: by float32 logit, descending, equal values lower id first
    (a stable sort). Log-probs are torch's log_softmax at those ids."""
    xf = logits.float()
    ids = torch.sort(xf, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.log_softmax(xf, -1).gather(-1, ids), ids


def check(logits, k, **plan):
    logp, ids = row_topk_logprobs(logits, k, **plan)
    assert logp.dtype == torch.float32 and ids.dtype == torch.int64
    assert logp.shape == ids.shape == (logits.shape[0], k)
    want_logp, want_ids = expected(logits, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logp, want_logp, equal_nan=True, **TOL)
    ref_logp, _ = row_topk_logprobs_reference(logits, k)
    torch.testing.assert_close(logp, ref_logp, equal_nan=True, **TOL)
    argmax = row_argmax(logits, **plan)
    assert torch.equal(argmax, want_ids[:, 0])
    assert torch.equal(argmax, row_argmax_reference(logits))
    return logp, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab, k, chunk, block", CASES)
def test_matches_reference(rows, vocab, k, chunk, block, dtype):
    logits = random_logits(rows, vocab, dtype, seed=rows * 1000 + vocab + k)
    _, ids = check(logits, k, chunk=chunk, block=block)
    if dtype == torch.float32:  # no ties in these fp32 draws: torch's own ids, exactly
        assert torch.equal(ids, row_topk_logprobs_reference(logits, k)[1])


def test_many_rows():
    """T = 70 (the interpreter runs one program at a time: kept to one dtype)."""
    logits = random_logits(70, 100, torch.float32, seed=70)
    _, ids = check(logits, 8)
    assert torch.equal(ids, row_topk_logprobs_reference(logits, 8)[1])


def test_one_wide_row():
    """Llama-3-like width at T = 1 with the default plan (48 chunks of 1024)."""
    logits = random_logits(1, 49152, torch.bfloat16, seed=7)
    assert plan_chunks(1, 49152) == (1024, 1024)
    check(logits, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="interpreter: one program at a time")
def test_large_shapes_on_cuda():
    """T = 1024 (the throughput plan) and V = 256k at T = 1 (128 chunks, k = 16)."""
    check(random_logits(1024, 5000, torch.bfloat16, seed=1), 8)
    check(random_logits(1, 262144, torch.bfloat16, seed=2), 16)
    check(random_logits(33, 128256, torch.float16, seed=3), 4)


def test_ties_lowest_column_first():
    dtype, plan = torch.float16, dict(chunk=1024, block=256)
    zeros = torch.zeros(2, 1500, dtype=dtype, device=DEVICE)
    zeros[1, 1::2] = -0.0  # -0.0 equals +0.0
    logp, ids = check(zeros, 16, **plan)
    assert torch.equal(ids, torch.arange(16, device=DEVICE).expand(2, 16))
    assert torch.allclose(logp, torch.full_like(logp, -torch.log(torch.tensor(1500.0)).item()))

    # repeated maxima in different chunks and tiles, more of them than k
    x = random_logits(3, 3000, dtype, seed=11, scale=1.0)
    cols = torch.tensor([2999, 1500, 700, 3, 1024, 1023])
    x[:, cols] = 9.0
    x[1, 5] = 8.0  # a strict runner-up behind the tied block
    x[2, cols[:3]] = 8.0  # ties at the k boundary below two maxima
    _, ids = check(x, 4, **plan)
    assert ids[0].tolist() == [3, 700, 1023, 1024]
    assert ids[1].tolist() == [3, 700, 1023, 1024]
    assert ids[2].tolist() == [3, 1023, 1024, 700]
    _, ids = check(x, 8, **plan)
    assert ids[1].tolist()[:7] == [3, 700, 1023, 1024, 1500, 2999, 5]
    assert row_argmax(x, **plan).tolist() == [3, 3, 3]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's -inf - -inf
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_with_neg_inf(dtype):
    plan = dict(chunk=512, block=128)
    x = random_logits(5, 1200, dtype, seed=3)
    x[0, ::3] = float("-inf")  # filtered entries scattered
    x[1] = float("-inf")
    x[1, [1199, 40, 700]] = torch.tensor([0.5, 2.0, 0.5], dtype=dtype, device=DEVICE)  # k > 3
    x[2] = float("-inf")  # a row entirely -inf
    x[3, :1024] = float("-inf")  # whole chunks -inf
    logp, ids = check(x, 8, **plan)
    assert ids[1].tolist() == [40, 700, 1199, 0, 1, 2, 3, 4]
    assert torch.isfinite(logp[1, :3]).all() and (logp[1, 3:] == float("-inf")).all()
    assert ids[2].tolist() == list(range(8)) and logp[2].isnan().all()
    assert row_argmax(x, **plan)[1:3].tolist() == [40, 0]
    check(x, 1, **plan)


def test_strided_rows():
    buf = random_logits(12, 3000, torch.float16, seed=5)
    view = buf[::2, 17:2517]  # row stride 6000, offset start, last dim contiguous
    assert view.stride() == (6000, 1)
    check(view, 4, chunk=1024, block=512)
    check(buf.t()[:5], 2)  # last dim strided: copied to contiguous first


def test_empty_batch():
    logits = torch.empty(0, 100, device=DEVICE)
    logp, ids = row_topk_logprobs(logits, 5)
    assert logp.shape == ids.shape == (0, 5)
    assert row_argmax(logits).shape == (0,)


@pytest.mark.parametrize("k, vocab", [(0, 100), (17, 100), (-1, 100), (6, 5)])
def test_k_out_of_range(k, vocab):
    with pytest.raises(ValueError, match=r"\bk\b"):
        row_topk_logprobs(torch.zeros(2, vocab, device=DEVICE), k)


def test_plan():
    for rows, vocab in [(1, 1), (1, 49152), (1, 262144), (64, 128256), (1024, 5), (1024, 262144)]:
        chunk, block = plan_chunks(rows, vocab, 4)
        assert block <= chunk and chunk & (chunk - 1) == 0 and block & (block - 1) == 0
        assert -(-vocab // chunk) <= 128
    assert plan_chunks(1, 128256) == (1024, 1024)  # 126 programs at batch 1
    assert plan_chunks(8, 49152, 8) == (1024, 1024)
    assert plan_chunks(512, 128256, 8) == (16384, 256)  # 8 partials a row at large T
    assert plan_chunks(512, 128256, 1) == (16384, 512)


@pytest.mark.parametrize("rows, vocab, k", [(1, 300, 8), (8, 2500, 8), (3, 40, 16)])
def test_id_map_returns_the_mapped_ids_of_the_same_columns(rows, vocab, k):
    """A reduced draft vocabulary: column c of the logits is target token id_map[c]."""
    logits = random_logits(rows, vocab, torch.bfloat16, seed=vocab + k)
    id_map = torch.randperm(10 * vocab, generator=torch.Generator().manual_seed(k))[:vocab]
    id_map = id_map.to(DEVICE)
    logp, ids = row_topk_logprobs(logits, k, id_map=id_map)
    want_logp, want_cols = expected(logits, k)
    assert torch.equal(ids, id_map[want_cols])
    torch.testing.assert_close(logp, want_logp, **TOL)
    ref_logp, _ = row_topk_logprobs_reference(logits.float(), k, id_map)
    torch.testing.assert_close(logp, ref_logp, **TOL)
