"""Decode throughput by batch size from `bench one-batch`-style JSON files (specserve's and
`bench/vllm_peer.py`'s), as tables with ratios and one plot.

Files in OUT_DIR are named SYSTEM-CONFIG[-acceptN].json (e.g. specserve-adaptive-accept3,
vllm-chain3-accept3, specserve-plain). Configurations without an accept length (plain
decoding) are compared in every group. Per group the table gives each configuration's tok/s
and, for specserve's adaptive rows, the ratio to vLLM's best and to specserve's plain.

  python3 bench/plot_throughput.py OUT_DIR [--title T]    # writes OUT_DIR/throughput.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def load(folder: str) -> dict[str, dict[int, float]]:
    runs = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(folder, name)) as f:
            try:
                rows = json.load(f)
            except ValueError:
                continue  # another tool's file, not a bench result
        if isinstance(rows, list) and rows and "decode_throughput_tok_s" in rows[0]:
            runs[name[:-5]] = {r["batch_size"]: r["decode_throughput_tok_s"] for r in rows}
    return runs


def groups(runs: dict[str, dict[int, float]]) -> dict[str, list[str]]:
    """accept length (or "-") -> the configurations compared under it."""
    accepts = sorted({m.group(1) for n in runs if (m := re.search(r"-accept(\d+)$", n))})
    shared = [n for n in runs if not re.search(r"-accept\d+$", n)]
    if not accepts:
        return {"-": list(runs)}
    return {a: shared + [n for n in runs if n.endswith(f"-accept{a}")] for a in accepts}


def table(runs, names: list[str]) -> list[str]:
    sizes = sorted({bs for n in names for bs in runs[n]})
    vllm = [n for n in names if n.startswith("vllm")]
    adaptive = [n for n in names if n.startswith("specserve-adaptive")]
    plain = "specserve-plain" if "specserve-plain" in names else None
    head = ["batch", *names]
    if adaptive and vllm:
        head.append("adaptive / vLLM best")
    if adaptive and plain:
        head.append("adaptive / plain")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for bs in sizes:
        cells = [str(bs)] + [f"{runs[n].get(bs, float('nan')):,.0f}" for n in names]
        a = runs[adaptive[0]].get(bs) if adaptive else None
        if adaptive and vllm:
            best = max((runs[n].get(bs, 0.0) for n in vllm), default=0.0)
            cells.append(f"{a / best:.2f}" if a and best else "-")
        if adaptive and plain:
            p = runs[plain].get(bs)
            cells.append(f"{a / p:.2f}" if a and p else "-")
        lines.append(" | ".join(cells))
    return lines


def plot(runs, grouped: dict[str, list[str]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = list(grouped) == ["-"]  # one panel without an accept length: the title is its own
    fig, axes = plt.subplots(
        1, len(grouped), figsize=(max(6, 5 * len(grouped)), 4.5), squeeze=False
    )
    for ax, (accept, names) in zip(axes[0], grouped.items()):
        for n in names:
            sizes = sorted(runs[n])
            ax.plot(sizes, [runs[n][s] for s in sizes], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tok/s")
        if not single:
            ax.set_title(f"accept length {accept}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", metavar="OUT_DIR", help="folder of one-batch JSON files")
    p.add_argument("--title", default="decode throughput", help="(default: %(default)s)")
    args = p.parse_args()
    if not os.path.isdir(args.folder):
        p.error(f"argument OUT_DIR: {args.folder} is not a folder")
    runs = load(args.folder)
    if not runs:
        print(f"error: no one-batch JSON in {args.folder}", file=sys.stderr)
        return 1
    grouped = groups(runs)
    for accept, names in grouped.items():
        print(f"\n### accept length {accept}\n")
        print("\n".join(table(runs, names)))
    out = os.path.join(args.folder, "throughput.png")
    plot(runs, grouped, out, args.title)
    print(f"\nplot: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
