"""The adaptive policy's tokens per millisecond against every fixed tier's, on a simulated
stream shaped like SmolLM2-135M with its bundled draft (the served 6/8/64 tree's tiers) on
an H100: each tier's device time per step at the batch size (the policy traces' medians), the
host's time per step, and per request per step an accept length drawn from a per-depth
acceptance that drifts between easy and hard stretches of text and from step to step, with
each tree step reporting what the chains within it would have accepted (as the engine does).
Batches of new requests arrive in turn (`arrived`). No model and no device: what the policy's
choices alone are worth, seed by seed, and how a policy setting changes them.

    python3 bench/adaptive_policy_simulation.py [--batch-size 16] [--seeds 10] \\
        [--first-look PICKS] [--static-batches OUTPUT_LEN [--request-spread SD]] \\
        [--json OUT.json]

--static-batches OUTPUT_LEN: each batch is what `bench one-batch` runs instead, every request
generating OUTPUT_LEN tokens at its own text's difficulty, so that the batch shrinks to a
tail of the requests whose drafts are accepted least (step times interpolated between the
batch sizes measured, flat below the smallest). --request-spread: the standard deviation of
a request's own text's ease (added to every depth's acceptance; default 0.08). The larger it
is, the less the tail accepts against the whole batch.

JSON, then a table: per seed the best fixed tier, its tokens/ms, the policy's, their ratio and
the steps the policy served per tier; then the mean and the worst ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.speculative.adaptive import AdaptiveSpeculation, speculation_tiers  # noqa: E402
from specserve.speculative.tree import TreeShape  # noqa: E402

TIERS = speculation_tiers(TreeShape(6, 8, 64))
# device ms per step of each tier (plain, chains of 1-3, 4/4/16, the 6/8/64 tree verifying 16
# and 32 nodes a request, the whole tree) and the host's ms per step, by batch size
STEP_MS = {
    16: [1.07, 1.18, 1.27, 1.31, 1.55, 2.2, 2.31, 2.18],
    64: [1.29, 1.40, 1.48, 1.55, 2.14, 3.31, 4.12, 4.97],
    128: [1.50, 1.50, 1.69, 1.83, 3.22, 5.08, 6.5, 7.5],
}
HOST_MS = {16: 0.8, 64: 1.1, 128: 1.7}
# per-depth acceptance along the draft's greedy chain, and for the two trees' best branches
P_CHAIN, P_SMALL_TREE, P_WIDE_TREE = 0.58, 0.73, 0.77
STEPS_PER_BATCH, BATCHES = 55, 10
REQUEST_SPREAD = 0.08  # a request's own text's ease: its standard deviation


def _accepted(p: float, depth: int, rng: random.Random) -> int:
    k = 0
    while k < depth and rng.random() < p:
        k += 1
    return k


def step_accepts(tier: int, batch: int, ease: float, rng: random.Random, own=None):
    """(accept length, accepted tokens on the greedy chain) of each request in one step;
    own: each request's own text's ease (else drawn afresh per step)."""
    shape = TIERS[tier]
    lens, reach = [], []
    for i in range(batch):
        e = ease + (own[i] if own is not None else rng.gauss(0, 0.08))  # (this request's text)
        on_chain = _accepted(min(0.95, P_CHAIN + e), shape.max_depth, rng)
        if tier == 0:
            lens.append(1)
            reach.append(0)
        elif shape.topk == 1:
            lens.append(1 + on_chain)
            reach.append(on_chain)
        else:
            p = P_SMALL_TREE if shape.tokens == 16 else P_WIDE_TREE
            lens.append(1 + max(on_chain, _accepted(min(0.97, p + e), shape.max_depth, rng)))
            reach.append(on_chain)
    return lens, reach


def _policy(measure, first_look: int | None) -> AdaptiveSpeculation:
    policy = AdaptiveSpeculation(TIERS, measure=measure)
    if first_look is not None:
        policy.first_look = first_look
    return policy


def _serve(policy, fixed, tier, batch, lens, reach, step_ms, host_ms, rng) -> float:
    """One step's simulated ms (the longer of its device and host time), observed by the
    policy when it chose the step (`fixed` None)."""
    device = step_ms * (1 + rng.gauss(0, 0.02))
    if fixed is None:
        host = host_ms * (1 + rng.gauss(0, 0.05))
        policy.observe_host(tier, batch, host / 1e3, sum(lens))
        chains = None if TIERS[tier].ragged else reach
        policy.observe(tier, batch, lens, device / 1e3, chains)
    return max(device, host_ms)


def run(batch: int, seed: int, fixed: int | None = None, first_look: int | None = None):
    """Tokens per ms of a fixed tier, or (fixed None) of the policy, and steps per tier."""
    rng = random.Random(seed)
    ms = STEP_MS[batch]
    policy = _policy(lambda b, t: ms[t] / 1e3, first_look)
    tokens = spent = 0.0
    counts = [0] * len(TIERS)
    for b in range(BATCHES):
        policy.arrived(batch)
        for s in range(STEPS_PER_BATCH):
            ease = (0.1 if (s // 20 + b) % 2 == 0 else -0.1) + rng.gauss(0, 0.05)
            tier = fixed if fixed is not None else policy.pick(batch)
            lens, reach = step_accepts(tier, batch, ease, rng)
            spent += _serve(policy, fixed, tier, batch, lens, reach, ms[tier], HOST_MS[batch], rng)
            counts[tier] += 1
            tokens += sum(lens)
    return tokens / spent, counts


def _interpolated(table: dict[int, list[float]] | dict[int, float], batch: int):
    """A per-batch-size table's value at `batch`: linear between the sizes measured, the
    nearest one's outside them."""
    sizes = sorted(table)
    lo = max((b for b in sizes if b <= batch), default=sizes[0])
    hi = min((b for b in sizes if b >= batch), default=sizes[-1])
    if lo == hi:
        return table[lo]
    w = (batch - lo) / (hi - lo)
    a, b = table[lo], table[hi]
    if isinstance(a, list):
        return [x + w * (y - x) for x, y in zip(a, b)]
    return a + w * (b - a)


