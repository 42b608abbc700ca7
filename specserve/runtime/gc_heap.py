"""Keeping Python's garbage collector off the serving loop's critical path.

A full collection scans every tracked object. Once an engine has started, most of them are
its own long-lived state (torch and Triton modules, the model, compiled kernels, captured
CUDA graphs): a few hundred thousand objects, scanned again at every full collection for
nothing, which stalls the loop for tens of milliseconds (about 140 ms on a 2-core machine
at the tiny test shape) while the device runs dry. Freezing the heap once start-up is done
moves them out of the collector's sight; what serving allocates later is collected as
usual. vLLM freezes its heap after start-up for the same reason.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """After start-up: collect what start-up left behind, then exempt the survivors."""
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    """At shutdown: hand frozen objects back to the collector, so an engine's state can be
    reclaimed once nothing refers to it (in a process that starts several engines)."""
    gc.unfreeze()
