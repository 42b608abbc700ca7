"""How many requests may run at once after the device ran out of memory.

A step that runs the device out of memory retracts the started requests
(`EngineCore.retract_after_out_of_memory`) and the cap drops to half of them at once: what
failed was a step's transient memory (its activations, logits, a prefill's chunk), which
shrinks with the batch. The cause may pass (another process's memory, one request's many
log-probs), and a cap kept at half would cost half the throughput for the engine's life, so
it climbs back one request every `RESTORE_STEPS` decode steps that complete, up to a ceiling:
one below the smallest decode batch that ran out of memory (a prefill's failure says nothing
of decode batches: its size is the chunk's tokens), never above the configured cap. So a
failed decode batch size is not run again at once; the ceiling itself rises one request
every `CEILING_RESTORE_STEPS` decode steps, so a passing shortage does not cap the engine for
good, while a lasting one costs one retraction per that many steps at most.
"""

from __future__ import annotations

# Decode steps that complete per request the cap climbs back. (From 128 to 255 that is about
# 4,000 steps, seconds to a minute of decoding: the climb is slow against a retraction, which
# recomputes every started request's KV.)
RESTORE_STEPS = 32
# Decode steps that complete per request the ceiling rises. (A retraction of 128 requests of
# 1,000 tokens recomputes 128,000 tokens of KV, a fraction of a second on a GPU, against this
# many steps of 2-30 ms: a few percent at most where the shortage lasts.)
CEILING_RESTORE_STEPS = 4096


class RunningCap:
    def __init__(
        self,
        configured: int,
        restore_steps: int = RESTORE_STEPS,
        ceiling_restore_steps: int = CEILING_RESTORE_STEPS,
    ):
        self.configured = configured
        self.restore_steps = restore_steps
        self.ceiling_restore_steps = ceiling_restore_steps
        self.ceiling = configured  # the most that may run now
        self._steps = 0  # decode steps completed since the cap last moved
        self._ceiling_steps = 0  # decode steps completed since the ceiling last moved

    def ran_out_of_memory(self, started: int, cap: int, decode_batch: int | None) -> int:
        """The new cap after the device ran out of memory with `started` requests (more than
        one) under `cap`: half of them, rounded up, and below the decode batch that failed.
        decode_batch: the requests of the decode step that failed (None: a prefill failed)."""
        if decode_batch is not None:
            self.ceiling = min(self.ceiling, max(1, decode_batch - 1))
        self._steps = self._ceiling_steps = 0
        return min(cap, (started + 1) // 2, self.ceiling)

    def decode_step_done(self, cap: int) -> int:
        """The cap after a decode step completed under `cap`."""
        if self.ceiling < self.configured:
            self._ceiling_steps += 1
            if self._ceiling_steps >= self.ceiling_restore_steps:
                self._ceiling_steps = 0
                self.ceiling += 1
        if cap >= self.ceiling:
            return cap
        self._steps += 1
        if self._steps < self.restore_steps:
            return cap
        self._steps = 0
        return cap + 1