def run_static(
    batch: int,
    seed: int,
    output_len: int,
    fixed: int | None = None,
    first_look=None,
    spread: float = REQUEST_SPREAD,
):
    """Tokens per ms of a fixed tier, or (fixed None) of the policy, and steps per tier, over
    BATCHES static batches of `batch` requests generating `output_len` tokens each, each
    request's text `spread` apart in ease."""
    rng = random.Random(seed)
    policy = _policy(lambda b, t: _interpolated(STEP_MS, b)[t] / 1e3, first_look)
    tokens = spent = 0.0
    counts = [0] * len(TIERS)
    for b in range(BATCHES):
        policy.arrived(batch)
        own = [rng.gauss(0, spread) for _ in range(batch)]  # each request's text
        left = [output_len] * batch
        s = 0
        while own:
            ease = (0.1 if (s // 20 + b) % 2 == 0 else -0.1) + rng.gauss(0, 0.05)
            n = len(own)
            tier = fixed if fixed is not None else policy.pick(n)
            lens, reach = step_accepts(tier, n, ease, rng, own)
            lens = [min(k, r) for k, r in zip(lens, left)]
            ms, host_ms = _interpolated(STEP_MS, n)[tier], _interpolated(HOST_MS, n)
            spent += _serve(policy, fixed, tier, n, lens, reach, ms, host_ms, rng)
            counts[tier] += 1
            tokens += sum(lens)
            left = [r - k for r, k in zip(left, lens)]
            own = [e for e, r in zip(own, left) if r > 0]
            left = [r for r in left if r > 0]
            s += 1
    return tokens / spent, counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=16, choices=sorted(STEP_MS))
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--first-look", type=int, default=None, help="picks (default: the policy's)")
    p.add_argument(
        "--static-batches",
        type=int,
        default=None,
        metavar="OUTPUT_LEN",
        help="static batches of requests generating OUTPUT_LEN tokens each (a shrinking tail)",
    )
    p.add_argument(
        "--request-spread",
        type=float,
        default=REQUEST_SPREAD,
        metavar="SD",
        help="with --static-batches: how far apart requests' texts are in ease",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    if args.first_look is not None and args.first_look < 1:
        p.error("--first-look must be at least 1")
    if args.static_batches is not None and args.static_batches < 1:
        p.error("--static-batches must be at least 1")
    if args.request_spread < 0:
        p.error("--request-spread must be at least 0")
    if args.static_batches is None:
        simulate = run
    else:

        def simulate(batch, seed, fixed=None, first_look=None):
            return run_static(
                batch, seed, args.static_batches, fixed, first_look, args.request_spread
            )

    rows = []
    for seed in range(args.seeds):
        fixed = {
            t: simulate(args.batch_size, seed, fixed=t)[0]
            for t in range(len(TIERS))
            if not TIERS[t].ragged
        }
        best = max(fixed, key=fixed.get)
        got, counts = simulate(args.batch_size, seed, first_look=args.first_look)
        rows.append(
            {
                "seed": seed,
                "best_fixed": str(TIERS[best]),
                "best_tokens_per_ms": fixed[best],
                "adaptive_tokens_per_ms": got,
                "ratio": got / fixed[best],
                "steps": {str(TIERS[t]): c for t, c in enumerate(counts) if c},
            }
        )
    ratios = [r["ratio"] for r in rows]
    out = {
        "batch_size": args.batch_size,
        "first_look": args.first_look,
        "static_batches": args.static_batches,
        "request_spread": args.request_spread if args.static_batches is not None else None,
        "seeds": rows,
        "mean_ratio": statistics.mean(ratios),
        "worst_ratio": min(ratios),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print("| seed | best fixed | tokens/ms | adaptive | ratio | adaptive's steps |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['seed']} | {r['best_fixed']} | {r['best_tokens_per_ms']:.2f} "
            f"| {r['adaptive_tokens_per_ms']:.2f} | {r['ratio']:.3f} | {r['steps']} |"
        )
    print(f"mean {out['mean_ratio']:.3f}, worst {out['worst_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
