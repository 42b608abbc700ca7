"""bench/adaptive_policy_trace.py on a CPU, in its own process (it wraps the engine's classes
for the rest of the process): every decode step of every engine logged, in turns, with the
engine it belongs to and its device time; the adaptive engine's picks logged beside them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_in_turns_every_engines_steps_are_logged_and_told_apart(tmp_path):
    out = tmp_path / "trace.json"
    adaptive = (
        "--speculative-algorithm STANDALONE --speculative-draft-model-path tiny "
        "--speculative-num-steps 3 --speculative-eagle-topk 2 --speculative-num-draft-tokens 6 "
        "--speculative-adaptive"
    )
    cmd = [
        sys.executable, str(ROOT / "bench" / "adaptive_policy_trace.py"), str(out), "--time-calls", "--in-turns",
        "--batch-size", "3", "--input-len", "6", "--output-len", "9", "--repeats", "2",
        "--config", "plain=", "--config", f"adaptive={adaptive}",
        "--", "--model-path", "tiny", "--load-format", "dummy", "--device", "cpu",
        "--dtype", "float32", "--skip-tokenizer-init",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    trace = json.loads(out.read_text())
    steps = trace["steps"]
    engines = {s["engine"] for s in steps}
    assert engines == {0, 1}
    plain = [s for s in steps if s["engine"] == 0]
    assert plain and all(s["tier"] == 0 for s in plain)  # (the plain engine never speculates)
    assert trace["picks"] and all(p["batch"] <= 3 for p in trace["picks"])
    # the runs were taken in turns: the engines' steps interleave, run by run
    switches = sum(a["engine"] != b["engine"] for a, b in zip(steps, steps[1:]))
    assert switches >= 3
    assert "run | engine |" in done.stdout
    # --time-calls: every engine's steps timed on the device, the plain one's too, and the
    # host functions' time summed per step
    assert all(s["device_ms"] > 0 for s in steps)
    # (a step's record sums what ran from its launch to the next: the step applied then is
    # an earlier one, so a run's first step applies none)
    applied = [s for s in steps if s["calls"].get("EngineCore._finish_decode", 0) > 0]
    assert len(applied) >= len(steps) // 2
