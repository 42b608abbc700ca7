"""Capturing a CUDA graph, and what decode and prefill graphs share around it: static inputs
written from the host without a sync, shape buckets, and telling a capture that ran out of
device memory from one that failed otherwise."""

from __future__ import annotations

import torch


def pow2_bucket(n: int, minimum: int) -> int:
    """The smallest power-of-two multiple of `minimum` that is >= n."""
    size = minimum
    while size < n:
        size *= 2
    return size


def capture_graph(fn, pool, device: torch.device):
    """Warm `fn` up on a side stream (Triton compiles, the allocator settles), then capture
    it into a new graph on `pool`. Returns (graph, fn's outputs as captured)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is the device running out of memory, or an error raised while a graph
    capture unwound from it (ending a capture that failed raises one of its own)."""
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def copy_from_host(dst: torch.Tensor, values: list[int]) -> None:
    """Into a graph's static input, stream-ordered, without making the host wait (pinned
    staging on CUDA)."""
    src = torch.tensor(values, dtype=dst.dtype)
    if dst.device.type == "cuda":
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)
