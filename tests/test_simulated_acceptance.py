"""Simulated acceptance: the requested mean, consistent tokens and KV, clear refusals."""

from __future__ import annotations

import pytest

from specserve import Engine, InvalidArgument
from tests.engine_utils import (
    TINY,
    assert_kv_matches_plain_prefill,
    mixed_prompts,
    reference_logits,
)


def sim_engine(topk: int, ndt: int, page_size: int = 1, steps: int = 3, **sim):
    return Engine(
        **TINY,
        page_size=page_size,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="tiny",
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
        random_seed=3,
        **sim,
    )


@pytest.mark.parametrize("topk, ndt", [(1, 4), (8, 16)])
def test_match_expected_mean_over_2000_verifies(topk, ndt):
    # The model is its own draft, so without simulation every verify would accept 4.
    with sim_engine(topk, ndt, simulate_acc_len=2.3, simulate_acc_method="match-expected") as e:
        prompts = mixed_prompts(40, 512, seed=5, min_len=2, max_len=8)
        outs = e.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 116, "ignore_eos": True},
        )
        stats = e.stats()
    # Ignore each request's last verify, which max_new_tokens may cut short.
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    assert verifies >= 2000
    hist = [sum(x) for x in zip(*[o["meta_info"]["spec_accept_histogram"] + [0] * 4 for o in outs])]
    assert set(i + 1 for i, c in enumerate(hist) if c) <= {1, 2, 3, 4}
    assert abs(stats["spec_accept_length"] - 2.3) < 0.05, stats["spec_accept_length"]


@pytest.mark.parametrize("topk, ndt, page_size", [(1, 4, 1), (1, 4, 4), (4, 10, 1), (4, 10, 4)])
def test_real_draft_tokens_keep_kv_and_tokens_consistent(topk, ndt, page_size):
    """After a simulated run the cache equals a plain prefill of prompt + output, and the next
    greedy token is what plain decoding of that text gives."""
    checked = []
    prompts = mixed_prompts(3, 512, seed=9, min_len=3, max_len=12)

    def check(core):
        checked.append(assert_kv_matches_plain_prefill(core))
        for r in core.scheduler.running:  # the newest token is always the target's own choice
            assert r.all_ids[-1] == int(
                reference_logits(core.runner.model, r.all_ids[:-1])[-1].argmax()
            )

    with sim_engine(
        topk, ndt, page_size, simulate_acc_len=2.5, simulate_acc_method="multinomial"
    ) as e:
        e.step_hooks.append(check)
        outs = e.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
        )
        model = e.core.runner.model
    assert sum(checked) > 10
    with Engine(**TINY, random_seed=3) as plain:
        for p, o in zip(prompts, outs):
            text = p + o["output_ids"]
            nxt = plain.generate(
                input_ids=text, sampling_params={"temperature": 0, "max_new_tokens": 1}
            )["output_ids"][0]
            assert nxt == int(reference_logits(model, text)[-1].argmax())


def test_per_position_rates_zero_rejects_everything():
    with sim_engine(
        4, 10, simulate_acc_len=3, simulate_acc_method="per-position", simulate_acc_rates="0,0,0"
    ) as e:
        o = e.generate(
            input_ids=[5, 6, 7],
            sampling_params={"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
        )
    assert o["meta_info"]["spec_accept_histogram"] == [9]


def test_fixed_mode_emits_only_the_configured_token_and_streams():
    with sim_engine(
        1,
        4,
        simulate_acc_len=3,
        simulate_acc_method="match-expected",
        simulate_acc_token_mode="fixed",
        simulate_acc_fixed_token=42,
    ) as e:
        chunks = list(
            e.generate(
                input_ids=[5, 6, 7],
                sampling_params={"temperature": 0, "max_new_tokens": 13, "ignore_eos": True},
                stream=True,
            )
        )
    ids = [t for c in chunks for t in c["output_ids"]]
    assert len(ids) == 13 and chunks[-1]["finished"]
    assert set(ids[1:]) == {42}  # the first token comes from prefill, before any verify


def test_environment_variables_configure_simulation(monkeypatch):
    monkeypatch.setenv("SPECSERVE_SIMULATE_ACC_LEN", "2")
    monkeypatch.setenv("SPECSERVE_SIMULATE_ACC_METHOD", "match-expected")
    with sim_engine(1, 4) as e:
        args = e.resolved_args()
        o = e.generate(
            input_ids=[5, 6],
            sampling_params={"temperature": 0, "max_new_tokens": 21, "ignore_eos": True},
        )
    assert args["simulate_acc_len"] == 2.0 and args["simulate_acc_method"] == "match-expected"
    assert o["meta_info"]["spec_accept_histogram"] == [0, 10]


@pytest.mark.parametrize(
    "sim, field",
    [
        (dict(simulate_acc_len=2, simulate_acc_method="gaussian"), "simulate_acc_method"),
        (dict(simulate_acc_len=2, simulate_acc_token_mode="token-100"), "simulate_acc_token_mode"),
        (dict(simulate_acc_len=0.5), "simulate_acc_len"),
        (dict(simulate_acc_len=float("inf")), "simulate_acc_len"),
        (dict(simulate_acc_len=float("nan")), "simulate_acc_len"),
        (
            dict(
                simulate_acc_len=2,
                simulate_acc_method="per-position",
                simulate_acc_rates="0.5,1.5,0.2",
            ),
            "simulate_acc_rates",
        ),
        (
            dict(simulate_acc_len=2, simulate_acc_method="per-position", simulate_acc_rates="0.5"),
            "simulate_acc_rates",
        ),
        (
            dict(
                simulate_acc_len=2, simulate_acc_token_mode="fixed", simulate_acc_fixed_token=10**9
            ),
            "simulate_acc_fixed_token",
        ),
        (dict(simulate_acc_method="match-expected"), "simulate_acc_method"),
    ],
)
def test_invalid_simulation_settings_are_refused(sim, field):
    with pytest.raises(InvalidArgument) as info:
        sim_engine(1, 4, **sim)
    assert info.value.field == field


def test_length_above_steps_plus_one_is_clipped_with_a_reason(caplog):
    with sim_engine(1, 4, simulate_acc_len=10**400) as e:  # (an int past any float too)
        assert e.resolved_args()["simulate_acc_len"] == 4.0
    with sim_engine(1, 4, simulate_acc_len=9, simulate_acc_method="match-expected") as e:
        args = e.resolved_args()
    assert any("clipped" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert args["simulate_acc_len"] == 4.0
    assert any(
        d["field"] == "simulate_acc_len" and "clipped" in d["reason"] for d in args["decisions"]
    )
