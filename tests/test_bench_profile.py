"""`specserve bench profile-step`: step counting and the interval arithmetic behind its numbers
(the command needs CUDA and refuses a CPU: tests/test_bench_arguments.py)."""

from __future__ import annotations

from specserve.bench.profile_step import _busy_time, kernel_class
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint


def test_busy_time_is_the_union_of_kernel_intervals():
    assert _busy_time([]) == 0.0
    assert _busy_time([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # overlap counted once
    assert _busy_time([(5.0, 6.0), (0.0, 1.0), (0.5, 0.7)]) == 2.0  # nested, unsorted


def test_kernel_classes():
    assert kernel_class("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT") == "matmul"  # cuBLAS
    assert kernel_class("_skinny_fma_kernel") == "matmul"
    assert kernel_class("ampere_bf16_s16816gemm_bf16_128x64") == "matmul"
    assert kernel_class("_extend_kernel") == "attention"
    assert kernel_class("merge_splits_kernel") == "attention"
    assert kernel_class("_add_rmsnorm_kernel") == "norm"
    assert kernel_class("_rope_write_kernel") == "rope/kv"


def test_profile_step_counts_speculative_steps(tmp_path):
    """(The command itself needs CUDA; its step counting runs on any engine.)"""
    from specserve import Engine
    from specserve.bench.profile_step import profile_decode

    draft = write_random_eagle_checkpoint(str(tmp_path / "draft"), PRESETS["tiny"], "EAGLE")
    engine_args = dict(
        model_path="tiny", load_format="dummy", device="cpu",
        speculative_algorithm="EAGLE", speculative_draft_model_path=draft,
        speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=4,
        simulate_acc_len=3, simulate_acc_method="match-expected",
    )  # fmt: skip
    with Engine(**engine_args) as engine:
        result = profile_decode(engine, 1, 8, 13, 15)
    s = result["summary"]
    # 12 tokens after the prefill's first, 3 per step (accept length forced to 3)
    assert s["decode_steps"] == 4 and abs(s["accept_length"] - 3.0) < 1e-6  # tokens per verify
    assert s["wall_us_per_step"] > 0 and s["decode_tok_s"] > 0
    assert s["kernels_per_step"] == 0 and s["idle_fraction"] is None  # no CUDA kernels here
