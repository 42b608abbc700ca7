"""Engines still running when the interpreter exits are shut down first.

An `Engine(...)` is often never closed (vLLM's `LLM` is used so). Its loop thread is a daemon
and its start-up heap is frozen for the collector (runtime/gc_heap.py): left so, the process
ends under the running loop with every frozen object alive, and on a CPU Triton reports each
of its own as leaked. So at exit every tracked engine is asked to stop, then waited for, all
within one deadline: a stuck loop delays exit by EXIT_WAIT_S at most, whatever the count.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref

log = logging.getLogger(__name__)

# The longest exit waits for every loop to end (Engine.shutdown's own wait is 30 s).
EXIT_WAIT_S = 30.0

_live: weakref.WeakSet = weakref.WeakSet()


def track(engine) -> None:
    """Shut `engine` down at interpreter exit unless it is gone by then (`shutdown(timeout)`
    and `wait_closed(timeout)` are all it needs)."""
    _live.add(engine)


@atexit.register
def _shut_down_live_engines() -> None:
    engines = list(_live)
    deadline = time.monotonic() + EXIT_WAIT_S
    for engine in engines:  # (each call stops its loop and waits out what is left)
        try:
            engine.shutdown(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:
            log.exception("shutting an engine down at exit failed")
    for engine in engines:  # (one shut down from its own callback closes itself: wait)
        engine.wait_closed(timeout=max(0.0, deadline - time.monotonic()))
