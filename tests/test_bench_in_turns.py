"""bench/one_batch_in_turns.py on a CPU: engines of several configurations built in one
process, their timed runs taken in turns, the table's medians and ratios from those runs."""

from __future__ import annotations

import json
import os
import sys

import pytest

from bench.one_batch_in_turns import main
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint


def test_configurations_run_in_turns_and_ratios_come_from_their_medians(tmp_path, capsys):
    draft = write_random_eagle_checkpoint(str(tmp_path / "draft"), PRESETS["tiny"], "EAGLE")
    out = tmp_path / "in_turns.json"
    chain = (
        f"--speculative-algorithm EAGLE --speculative-draft-model-path {draft} "
        "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "
        "--simulate-acc-len 3 --simulate-acc-method match-expected"
    )
    rc = main(
        [
            "--batch-size", "1", "3", "--input-len", "6", "--output-len", "9", "--repeats", "3",
            "--config", "plain=", "--config", f"chain={chain}", "--output-json", str(out),
            "--", "--model-path", "tiny", "--load-format", "dummy", "--device", "cpu",
            "--dtype", "float32", "--skip-tokenizer-init",
        ]
    )  # fmt: skip
    assert rc == 0
    table = json.loads(out.read_text())
    assert [row["batch_size"] for row in table] == [1, 3]
    for row in table:
        assert set(row["runs"]) == {"plain", "chain"}
        for name, runs in row["runs"].items():
            assert len(runs) == 3
            speeds = sorted(r["decode_tok_s"] for r in runs)
            assert row["median_tok_s"][name] == speeds[1]
            assert all(r["host_probe_ms"] > 0 for r in runs)
            assert all(len(r["gc_collections"]) == 3 and r["gc_pause_ms"] >= 0 for r in runs)
        assert {r["accept_length"] for r in row["runs"]["plain"]} == {1.0}
        # acceptance forced to 3 a step (a request's last step may be cut by max_new_tokens)
        assert all(r["accept_length"] > 2.0 for r in row["runs"]["chain"])
        ratio = row["median_tok_s"]["chain"] / row["median_tok_s"]["plain"]
        assert row["over_first"] == {"plain": 1.0, "chain": round(ratio, 3)}
    printed = capsys.readouterr().out
    assert "| batch | plain tok/s (accept) | chain tok/s (accept) | ratios to first |" in printed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity is Linux's")
def test_cpus_pins_every_engines_loop_and_the_process_gets_its_cpus_back(tmp_path, capsys):
    before = os.sched_getaffinity(0)
    cpu = max(before)
    out = tmp_path / "in_turns.json"
    rc = main(
        [
            "--batch-size", "2", "--input-len", "6", "--output-len", "24", "--repeats", "2",
            "--config", "a=", "--config", "b=", "--cpus", str(cpu), "--probe-cpus",
            "--output-json", str(out),
            "--", "--model-path", "tiny", "--load-format", "dummy", "--device", "cpu",
            "--dtype", "float32", "--skip-tokenizer-init",
        ]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    probes = json.loads(printed.splitlines()[0])["probe_ms_by_cpu"]
    assert {int(c) for c in probes} == before and all(ms > 0 for ms in probes.values())
    table = json.loads(out.read_text())
    seen = [c for runs in table[0]["runs"].values() for r in runs for c in r["loop_cpus"]]
    assert seen and set(seen) == {cpu}  # (every sample of both engines' loops)
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity is Linux's")
@pytest.mark.parametrize("choice", ["fastest", "last"])
def test_loop_cpu_pins_each_rounds_loops_to_one_cpu_and_leaves_the_process_free(tmp_path, choice):
    before = os.sched_getaffinity(0)
    flag = "fastest" if choice == "fastest" else str(max(before))
    out = tmp_path / "in_turns.json"
    rc = main(
        [
            "--batch-size", "2", "--input-len", "6", "--output-len", "24", "--repeats", "2",
            "--config", "a=", "--config", "b=", "--loop-cpu", flag, "--output-json", str(out),
            "--", "--model-path", "tiny", "--load-format", "dummy", "--device", "cpu",
            "--dtype", "float32", "--skip-tokenizer-init",
        ]
    )  # fmt: skip
    assert rc == 0
    runs = json.loads(out.read_text())[0]["runs"]
    for round_ in zip(runs["a"], runs["b"]):
        pinned = {r["loop_pinned_to"] for r in round_}
        assert len(pinned) == 1 and pinned <= before  # both configurations on one CPU
        if choice == "last":
            assert pinned == {max(before)}
        for r in round_:
            assert set(r["loop_cpus"]) == pinned
    assert os.sched_getaffinity(0) == before  # (the loops alone were pinned)


def test_loop_cpu_rejects_what_is_not_a_cpu_or_fastest(capsys):
    with pytest.raises(SystemExit):
        main(["--config", "a=", "--loop-cpu", "quick", "--", "--model-path", "tiny"])
    assert "--loop-cpu 'quick': expected a CPU number or 'fastest'" in capsys.readouterr().err
