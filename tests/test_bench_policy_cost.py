"""bench/adaptive_policy_cost.py on a CPU: the policy's own time per step, scoring every step
against its default, on a synthetic stream where the chain of 3 is the best tier."""

from __future__ import annotations

import json

from bench.adaptive_policy_cost import main


def test_the_policy_cost_bench_times_both_modes_on_the_same_stream(tmp_path, capsys):
    out = tmp_path / "cost.json"
    main(["--batch-size", "128", "--steps", "300", "--json", str(out)])
    result = json.loads(out.read_text())
    every, default = result["rows"]
    assert every["decide_every"] == 1 and default["decide_every"] > 1
    for row in (every, default):
        served = max(row["steps_per_tier"], key=row["steps_per_tier"].get)
        assert served == "3/1/4", row["steps_per_tier"]  # (both choose alike)
        assert row["us_per_step"]["total"] > 0
    assert result["default_over_every_step"] == round(
        default["us_per_step"]["total"] / every["us_per_step"]["total"], 3
    )
    assert "| every step |" in capsys.readouterr().out
