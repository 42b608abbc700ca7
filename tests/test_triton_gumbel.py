"""The sampler's Gumbel-max draw as a Triton kernel against its torch reference (the noise
hashed in registers must be the reference's noise, bit for bit), and the sampler's draws
with the kernel equal to those without it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the Gumbel-max kernel needs the triton package")

from specserve.config.kernels import REFERENCE, Kernels  # noqa: E402
from specserve.ops.sampling import (  # noqa: E402
    SamplingTensors,
    gumbel_noise,
    noise_keys,
    sample,
)
from specserve.ops.triton_gumbel import (  # noqa: E402
    CHUNK,
    gumbel_argmax,
    gumbel_argmax_reference,
)
from specserve.sampling_params import GREEDY_BELOW  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def inputs(rows: int, vocab: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(rows, vocab, generator=g)).to(dtype).to(DEVICE)
    temps = (0.2 + 1.5 * torch.rand(rows, generator=g)).to(DEVICE)
    seeds = torch.randint(0, 2**40, (rows,), generator=g).to(DEVICE)
    positions = torch.randint(0, 2**20, (rows,), generator=g).to(DEVICE)
    return logits, temps, noise_keys(seeds, positions)


def assert_same_draws(got: torch.Tensor, logits, temps, keys) -> None:
    """Equal to the reference's draws, except where the reference's two best scores are
    within float32 rounding of each other (the kernel's logs may round differently)."""
    want = gumbel_argmax_reference(logits, temps, keys)
    differ = got != want
    if logits.shape[-1] < 2:
        assert not differ.any()
        return
    t = torch.where(temps >= GREEDY_BELOW, temps, torch.ones_like(temps)).double()
    scores = logits.double() / t[:, None] + gumbel_noise(keys, logits.shape[-1]).double()
    top2 = scores.topk(2, dim=-1).values
    close = (top2[:, 0] - top2[:, 1]) <= 1e-5 * top2[:, 0].abs().clamp(min=1.0)
    assert not (differ & ~close).any(), (got[differ], want[differ])
    assert differ.float().mean() <= 0.05


@pytest.mark.parametrize(
    "rows, vocab",
    [(1, 1), (3, 7), (5, CHUNK - 1), (4, CHUNK + 1), (2, 3 * CHUNK + 17), (9, 1000)],
)
def test_matches_reference(rows, vocab):
    logits, temps, keys = inputs(rows, vocab, seed=rows * 7919 + vocab)
    got = gumbel_argmax(logits, temps, keys)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert_same_draws(got, logits, temps, keys)


def test_many_rows_bf16_and_greedy_temperatures():
    """16-bit logits are read as float32; a temperature below the greedy threshold divides
    by 1 (the sampler then takes the greedy token for that row)."""
    logits, temps, keys = inputs(40, 300, seed=5, dtype=torch.bfloat16)
    temps[::3] = 0.0
    assert_same_draws(gumbel_argmax(logits, temps, keys), logits, temps, keys)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's -inf arithmetic
def test_masked_columns_are_never_drawn():
    """-inf logits (filtered or masked tokens) never win; a row entirely -inf gives column 0
    (as argmax does), one with a single finite column gives that column."""
    logits, temps, keys = inputs(4, 2 * CHUNK + 5, seed=11)
    logits[0, ::2] = float("-inf")
    logits[1] = float("-inf")
    logits[2] = float("-inf")
    logits[2, CHUNK + 3] = 0.0
    logits[3, :CHUNK] = float("-inf")  # a whole chunk
    got = gumbel_argmax(logits, temps, keys)
    assert got[0] % 2 == 1 and got[1] == 0 and got[2] == CHUNK + 3 and got[3] >= CHUNK
    assert_same_draws(got, logits, temps, keys)


def test_strided_rows():
    logits, temps, keys = inputs(6, 500, seed=13)
    wide = torch.zeros(6, 800, device=DEVICE)
    wide[:, 100:600] = logits
    view = wide[:, 100:600]
    assert torch.equal(gumbel_argmax(view, temps, keys), gumbel_argmax(logits, temps, keys))


@pytest.mark.parametrize("filtered", [False, True])
def test_sampler_draws_equal_with_and_without_the_kernel(filtered):
    """`sample` with the Triton reductions draws what the torch path draws (greedy rows their
    argmax, sampled rows their Gumbel-max, filters applied first), up to near-ties."""
    rows, vocab = 12, 700
    logits, temps, _ = inputs(rows, vocab, seed=17)
    temps[::4] = 0.0
    g = torch.Generator().manual_seed(3)
    st = SamplingTensors(
        temperatures=temps,
        top_ks=torch.full((rows,), 50 if filtered else -1, dtype=torch.int64, device=DEVICE),
        top_ps=torch.full((rows,), 0.9 if filtered else 1.0, device=DEVICE),
        min_ps=torch.zeros(rows, device=DEVICE),
        seeds=torch.randint(0, 2**31, (rows,), generator=g).to(DEVICE),
        all_greedy=False,
        needs_filter=filtered,
    )
    positions = torch.arange(rows, device=DEVICE) + 100
    fast = sample(logits, st, positions, Kernels(sampling_reductions=True))
    plain = sample(logits, st, positions, REFERENCE)
    assert torch.equal(fast[::4], logits[::4].argmax(-1))
    assert (fast == plain).float().mean() >= 0.9
    if filtered:  # every draw inside its row's top 50
        top = logits.topk(50, dim=-1).indices
        assert (top == fast[:, None]).any(dim=-1).all()


@pytest.mark.parametrize("filtered", [False, True])
def test_draws_taken_a_block_of_rows_at_a_time_are_the_whole_batchs(filtered, monkeypatch):
    """The torch path draws a block of rows at a time (its temporaries are several [R, V]
    tensors): the draws do not depend on the block size."""
    import specserve.ops.sampling as sampling

    rows, vocab = 10, 300
    logits, temps, _ = inputs(rows, vocab, seed=23)
    temps[3] = 0.0
    st = SamplingTensors(
        temperatures=temps,
        top_ks=torch.full((rows,), 40 if filtered else -1, dtype=torch.int64, device=DEVICE),
        top_ps=torch.full((rows,), 0.8 if filtered else 1.0, device=DEVICE),
        min_ps=torch.zeros(rows, device=DEVICE),
        seeds=torch.arange(rows, device=DEVICE) * 7 + 1,
        all_greedy=False,
        needs_filter=filtered,
    )
    positions = torch.arange(rows, device=DEVICE)
    whole = sample(logits, st, positions)
    monkeypatch.setattr(sampling, "SAMPLE_BLOCK_ELEMENTS", 3 * vocab)  # blocks of 3 rows
    assert torch.equal(sample(logits, st, positions), whole)
    if filtered:
        assert torch.equal(sample(logits, st, positions, Kernels(sampling_reductions=True)), whole)
