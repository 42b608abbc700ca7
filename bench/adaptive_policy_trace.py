"""What load-adaptive speculation chose, step by step: `specserve bench one-batch` run in this
process with the policy's picks logged, then summarized. Each pick records the batch size, the
tier, whether it explored, every tier's score, device-time estimate and acceptance estimate,
the host's time per step and per token it weighed, and the wall clock; every CUDA-graph capture is logged
with its shape and duration. The summary gives, per batch bucket, the picks per tier (best or
exploring), the captures, and each tier's mean wall time per step (from one launch to the
next while the host applied it) beside its device time and the host's measured time, per
step and per emitted token.

    python3 bench/adaptive_policy_trace.py OUT.json [one-batch flags...]     # CUDA machine
    e.g. OUT.json --model-path smollm2-135m --chat --output-len 128 --batch-size 16 128 \\
         --repeats 5 --speculative-adaptive

The bench's own JSON goes where --output-json says (its table is printed as usual).
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.runtime.cuda_graphs import DecodeGraphs  # noqa: E402
from specserve.speculative.adaptive import AdaptiveSpeculation, batch_bucket  # noqa: E402


def record_picks(log: list[dict]) -> None:
    """Wrap the policy's pick / observe and the graphs' capture to append to `log`."""
    pick, observe, capture = (
        AdaptiveSpeculation.pick,
        AdaptiveSpeculation.observe,
        DecodeGraphs._capture,
    )
    observe_host = AdaptiveSpeculation.observe_host

    def logged_pick(self, batch_size, can_speculate=True, ready=None):
        before = self._explored
        tier = pick(self, batch_size, can_speculate, ready)
        bucket = batch_bucket(batch_size)
        rec = {
            "wall_ms": time.perf_counter() * 1e3,
            "batch": batch_size,
            "tier": tier,
            "explored": self._explored is not None and self._explored == tier != before,
            "host_us_per_step_and_token": [v * 1e6 for v in self.host_cost.get(bucket, (0.0, 0.0))],
            "ready": None if ready is None else sorted(ready),
        }
        if can_speculate and self._fill(bucket) is None:
            rec["scores"] = self._scores(batch_size)
            rec["device_ms"] = [
                (self.seconds(t, bucket) or 0.0) * 1e3 for t in range(len(self.tiers))
            ]
            rec["accept"] = list(self.accept)
        log.append(rec)
        return tier

    def logged_observe(self, tier, batch_size, accept_lens, seconds, chain_reach=None):
        if log:  # (the step applied after this pick's launch)
            mean = sum(accept_lens) / max(1, len(accept_lens))
            log[-1].setdefault("observed", []).append(
                [tier, mean, None if seconds is None else seconds * 1e3]
            )
        return observe(self, tier, batch_size, accept_lens, seconds, chain_reach)

    def logged_capture(self, *key, **kwargs):
        start = time.perf_counter()
        out = capture(self, *key, **kwargs)
        if log:
            ms = (time.perf_counter() - start) * 1e3
            log[-1].setdefault("captures", []).append([list(key), kwargs.get("idle", False), ms])
        return out

    def logged_observe_host(self, tier, batch_size, seconds, tokens):
        if log:  # (the host's time around the step applied before this pick's launch)
            log[-1]["host_sample_ms"] = seconds * 1e3
            log[-1]["host_sample_tokens"] = tokens
        return observe_host(self, tier, batch_size, seconds, tokens)

    AdaptiveSpeculation.observe_host = logged_observe_host
    AdaptiveSpeculation.pick = logged_pick
    AdaptiveSpeculation.observe = logged_observe
    DecodeGraphs._capture = logged_capture


def summarize(log: list[dict]) -> None:
    by_bucket = collections.defaultdict(list)
    for rec in log:
        by_bucket[batch_bucket(rec["batch"])].append(rec)
    for bucket, recs in sorted(by_bucket.items()):
        kinds = collections.Counter(
            (r["tier"], "explored" if r["explored"] else "best") for r in recs
        )
        print(f"bucket {bucket}: {len(recs)} picks, by (tier, why): {sorted(kinds.items())}")
    print("captures a step waited for (pick, batch, tier, graph key, ms):")
    idle = []
    for i, rec in enumerate(log):
        for key, was_idle, ms in rec.get("captures", []):
            if was_idle:
                idle.append(ms)
            else:
                print(f"  {i} {rec['batch']} {rec['tier']} {key} {ms:.0f}")
    print(f"captures while idle: {len(idle)}, {sum(idle) / 1e3:.1f} s")
    # step k's wall time: from launch k+1 to launch k+2, while the host waited for and applied
    # step k (steps of one run only: the batch never grows within a run)
    steps = collections.defaultdict(list)
    for k in range(len(log) - 2):
        a, b, c = log[k], log[k + 1], log[k + 2]
        if not a["batch"] >= b["batch"] >= c["batch"] or c["wall_ms"] - b["wall_ms"] > 50:
            continue
        device = next((o[2] for o in b.get("observed", []) if o[0] == a["tier"]), None)
        steps[(batch_bucket(a["batch"]), a["tier"])].append(
            (
                c["wall_ms"] - b["wall_ms"],
                device,
                c.get("host_sample_ms"),  # (the host's own time while applying step k)
                c.get("host_sample_tokens"),  # (what step k emitted)
            )
        )
    print("bucket | tier | steps | wall ms | device ms (timed steps) | host ms | host us/token")

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    for (bucket, tier), rows in sorted(steps.items()):
        wall, device, host, tokens = (mean(col) for col in zip(*rows))
        cells = [wall, device, host, host * 1e3 / tokens if host and tokens else None]
        shown = " | ".join("-" if v is None else f"{v:.2f}" for v in cells)
        print(f"{bucket} | {tier} | {len(rows)} | {shown}")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    log: list[dict] = []
    record_picks(log)
    from specserve.cli import main as cli_main

    rc = cli_main(["bench", "one-batch", *sys.argv[2:]])
    out.write_text(json.dumps(log))
    summarize(log)
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
