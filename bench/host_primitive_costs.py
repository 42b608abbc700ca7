"""The host's microseconds for the small CUDA calls a decode step makes between graph replays
(a kernel launch, a host->device copy of a few ints through pinned staging, timing events,
reading a step's results): where a batch of a small model waits on the host, these set the
price of each extra call. The device is kept busy meanwhile (a large matmul every 200 calls),
as under overlap scheduling, so no call waits for it. Prints JSON, then a table.

    python3 bench/host_primitive_costs.py [--calls 2000] [--json OUT.json]   # CUDA
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Runnable as a plain script from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.script_checks import require_cuda  # noqa: E402
from specserve.device import to_device  # noqa: E402


def time_calls(fn, calls: int, busy: torch.Tensor | None) -> float:
    """Microseconds per call of `fn`, after a warm-up."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        if busy is not None and i % 200 == 0:
            busy @ busy
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def measure(calls: int) -> dict[str, float]:
    dev = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=dev)
    busy @ busy  # (the matmul library's set-up is not any call's)
    ints = list(range(40))
    host = torch.tensor(ints)
    pinned = torch.empty(4096, dtype=torch.int64).pin_memory()
    pages = torch.zeros(256, 4096, dtype=torch.int32, device=dev)
    idx = torch.arange(40, device=dev)
    vals = idx.to(torch.int32)
    results = torch.randint(0, 100, (128, 7), device=dev)
    np_ints = np.arange(40)

    def events():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()

    cases = {
        "torch.tensor of 40 ints": (lambda: torch.tensor(ints), True),
        "pinned staging + copy of 40 int64 (to_device)": (lambda: to_device(host, dev), True),
        "copy into a kept pinned buffer + copy": (
            lambda: pinned[:40].copy_(host).to(dev, non_blocking=True),
            True,
        ),
        "kernel launch (in-place add)": (lambda: results.add_(0), True),
        "index_put by row and position": (lambda: pages.__setitem__((idx, idx), vals), True),
        "index_copy_ on the flat view": (lambda: pages.view(-1).index_copy_(0, idx, vals), True),
        "two timing events created and recorded": (events, True),
        "np.unique of 40": (lambda: np.unique(np_ints, return_index=True), True),
        "tolist of a [128, 7] result (device idle)": (lambda: results.tolist(), False),
    }
    return {
        name: time_calls(fn, calls, busy if keep_busy else None)
        for name, (fn, keep_busy) in cases.items()
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.calls < 1:
        p.error("--calls must be at least 1")
    require_cuda(__file__, "these are the costs of CUDA calls")
    out = {"device": torch.cuda.get_device_name(), "us_per_call": measure(args.calls)}
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    print("| call | us |\n| --- | --- |")
    for name, us in out["us_per_call"].items():
        print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
