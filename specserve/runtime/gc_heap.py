"""Keeping Python's garbage collector off the serving loop's critical path.

A full collection scans every tracked object. Once an engine has started, most of them are
its own long-lived state (torch and Triton modules, the model, compiled kernels, captured
CUDA graphs): a few hundred thousand objects, scanned again at every full collection for
nothing, which stalls the loop for tens of milliseconds (about 140 ms on a 2-core machine
at the tiny test shape) while the device runs dry. Freezing the heap once start-up is done
moves them out of the collector's sight; what serving allocates later is collected as
usual. vLLM freezes its heap after start-up for the same reason.

`gc.unfreeze` thaws everything frozen in the process, so it waits until the last engine of
the process has shut down: one engine's shutdown must not bring back the pauses of another
that is still serving.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_live_engines = 0  # engines started and not yet shut down in this process


def freeze_startup_heap() -> None:
    """After an engine's start-up: collect what start-up left behind, then exempt the
    survivors (the state of engines already running included)."""
    global _live_engines
    with _lock:
        _live_engines += 1
        gc.collect()
        gc.freeze()


def unfreeze_heap() -> None:
    """At an engine's shutdown: once no engine is left, hand the frozen objects back to the
    collector, so their state can be reclaimed once nothing refers to it."""
    global _live_engines
    with _lock:
        _live_engines = max(0, _live_engines - 1)
        if _live_engines == 0:
            gc.unfreeze()
