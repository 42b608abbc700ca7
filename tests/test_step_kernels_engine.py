"""The speculative step with its Triton bookkeeping kernels wired in (attention metadata,
tree selection + ancestor mask, acceptance), end to end. The engine takes them on CUDA only:
on a CPU they are patched in and run in Triton's interpreter, so the wiring (the mask that
drafting hands to verification, the metadata the attention reads) is checked in CI too."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="the step kernels need the triton package")

from specserve import Engine  # noqa: E402
from specserve.ops import attention_metadata as forward_batch
from specserve.runtime import worker  # noqa: E402
from specserve.speculative import drafter  # noqa: E402
from specserve.speculative.tree import Acceptance  # noqa: E402
from tests.engine_utils import TINY, mixed_prompts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SP = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """On a CPU, route the three dispatch points to the kernels and count the calls."""
    calls: Counter = Counter()
    if DEVICE == "cuda":  # the engine's own dispatch takes them
        return calls
    from specserve.ops.triton_accept import accept_triton
    from specserve.ops.triton_metadata import device_metadata_tensors
    from specserve.ops.triton_tree_select import select_tree_triton

    def metadata(*args):
        calls["metadata"] += 1
        return device_metadata_tensors(*args)

    def select(*args):
        calls["select"] += 1
        return select_tree_triton(*args)

    real_accept = worker.accept

    def accept(trees, target_tokens, anc=None):
        if anc is None:
            return real_accept(trees, target_tokens, anc)
        calls["accept"] += 1
        assert anc is trees.anc  # verification used the mask drafting built
        return Acceptance(*accept_triton(trees.tokens, trees.parents, trees.depths,
                                         target_tokens, anc, trees.max_depth))  # fmt: skip

    monkeypatch.setattr(forward_batch, "_device_metadata_tensors_reference", metadata)
    monkeypatch.setattr(drafter, "select_tree", select)
    monkeypatch.setattr(worker, "accept", accept)
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
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="tiny",  # the target as its own draft: long paths
        speculative_num_steps=3,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
        debug_check_invariants=True,
    )
    assert spec == plain
    assert accept_len > 3.0  # the paths really were accepted through the kernels
    if DEVICE == "cpu":
        assert min(kernel_calls[k] for k in ("metadata", "select", "accept")) > 0, kernel_calls
