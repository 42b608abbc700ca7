"""Helpers of bench/serving_vs_vllm.sh: specserve's speculation counters around a run, and the
table of specserve against vLLM from the result files `vllm bench serve --save-result` wrote.

  python3 bench/serving_vs_vllm.py counters http://127.0.0.1:PORT OUT.json
  python3 bench/serving_vs_vllm.py table OUT_DIR [--json ROWS.json]

Result files are named SYSTEM-DATASET-cCONCURRENCY.json (SYSTEM: specserve or vllm); vLLM's
client writes mean_ttft_ms, median_ttft_ms, p99_ttft_ms, mean_tpot_ms, output_throughput
(tok/s), completed, failed, total_output_tokens and, for a vLLM server with speculation, spec_decode_acceptance_length.
It cannot read specserve's counters, so the script saves them before and after each specserve
run (SYSTEM-DATASET-cC.before.json / .after.json); the accept length is then tokens emitted
per verify step, the quantity vLLM reports (1 + accepted drafts per draft). The same counters
show how specserve's engine spent the run: decode steps, prefill batches, how many of each
kept the device busy while the host worked (overlap), and graphs captured while serving.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import urllib.request

SYSTEMS = ("specserve", "vllm")
RESULT_NAME = re.compile(r"^(specserve|vllm)-([a-z0-9_]+)-c(\d+)\.json$")
COUNTER = re.compile(r"^specserve_([a-z_]+)_total\s+([0-9.eE+-]+)\s*$", re.M)
# engine counters reported per run: (counter, column title)
ENGINE_COUNTERS = (
    ("engine_steps", "engine steps"),
    ("prefill_batches", "prefill batches"),
    ("prefill_batches_beside_decode", "of which beside a decode step"),
    ("decode_steps_launched_ahead", "decode steps launched ahead"),
    ("graph_captures", "graph captures"),
)
# (result key, column title, lower is better)
METRICS = (
    ("mean_ttft_ms", "TTFT ms", True),
    ("median_ttft_ms", "p50 TTFT ms", True),
    ("p99_ttft_ms", "p99 TTFT ms", True),
    ("mean_tpot_ms", "TPOT ms", True),
    ("output_throughput", "output tok/s", False),
)


# ---- specserve's counters ---------------------------------------------------------------------
def parse_counters(metrics_text: str) -> dict[str, float]:
    return {name: float(value) for name, value in COUNTER.findall(metrics_text)}


def fetch_counters(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=30) as r:
        return parse_counters(r.read().decode())


def accept_length(before: dict[str, float], after: dict[str, float]) -> float | None:
    steps = after.get("spec_verify_steps", 0.0) - before.get("spec_verify_steps", 0.0)
    if steps <= 0:
        return None
    return (after["spec_accepted_tokens"] - before["spec_accepted_tokens"]) / steps


def engine_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What specserve's engine did between the two readings (None: a counter it lacks)."""
    return {
        key: after[key] - before.get(key, 0.0) if key in after else None
        for key, _ in ENGINE_COUNTERS
    }


