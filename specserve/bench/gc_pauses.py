"""Garbage-collector pauses during a timed run: how many collections of each generation ran
and how long the process stood still in them (a collection holds the interpreter, so the
engine's loop launches nothing meanwhile and the device may run dry)."""

from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager


class GcPauses:
    def __init__(self):
        self.collections = [0, 0, 0]  # per generation
        self.seconds = 0.0
        self._started: dict[int, float] = {}  # thread id -> when its collection started
        self._lock = threading.Lock()

    def _callback(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        tid = threading.get_ident()
        with self._lock:
            if phase == "start":
                self._started[tid] = now
            elif tid in self._started:
                self.seconds += now - self._started.pop(tid)
                self.collections[info["generation"]] += 1

    def row(self) -> dict:
        return {"gc_collections": list(self.collections), "gc_pause_ms": 1e3 * self.seconds}


@contextmanager
def gc_pauses():
    """Record the collections that run inside the block (any thread)."""
    pauses = GcPauses()
    gc.callbacks.append(pauses._callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(pauses._callback)
