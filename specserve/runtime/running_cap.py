"""How many requests may run at once after the device ran out of memory.

A step that runs the device out of memory retracts the started requests
(`EngineCore.retract_after_out_of_memory`) and the cap drops to half of them at once: what
failed was a step's transient memory (its activations, logits, a prefill's chunk), which
shrinks with the batch. The cause may have passed (another process's memory, one long
prompt's prefill), so a cap kept at half would cost half the throughput for the engine's
life. It climbs back one request every `RESTORE_STEPS` decode steps that complete, but never
to a count that ran out of memory: at most one below the smallest started count that did,
and never above the configured cap. So each failure costs one retraction, and the engine
settles just below what the device held; it never probes a count that failed again.
"""

from __future__ import annotations

# Decode steps that complete per request the cap climbs back. (From 128 to 255 that is about
# 4,000 steps, seconds to a minute of decoding: the climb is slow against a retraction, which
# recomputes every started request's KV.)
RESTORE_STEPS = 32


class RunningCap:
    def __init__(self, configured: int, restore_steps: int = RESTORE_STEPS):
        self.configured = configured
        self.restore_steps = restore_steps
        self.ceiling = configured  # the most that may ever run again
        self._steps = 0  # decode steps completed since the cap last moved

    def ran_out_of_memory(self, started: int, cap: int) -> int:
        """The new cap after `started` requests (more than one) ran the device out of memory
        under `cap`: half of them, rounded up."""
        self.ceiling = min(self.ceiling, started - 1)
        self._steps = 0
        return min(cap, (started + 1) // 2)

    def decode_step_done(self, cap: int) -> int:
        """The cap after a decode step completed under `cap`."""
        if cap >= self.ceiling:
            return cap
        self._steps += 1
        if self._steps < self.restore_steps:
            return cap
        self._steps = 0
        return cap + 1
