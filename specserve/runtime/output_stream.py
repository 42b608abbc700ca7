"""`OutputStream`: what `Engine.generate(stream=True)` returns, an iterator over one prompt's
incremental outputs. Its requests are submitted before it is returned (an abort by their rid
reaches them at once, and a refusal is raised by the call, not by the first read); closing it,
or dropping it, aborts the samples not yet finished."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Any


class OutputStream(Iterator[dict]):
    def __init__(self, outputs: queue.Queue, samples: int, abort: Callable[[list[int]], None]):
        """outputs: (sample index, output dict) as the engine delivers them; abort(indices):
        abort those samples (each by its own request, whatever its id names now)."""
        self._outputs = outputs
        self._unfinished = set(range(samples))
        self._abort = abort

    def __iter__(self) -> OutputStream:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self._unfinished:
            raise StopIteration
        try:
            index, out = self._outputs.get()
        except BaseException:  # (interrupted while waiting: nobody reads the rest)
            self.close()
            raise
        if out["finished"]:
            self._unfinished.discard(index)
        return {**out, "index": index}

    def close(self) -> None:
        """Abort the samples not finished yet (the engine frees their KV)."""
        if self._unfinished:
            unfinished, self._unfinished = sorted(self._unfinished), set()
            self._abort(unfinished)

    def __del__(self) -> None:
        self.close()
