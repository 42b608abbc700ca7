"""The speculative step with its Triton bookkeeping kernels chosen (attention metadata, tree
selection + ancestor mask, acceptance, KV commit, sampling reductions), end to end. An engine
resolves them on for CUDA; here they are passed in, and on a CPU run in Triton's interpreter,
so the wiring (the mask drafting hands to verification, the metadata attention reads) is
checked in CI too."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the step kernels need the triton package")

from specserve import Engine  # noqa: E402
from specserve.config import Kernels  # noqa: E402
from tests.engine_utils import TINY, mixed_prompts, spec_args  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SP = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
STEP_KERNELS = Kernels(
    decode_metadata=True, sampling_reductions=True, draft_tree=True, tree_accept=True,
    kv_commit=True,
)  # fmt: skip


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """Counts the calls of the kernels (observed, not replaced)."""
    from specserve.ops import triton_accept, triton_metadata, triton_tree_select

    calls: Counter = Counter()
    for module, name in (
        (triton_metadata, "device_metadata_tensors"),
        (triton_tree_select, "select_tree_triton"),
        (triton_accept, "accept_triton"),
    ):
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def outputs(prompts, **kw) -> tuple[list[list[int]], float]:
    args = dict(TINY, device=DEVICE, max_total_tokens=4096, **kw)
    with Engine(**args) as e:
        out = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=SP)]
        return out, e.stats().get("spec_accept_length", 1.0)


@pytest.mark.parametrize("page_size,topk,ndt", [(1, 4, 10), (3, 2, 5)])
def test_trees_with_the_kernels_decode_as_plain_decoding(kernel_calls, page_size, topk, ndt):
    prompts = mixed_prompts(3, 512, seed=page_size, max_len=20)
    plain, _ = outputs(prompts, page_size=page_size)
    spec, accept_len = outputs(
        prompts,
        page_size=page_size,
        **spec_args("tiny", topk, 3, ndt),  # the target as its own draft: long paths
        debug_check_invariants=True,
        kernels=STEP_KERNELS,
    )
    assert spec == plain
    assert accept_len > 3.0  # the paths really were accepted through the kernels
    assert len(kernel_calls) == 3 and min(kernel_calls.values()) > 0, kernel_calls


@pytest.mark.parametrize("topk,ndt", [(4, 16), (1, 5)])  # a chain: no ragged tiers
def test_adaptive_speculation_learns_chains_through_the_acceptance_kernel(monkeypatch, topk, ndt):
    """Load-adaptive speculation with the kernels: the step's acceptance statistics (ragged
    calibration and the greedy chain's reach) come from one kernel, outputs stay plain
    decoding's, and with the target as its own draft (greedy chain always accepted) every
    chain is learnt to accept all it drafts, whichever tiers ran."""
    from specserve.ops import triton_accept_stats

    calls = []
    real = triton_accept_stats.acceptance_stats_triton

    def counted(*args, **kwargs):
        calls.append(kwargs.get("rows", args[7]) is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_accept_stats, "acceptance_stats_triton", counted)
    prompts = mixed_prompts(3, 512, seed=5, max_len=20)
    plain, _ = outputs(prompts)
    args = dict(TINY, device=DEVICE, max_total_tokens=4096, debug_check_invariants=True)
    kernels = Kernels(**{**STEP_KERNELS.as_dict(), "accept_stats": True})
    with Engine(
        **args,
        **spec_args("tiny", topk, 4, ndt),
        speculative_adaptive=True,
        kernels=kernels,
    ) as e:
        policy = e.core.adaptive
        tree = len(policy.tiers) - 1
        policy.pick = lambda b, can=True, ready=None: tree  # the whole tree every step
        spec = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=SP)]
    assert spec == plain
    ragged = any(t.ragged for t in policy.tiers)
    assert calls and all(c == ragged for c in calls)  # with the ragged tiers' calibration
    chains = [t for t, s in enumerate(policy.tiers) if s.topk == 1 and 1 < s.tokens and t != tree]
    assert chains and all(policy.counts[c] == 0 for c in chains)
    for c in chains:  # learnt from many requests' steps (the optimistic prior weighs 0.1)
        assert policy.acceptance.weight[c] > 5, policy.acceptance.weight
        assert policy.accept[c] == pytest.approx(policy.tiers[c].max_depth + 1, rel=0.01)
