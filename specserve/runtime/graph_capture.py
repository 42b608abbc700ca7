"""Capturing a CUDA graph, and what decode and prefill graphs share around it: static inputs
written from the host without a sync, and shape buckets."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")

# Engines of one process take turns at what involves the whole device: a capture, and the
# calls that synchronize every stream. One engine's device-wide synchronize (torch.cuda.graph
# makes one before each capture; empty_cache does too) while another engine's thread
# captures breaks that capture, and torch then leaves the graph pool recording, so every
# later capture on it fails. (Seen on an H100: two engines serving from two threads.)
DEVICE_WIDE = threading.RLock()


def synchronize_device(device: torch.device) -> None:
    """Wait for every stream of the device, never while another thread captures."""
    with DEVICE_WIDE:
        torch.cuda.synchronize(device)


def release_cached_memory() -> None:
    """torch's cached blocks back to the device, never while another thread captures."""
    with DEVICE_WIDE:
        torch.cuda.empty_cache()


def pow2_bucket(n: int, minimum: int) -> int:
    """The smallest power-of-two multiple of `minimum` that is >= n."""
    size = minimum
    while size < n:
        size *= 2
    return size


def capture_graph(fn, pool, device: torch.device):
    """Warm `fn` up on a side stream (Triton compiles, the allocator settles), then capture
    it into a new graph on `pool`. Returns (graph, fn's outputs as captured).

    Running out of device memory raises torch.OutOfMemoryError, and the caller may then run
    the step eagerly: in a warm-up, the memory is freed; in the capture, torch ends the
    capture cleanly (what it strands in `pool` serves later captures). Any other error
    while the capture ends (the stream left capturing) is no such error: serving on after it
    would run on a state nothing checked."""
    # One capture at a time in the process, its warm-up included: torch hands out streams
    # from a pool of 32 in turn, so another engine's warm-up stream may be the one this
    # capture records (its kernels then replayed with this graph, silently), and an event
    # wait on the default stream while another thread captures fails ("operation would make
    # the legacy stream depend on a capturing blocking stream", two engines on an H100).
    with DEVICE_WIDE:
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's allocations (another engine's steps) may go on
            # while this one captures
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = fn()
        finally:  # (torch leaves its capture stream current if ending the capture raises)
            torch.cuda.set_stream(current)
    return graph, out


def copy_from_host(dst: torch.Tensor, values: list[int]) -> None:
    """Into a graph's static input, stream-ordered, without making the host wait (pinned
    staging on CUDA)."""
    src = torch.tensor(values, dtype=dst.dtype)
    if dst.device.type == "cuda":
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


def capture_unless_out_of_memory(capture: Callable[[], T], what: str, fallback: bool) -> T | None:
    """capture(); None when the device has no memory for it and `fallback` allows running
    the step eagerly instead (a capture runs on padding rows alone, so no request's state has
    moved). Only running out of memory is taken so: any other error is raised."""
    try:
        return capture()
    except torch.OutOfMemoryError:
        if not fallback:
            raise
    log.warning("no device memory to capture %s: its steps run eagerly", what)
    release_cached_memory()  # (what the failed capture's warm-up left cached)
    return None
