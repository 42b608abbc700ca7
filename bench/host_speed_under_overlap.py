"""Does the host's own work per step run slower when the host, not the device, sets the pace?

An engine loop under overlap scheduling launches step k, waits for step k-1, then applies its
results (Python) before launching k+1. Traces of SmolLM2 at batch 128 found the same Python
functions 1.5x slower per call in engines bound by the host than in one bound by the device,
in one process, on one CPU. This loop reproduces the pattern without an engine: a fixed
pure-Python workload plus the CUDA calls a step makes (a pinned copy back, a small copy in,
a graph replay), with device work per step from none to more than the host's, and prints the
host work's time per step in each regime. Meant for a CUDA machine.

    python3 bench/host_speed_under_overlap.py [--steps 400] [--cpu 3] [--output-json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.script_checks import require_cuda  # noqa: E402


def python_work(items: list[int]) -> int:
    """Per-request bookkeeping of a step, in miniature: a loop over a batch's lists."""
    total = 0
    for i in items:
        total += (i * 7) & 15
        if total > 1 << 30:
            total = 0
    return total


def python_timed(items: list[int]) -> float:
    """Milliseconds `python_work` takes alone."""
    start = time.perf_counter()
    python_work(items)
    return (time.perf_counter() - start) * 1e3


def cycles_per_ms() -> float:
    """Device clock cycles `torch.cuda._sleep` busy-waits per millisecond, measured."""
    torch.cuda._sleep(1_000_000)  # (warm)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def measure(device_ms: float, steps: int, items: list[int], cycles: float) -> dict:
    """Run `steps` overlapped steps whose device part lasts about device_ms; returns the host
    work's and the whole step's median milliseconds."""
    dev = torch.device("cuda")
    spin = torch.cuda._sleep  # busy-waits on the device for a number of cycles
    a = torch.zeros(128, dtype=torch.int32, device=dev)
    host_out = torch.empty(128, dtype=torch.int32, pin_memory=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a.add_(1)
    pending = None
    host_ms, step_ms = [], []
    last = time.perf_counter()
    for _ in range(steps):
        if device_ms > 0:
            spin(int(device_ms * cycles))
        graph.replay()
        host_out.copy_(a, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        if pending is not None:
            pending.synchronize()
        start = time.perf_counter()
        values = host_out.tolist()
        python_work(items)
        torch.tensor(values, dtype=torch.int32).to(dev, non_blocking=True)
        now = time.perf_counter()
        host_ms.append((now - start) * 1e3)
        step_ms.append((now - last) * 1e3)
        last = now
        pending = event
    torch.cuda.synchronize()
    return {
        "device_ms": device_ms,
        "host_work_ms": round(statistics.median(host_ms), 4),
        "step_ms": round(statistics.median(step_ms), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--items", type=int, default=20000, help="Python loop length per step")
    p.add_argument("--cpu", type=int, default=None, help="pin this thread to one CPU (Linux)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    require_cuda(__file__)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    items = list(range(args.items))
    # the host work alone (no device work pending) sets the scale of the device parts
    alone = statistics.median(python_timed(items) for _ in range(50))
    cycles = cycles_per_ms()
    rows = []
    for _ in range(args.rounds):  # (in turns: the host's speed drifts)
        for factor in (0.0, 0.5, 0.9, 1.5, 3.0):
            rows.append(measure(factor * alone, args.steps, items, cycles) | {"factor": factor})
    print(json.dumps({"host_work_alone_ms": round(alone, 4), "rows": rows}, indent=2))
    print("| device / host work | host work ms (rounds) | step ms (rounds) |")
    print("| --- | --- | --- |")
    for factor in (0.0, 0.5, 0.9, 1.5, 3.0):
        mine = [r for r in rows if r["factor"] == factor]
        work = ", ".join(f"{r['host_work_ms']:.3f}" for r in mine)
        step = ", ".join(f"{r['step_ms']:.3f}" for r in mine)
        print(f"| {factor} | {work} | {step} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"host_work_alone_ms": alone, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
