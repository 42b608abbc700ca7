"""The host time load-adaptive speculation's policy itself takes per decode step (`pick`,
`observe`, `observe_host`), scoring every tier at every step against its default (a choice
holds for `DECIDE_EVERY` steps), on a synthetic stream shaped like SmolLM2 with its bundled
draft at one batch size: the served 6/8/64 tree's tiers, their step times at batch 128 on an
H100, each request's accept length drawn around its tier's mean. Runs on any CPU (no model,
no device): where the host sets a step's pace, this is part of every step.

    python3 bench/adaptive_policy_cost.py [--batch-size 128] [--steps 4000] [--json out.json]

JSON, then a table: microseconds per step of each function and in all, and the default's
total over scoring every step.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.speculative.adaptive import AdaptiveSpeculation, speculation_tiers  # noqa: E402
from specserve.speculative.decision_hold import DECIDE_EVERY  # noqa: E402
from specserve.speculative.tree import TreeShape  # noqa: E402

# Device ms of a step of each tier at batch 128 (SmolLM2, H100, the policy trace's medians),
# and each tier's mean accept length on chat prompts; other batch sizes scale the step time.
STEP_MS = {"plain": 1.46, "1/1/2": 1.53, "2/1/3": 1.72, "3/1/4": 1.84, "4/4/16": 3.10}
ACCEPT = {"plain": 1.0, "1/1/2": 1.6, "2/1/3": 1.95, "3/1/4": 2.2, "4/4/16": 3.1}
WIDE_MS, WIDE_ACCEPT = 5.0, 3.9  # the 6/8/64 tree and its ragged budgets


def stream(decide_every: int, batch_size: int, steps: int, seed: int = 0) -> dict:
    tiers = speculation_tiers(TreeShape(6, 8, 64))
    names = [str(t) for t in tiers]
    scale = 0.5 + 0.5 * batch_size / 128

    def step_ms(t: int) -> float:
        return STEP_MS.get(names[t], WIDE_MS) * scale

    policy = AdaptiveSpeculation(
        tiers, measure=lambda b, t: step_ms(t) / 1e3, decide_every=decide_every
    )
    policy.prime(batch_size)
    rng = random.Random(seed)
    spent = {"pick": 0.0, "observe": 0.0, "observe_host": 0.0}
    clock = time.perf_counter
    for _ in range(steps):
        start = clock()
        tier = policy.pick(batch_size)
        spent["pick"] += clock() - start
        mean = ACCEPT.get(names[tier], WIDE_ACCEPT)
        depth = tiers[tier].max_depth
        accept = [min(depth + 1, max(1, round(rng.gauss(mean, 0.8)))) for _ in range(batch_size)]
        reach = [min(a - 1, 3) for a in accept] if tiers[tier].topk > 1 else None
        tokens = sum(accept)
        start = clock()
        policy.observe_host(tier, batch_size, 1.8e-3 + 1e-6 * tokens, tokens)
        spent["observe_host"] += clock() - start
        start = clock()
        policy.observe(tier, batch_size, accept if tier else [], step_ms(tier) / 1e3, reach)
        spent["observe"] += clock() - start
    us = {name: round(seconds / steps * 1e6, 2) for name, seconds in spent.items()}
    us["total"] = round(sum(us.values()), 2)
    return {
        "decide_every": decide_every,
        "us_per_step": us,
        "steps_per_tier": dict(zip(names, policy.counts)),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--json", help="also write the JSON here")
    args = p.parse_args(argv)
    rows = [stream(every, args.batch_size, args.steps) for every in (1, DECIDE_EVERY)]
    out = {
        "batch_size": args.batch_size,
        "steps": args.steps,
        "rows": rows,
        "default_over_every_step": round(
            rows[1]["us_per_step"]["total"] / rows[0]["us_per_step"]["total"], 3
        ),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print("| scoring | pick us | observe us | observe_host us | total us / step |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        us = row["us_per_step"]
        label = "every step" if row["decide_every"] == 1 else f"every {row['decide_every']} steps"
        print(
            f"| {label} | {us['pick']} | {us['observe']} | {us['observe_host']} | {us['total']} |"
        )
    print(f"default / every step: {out['default_over_every_step']}")


if __name__ == "__main__":
    main()
