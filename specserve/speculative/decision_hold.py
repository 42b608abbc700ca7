"""How long a tier the adaptive policy scored best serves before the tiers are scored again
(speculative/adaptive.py).

Where the host sets a step's pace, the policy's own work is the step's: SmolLM2 at batch 128
on an H100 served the 4/4/16 tree 8% slower than that tree configured alone, each step
spending 0.35 ms of its 4.4 ms of host time choosing (the pick 0.12 ms with its graph
lookups). So a choice holds for `DECIDE_EVERY` picks at its batch bucket, while the policy
still learns from every step. A step moving the held tier's acceptance by `HOLD_DRIFT` or
more ends the hold: the draft stopped (or started) being accepted. (Less is one step's
noise: the 4/4/16 tree's mean accept length over 128 requests moved by over 5% from one
step to the next in 40% of its steps there, by over 10% in 16%.) So does a tier's step time
at the bucket moving as much (the policy drops the hold), and a tier standing in for a best
one that has no graph yet is never held.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

DECIDE_EVERY = 4
HOLD_DRIFT = 0.15


class DecisionHold:
    def __init__(self, decide_every: int = DECIDE_EVERY):
        self.decide_every = max(1, decide_every)  # (1: score every pick)
        # (tier, batch bucket, picks left, a step's expected seconds, its acceptance then)
        self._held: tuple[int, int, int, float, float] | None = None

    def hold(self, tier: int, bucket: int, seconds: float, accept: float) -> None:
        """`tier`, just scored best at `bucket`, serves the next decide_every - 1 picks."""
        self._held = (tier, bucket, self.decide_every - 1, seconds, accept)

    def drop(self) -> None:
        self._held = None

    def next(
        self, bucket: int, accept: list[float], ready: AbstractSet[int] | None, exploring
    ) -> tuple[int, float] | None:
        """(the held tier, a step's expected seconds) if it serves this pick: one left, the
        same bucket, its acceptance `accept[tier]` within HOLD_DRIFT of what it was scored
        at, replayable (`ready`), and no exploration due (`exploring(seconds)`); else None,
        and the hold ends."""
        held, self._held = self._held, None
        if held is None:
            return None
        tier, at, left, seconds, scored = held
        if (
            left > 0
            and at == bucket
            and abs(accept[tier] - scored) < HOLD_DRIFT * scored
            and not exploring(seconds)
            and (ready is None or tier in ready)
        ):
            self._held = (tier, at, left - 1, seconds, scored)
            return tier, seconds
        return None
