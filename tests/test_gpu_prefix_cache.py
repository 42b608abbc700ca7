"""The prefix cache on CUDA, with decode and prefill graphs and the fused kernels: outputs
and accepted drafts equal those of an engine without a cache (an EAGLE draft's boundary
page is copied on the device, then its last token re-run in a replayed prefill graph), and
under load-adaptive speculation a plainly decoded answer's target-only pages serve the next
plain turn."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
from tests.engine_utils import GPU_TINY, check_plain_next_turn_reuse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 500, (45,), generator=g).tolist()
    return [system + torch.randint(3, 500, (2 + i,), generator=g).tolist() for i in range(8)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_on_cuda_keeps_outputs_and_drafts(tmp_path, dtype, page_size):
    eagle = write_random_eagle_checkpoint(str(tmp_path / "e"), PRESETS["tiny"], "EAGLE")
    spec = dict(
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=eagle,
        speculative_num_steps=3,
        speculative_eagle_topk=4,
        speculative_num_draft_tokens=8,
    )
    args = dict(model_path="tiny", load_format="dummy", skip_tokenizer_init=True, device="cuda",
                dtype=dtype, max_total_tokens=8192, page_size=page_size, **spec)  # fmt: skip
    runs = []
    for cache_off in (False, True):
        with Engine(**args, disable_radix_cache=cache_off) as e:
            outs = []
            for _ in range(2):  # the second wave finds the first one's pages
                for p in prompts(page_size):
                    o = e.generate(input_ids=p, sampling_params=GREEDY)  # one at a time: graphs
                    outs.append((o["output_ids"], o["meta_info"]["spec_accept_histogram"]))
            runs.append((outs, e.stats()["prefix_cache_hit_tokens"]))
            e.flush_cache()
            e.core.check_invariants()
    (on, hits), (off, no_hits) = runs
    assert hits > 0 and no_hits == 0
    if dtype == "float32":
        assert on == off
    else:  # bf16: a prefix's KV from another batch shape may round differently; most agree
        same = sum(a[0] == b[0] for a, b in zip(on, off))
        assert same >= len(on) * 3 // 4, same


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_plain_next_turn_reuses_target_only_pages_on_cuda(tmp_path, page_size):
    """`check_plain_next_turn_reuse` on CUDA (float32, graphs replayed)."""
    eagle = write_random_eagle_checkpoint(str(tmp_path / "e"), PRESETS["tiny"], "EAGLE", seed=3)
    check_plain_next_turn_reuse(GPU_TINY, eagle, page_size, GREEDY)
