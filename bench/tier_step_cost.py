"""The device time of a tree's decode step as a tier of load-adaptive speculation against the
same tree configured as the fixed one: does serving it under adaptive cost more on the device?

    python3 bench/tier_step_cost.py [--model-path smollm2-135m] [--tree 4,4,16] \
        [--batch-size 1 16 64 128] [--json out.json]                       # CUDA machine

Two engines share the GPU: the fixed tree (`--speculative-num-steps/-eagle-topk/-num-draft-
tokens` from --tree) and adaptive speculation over the model's served tree, whose tiers must
include --tree. Each step's CUDA graph is replayed on padding rows (as the policy times tiers
at start-up), best of three timings of 50 replays. Then one replay at the middle batch size
under torch.profiler: device time per kernel name and step, both engines side by side.
JSON, then tables.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.script_checks import check_output_file, require_cuda  # noqa: E402
from specserve import Engine  # noqa: E402
from specserve.bench.args import positive_int  # noqa: E402
from specserve.speculative.tree import TreeShape  # noqa: E402

REPLAYS = 50


def replay_seconds(engine, batch_size: int, tier: int) -> float:
    graphs = engine.core.worker.graphs
    return min(graphs.step_seconds(batch_size, tier, replays=REPLAYS) for _ in range(3))


def kernel_times(engine, batch_size: int, tier: int, replays: int = 20) -> dict[str, list]:
    """Device us per step by kernel name, and launches per step."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.core.worker.graphs
    graphs.step_seconds(batch_size, tier)  # (captures it)
    bucket = graphs.bucket(batch_size, 1)[0]
    key = next(k for k in graphs.graphs if k[0] == bucket and k[-2] == tier)
    graph = graphs.graphs[key].graph
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or 0.0
        if us > 0:
            out[event.key[:70]][0] += us / replays
            out[event.key[:70]][1] += event.count // replays
    return dict(out)


def tree_shape(value: str) -> tuple[int, int, int]:
    """--tree: three integers >= 1, steps,topk,num_draft_tokens."""
    parts = value.split(",")
    if len(parts) != 3 or not all(v.strip().isdigit() and int(v) >= 1 for v in parts):
        raise argparse.ArgumentTypeError(
            f"must be steps,topk,num_draft_tokens (three integers >= 1), got {value!r}"
        )
    steps, topk, tokens = (int(v) for v in parts)
    return steps, topk, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--tree", type=tree_shape, default="4,4,16", help="steps,topk,num_draft_tokens")
    p.add_argument("--batch-size", type=positive_int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument(
        "--max-total-tokens", type=positive_int, default=100_000, help="each engine's KV"
    )
    p.add_argument("--top", type=positive_int, default=25, help="kernel names to list")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    check_output_file(p, "--json", args.json)
    # Replayed CUDA graphs are what it times; a CPU's adaptive chain has no such tiers either.
    require_cuda(__file__, "it times replayed CUDA graphs")
    steps, topk, tokens = args.tree
    tree = f"{steps},{topk},{tokens}"
    base = dict(
        model_path=args.model_path, dtype="bfloat16", max_total_tokens=args.max_total_tokens
    )
    fixed = Engine(
        **base,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=tokens,
    )
    adaptive = Engine(**base, speculative_adaptive=True)
    try:
        tiers = adaptive.core.adaptive.tiers
        if TreeShape(steps, topk, tokens) not in tiers:
            p.error(
                f"argument --tree: {tree} is not one of the adaptive tiers here: "
                + ", ".join(f"{t.steps},{t.topk},{t.tokens}" for t in tiers)
            )
        tier = tiers.index(TreeShape(steps, topk, tokens))
        rows = []
        for bs in args.batch_size:
            f, a = replay_seconds(fixed, bs, 0), replay_seconds(adaptive, bs, tier)
            rows.append({"batch_size": bs, "fixed_ms": f * 1e3, "tier_ms": a * 1e3, "ratio": a / f})
        mid = args.batch_size[len(args.batch_size) // 2]
        kf, ka = kernel_times(fixed, mid, 0), kernel_times(adaptive, mid, tier)
    finally:
        fixed.shutdown()
        adaptive.shutdown()
    result = {"tree": tree, "tiers": [str(t) for t in tiers], "replays": rows,
              "kernels_batch": mid, "kernels_fixed": kf, "kernels_tier": ka}  # fmt: skip
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\ntree {tree}: fixed configuration vs adaptive tier (ms per replayed step)")
    print("batch | fixed | tier | tier / fixed")
    for r in rows:
        print(f"{r['batch_size']} | {r['fixed_ms']:.3f} | {r['tier_ms']:.3f} | {r['ratio']:.3f}")
    print(f"\nkernels at batch {mid} (us per step, launches): fixed | tier")
    names = sorted(set(kf) | set(ka), key=lambda n: -(kf.get(n, [0])[0] + ka.get(n, [0])[0]))
    for n in names[: args.top]:
        (fu, fc), (au, ac) = kf.get(n, [0.0, 0]), ka.get(n, [0.0, 0])
        print(f"{n} | {fu:.1f} ({fc}) | {au:.1f} ({ac})")
    total = [sum(v[0] for v in k.values()) for k in (kf, ka)]
    print(f"total | {total[0]:.1f} | {total[1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
