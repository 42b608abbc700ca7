"""The host's own time per decode step while steps overlap.

Under overlap the loop launches step k+1, waits for step k, applies its results (stop checks,
detokenizing, streaming) and comes back to launch k+2. The wall time between two launches,
less the time spent waiting for the device in between, is what the host itself needed per
step; load-adaptive speculation weighs it per token the step emitted against the device's
time of each tier.
An interval that also ran a prefill, captured a graph or started from an idle loop says
nothing about a step and is not reported. Time spent completing finished requests (reaping
their state, delivering their final output) is set aside: every request costs it once,
whatever tier decoded it, and it falls on the steps of a batch's tail. (SmolLM2 on an H200 at
batch 16: the host took 1.33 ms a step at 16 requests and 1.87 ms at 10, where requests
finish; counted per emitted token, 29 us against 58, and the tail's steps, the latest at
the batch bucket when the next batch started, made every tier look bound by the host.)
"""

from __future__ import annotations

import time


class HostClock:
    def __init__(self, now=time.perf_counter):
        self._now = now
        self._since: float | None = None  # the last launch of a clean interval
        self._waited = 0.0  # seconds spent waiting for the device since then
        self._aside = 0.0  # seconds spent completing finished requests since then
        # (tier, batch size, tokens emitted) of the step applied since then
        self._applied: tuple[int, int, int] | None = None

    def launch(self) -> tuple[int, int, float, int] | None:
        """A decode step is being launched. Returns (tier, batch size, host seconds, tokens
        emitted) of the step applied since the previous launch, when the interval between
        was clean."""
        now = self._now()
        out = None
        if self._since is not None and self._applied is not None:
            tier, batch_size, tokens = self._applied
            out = (tier, batch_size, now - self._since - self._waited - self._aside, tokens)
        self._since, self._waited, self._aside, self._applied = now, 0.0, 0.0, None
        return out

    def waited(self, seconds: float, tier: int, batch_size: int, tokens: int) -> None:
        """A launched step of `tier` over `batch_size` requests was awaited for `seconds`,
        then applied; it emitted `tokens` tokens in all."""
        self._waited += seconds
        self._applied = (tier, batch_size, tokens)

    def set_aside(self, seconds: float) -> None:
        """`seconds` were spent completing finished requests: not a step's own time."""
        self._aside += seconds

    def interrupt(self) -> None:
        """Something other than a step's own work happened: the interval is not reported."""
        self._since = None
