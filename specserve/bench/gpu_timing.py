"""Timing helpers for the kernel micro-benchmarks under bench/ (CUDA only)."""

from __future__ import annotations

import torch


def captured(fn):
    """(graph, fn's outputs as captured): fn warmed up on a side stream (compiles, allocator),
    captured, replayed once and synchronised, so the outputs hold a replay's results."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def graph_ms(fn) -> float:
    """Median ms of replaying fn from a CUDA graph (no Python launch overhead)."""
    from triton.testing import do_bench

    graph, _ = captured(fn)
    return do_bench(graph.replay, return_mode="median")


def warm_up_clocks(seconds: float = 1.0) -> None:
    """The GPU idles at low clocks; keep it busy a moment so the first case is not slow."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return