# ---- the table --------------------------------------------------------------------------------
def _read(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_results(out_dir: str) -> dict[tuple[str, str, int], dict]:
    """{(system, dataset, concurrency): result}, each with its accept length."""
    results = {}
    for name in sorted(os.listdir(out_dir)):
        m = RESULT_NAME.match(name)
        if not m:
            continue
        result = _read(os.path.join(out_dir, name))
        stem = os.path.join(out_dir, name[: -len(".json")])
        before, after = _read(stem + ".before.json"), _read(stem + ".after.json")
        if before and after:
            if result.get("spec_decode_acceptance_length") is None:
                result["spec_decode_acceptance_length"] = accept_length(before, after)
            result["engine"] = engine_deltas(before, after)
        results[(m[1], m[2], int(m[3]))] = result
    return results


def _ratio(ours, theirs) -> float | None:
    if ours is None or theirs is None or not theirs:
        return None
    return ours / theirs


def comparison_rows(results: dict[tuple[str, str, int], dict]) -> list[dict]:
    """One row per (dataset, concurrency): each metric for both systems and specserve/vLLM."""
    rows = []
    for dataset, c in sorted({(d, c) for _, d, c in results}):
        pair = {s: results.get((s, dataset, c)) for s in SYSTEMS}
        row: dict = {"dataset": dataset, "concurrency": c}
        for key, _, _ in METRICS + (("spec_decode_acceptance_length", "", False),):
            for s in SYSTEMS:
                row[f"{s}_{key}"] = (pair[s] or {}).get(key)
            row[f"ratio_{key}"] = _ratio(row[f"specserve_{key}"], row[f"vllm_{key}"])
        for s in SYSTEMS:
            row[f"{s}_failed"] = (pair[s] or {}).get("failed")
            row[f"{s}_total_output_tokens"] = (pair[s] or {}).get("total_output_tokens")
        row["specserve_engine"] = (pair["specserve"] or {}).get("engine")
        rows.append(row)
    return rows


def _fmt(v) -> str:
    """Three significant digits; whole numbers from 1000 up."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def format_table(rows: list[dict]) -> str:
    head = ["dataset", "conc"]
    for _, title, lower in METRICS:
        better = "lower" if lower else "higher"
        head += [f"{title} specserve", f"{title} vLLM", f"s/v ({better} is better)"]
    head += ["accept specserve", "accept vLLM"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [r["dataset"], str(r["concurrency"])]
        for key, _, _ in METRICS:
            cells += [_fmt(r[f"specserve_{key}"]), _fmt(r[f"vllm_{key}"])]
            cells.append(_fmt(r[f"ratio_{key}"]))
        acc = "spec_decode_acceptance_length"
        cells += [_fmt(r[f"specserve_{acc}"]), _fmt(r[f"vllm_{acc}"])]
        lines.append(" | ".join(cells))
    notes = warnings(rows)
    return "\n".join(lines + engine_table(rows) + ([""] + notes if notes else []))


def engine_table(rows: list[dict]) -> list[str]:
    """specserve's engine counters over each run (warm-up requests included), if saved."""
    runs = [r for r in rows if r.get("specserve_engine")]
    if not runs:
        return []
    head = ["dataset", "conc"] + [title for _, title in ENGINE_COUNTERS]
    lines = ["", "specserve's engine during each run:", " | ".join(head)]
    lines.append(" | ".join("---" for _ in head))
    for r in runs:
        cells = [r["dataset"], str(r["concurrency"])]
        cells += [_fmt(r["specserve_engine"][key]) for key, _ in ENGINE_COUNTERS]
        lines.append(" | ".join(cells))
    return lines


def warnings(rows: list[dict]) -> list[str]:
    """What makes a row's comparison unfair: failed requests, unequal generated tokens."""
    out = []
    for r in rows:
        where = f"{r['dataset']} at concurrency {r['concurrency']}"
        for s in SYSTEMS:
            if r[f"{s}_failed"]:
                out.append(f"warning: {s} {where}: {r[f'{s}_failed']} requests failed")
        ours, theirs = r["specserve_total_output_tokens"], r["vllm_total_output_tokens"]
        if ours is not None and theirs is not None and ours != theirs:
            out.append(
                f"warning: {where}: specserve generated {ours} tokens, vLLM {theirs} "
                "(EOS not ignored?)"
            )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("counters", help="specserve's counters as JSON")
    c.add_argument("base_url")
    c.add_argument("out")
    t = sub.add_parser("table", help="specserve against vLLM from the result files")
    t.add_argument("out_dir")
    t.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    if args.cmd == "counters":
        with open(args.out, "w") as f:
            json.dump(fetch_counters(args.base_url), f)
        return 0
    rows = comparison_rows(load_results(args.out_dir))
    if not rows:
        print(f"no result files in {args.out_dir}", file=sys.stderr)
        return 1
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
