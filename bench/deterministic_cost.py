"""What deterministic inference costs in decode throughput: `specserve bench one-batch` with and
without --enable-deterministic-inference, same engine otherwise (bf16, CUDA graphs, greedy).

    python3 bench/deterministic_cost.py [--only smol|8b] [--out DIR]     # CUDA machine

Cases (the ones the default is decided by: at most 3% slower in each):
- smol-plain: the packaged SmolLM2-135M, plain decoding, batch 1;
- smol-tree: SmolLM2-135M with its bundled draft (the served tree), batch 1;
- 8b-plain: the Llama-3-8B shape with random weights (--load-format dummy), plain decoding,
  batch 1 and 16 (512-token prompts, 256 new tokens).
Each run is a fresh process (its own CUDA graphs and Triton compilations); its rows go to
DIR/<case>-<mode>.json. Prints every row as JSON, then a table of decode tok/s and the ratio
deterministic / default (1.00 = free; the default flips at >= 0.97 in every row).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.script_checks import require_cuda  # noqa: E402

SMOL = ["--input-len", "128", "--output-len", "256"]
CASES = {  # name: (one-batch flags, batch sizes)
    "smol-plain": (SMOL + ["--no-default-draft"], ["1"]),
    "smol-tree": (SMOL, ["1"]),
    "8b-plain": (
        [
            "--model-path",
            "llama3-8b",
            "--load-format",
            "dummy",
            "--input-len",
            "512",
            "--output-len",
            "256",
        ],
        ["1", "16"],
    ),  # fmt: skip
}
MODES = {"default": [], "deterministic": ["--enable-deterministic-inference"]}


def run_case(name: str, mode: str, out: Path) -> list[dict]:
    flags, sizes = CASES[name]
    path = out / f"{name}-{mode}.json"
    cmd = [sys.executable, "-m", "specserve.cli", "bench", "one-batch", *flags,
           "--batch-size", *sizes, *MODES[mode], "--output-json", str(path)]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    log = out / f"{name}-{mode}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not path.exists():
        print(f"{name} {mode}: failed (rc {rc}), see {log}", flush=True)
        return []
    rows = json.loads(path.read_text())
    for r in rows:
        r.update(case=name, mode=mode)
        print(json.dumps(r), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=["smol", "8b"], help="run only these cases")
    p.add_argument("--out", default="/tmp/deterministic_cost")
    args = p.parse_args()
    # --enable-deterministic-inference's kernels are CUDA-only: a CPU run measures nothing
    require_cuda(__file__, "deterministic inference's kernels are CUDA-only")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in CASES:
        if args.only and not name.startswith(args.only):
            continue
        for mode in MODES:
            rows += run_case(name, mode, out)
    table = []
    for name in CASES:
        for bs in CASES[name][1]:
            got = {r["mode"]: r for r in rows if r["case"] == name and r["batch_size"] == int(bs)}
            if len(got) < 2:
                continue
            base, det = got["default"], got["deterministic"]
            table.append(
                {
                    "case": name,
                    "batch_size": int(bs),
                    "default_tok_s": base["decode_throughput_tok_s"],
                    "deterministic_tok_s": det["decode_throughput_tok_s"],
                    "ratio": det["decode_throughput_tok_s"] / base["decode_throughput_tok_s"],
                    "accept_default": base.get("spec_accept_length", ""),
                    "accept_deterministic": det.get("spec_accept_length", ""),
                }
            )
    (out / "summary.json").write_text(json.dumps(table, indent=2))
    print(json.dumps(table, indent=2))
    keys = list(table[0]) if table else []
    print(" | ".join(keys))
    print(" | ".join("---" for _ in keys))
    for r in table:
        print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))
    return 0 if table else 1


if __name__ == "__main__":
    sys.exit(main())
