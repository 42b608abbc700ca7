"""Load-adaptive speculation: which tree shape each decode step drafts.

Speculation pays when the tokens a step emits per second of step time beat plain decoding's:
a wide tree wins at small batches (the target's weights are read once for many tokens) and
when the draft is accepted, and loses at large batches (verification turns compute-bound) or
when drafts are rejected. So every step picks one of a few tiers, plain decoding included:

    pick argmax over tiers t of  batch_size * accept_length[t] / step_seconds[t, batch bucket]

- step_seconds: measured on this device while serving (the launched step's device time),
  per tier and per power-of-two batch bucket, a moving average. The first step of a (tier,
  bucket) is not counted (it compiles kernels), nor is a step that captured a CUDA graph; a
  (tier, bucket) not yet measured is tried first, so the table fills itself within a few
  steps of each new load.
- accept_length: tokens emitted per request per step, observed per tier (a moving average;
  under simulated acceptance that is the forced one). Plain decoding's is 1.
- exploration: while a tier is not picked its acceptance is not observed, so every
  `explore_every` steps the speculative tier observed longest ago runs once; speculation
  therefore resumes (or widens) when the draft starts being accepted again.
A plain step still runs the draft over the one token it decodes, so the draft's KV and root
state stay exact and speculation can resume at any step.
"""

from __future__ import annotations

from specserve.speculative.tree import PLAIN, TreeShape

EMA = 0.2  # weight of the newest observation


def speculation_tiers(shape: TreeShape) -> list[TreeShape]:
    """Plain decoding, a short chain, and the configured shape (distinct, smallest first)."""
    chain_steps = min(shape.steps, 3)
    chain = TreeShape(chain_steps, 1, chain_steps + 1)
    tiers = [PLAIN]
    for t in (chain, shape):
        if t not in tiers and t.tokens <= shape.tokens:
            tiers.append(t)
    return tiers


def batch_bucket(batch_size: int) -> int:
    bucket = 1
    while bucket < batch_size:
        bucket *= 2
    return bucket


class AdaptiveSpeculation:
    def __init__(self, tiers: list[TreeShape], explore_every: int = 32):
        assert tiers[0] == PLAIN
        self.tiers = tiers
        self.explore_every = explore_every
        # the optimistic start: a tier accepts all it drafts until observed otherwise
        self.accept = [float(t.max_depth + 1) for t in tiers]
        self.seconds: dict[tuple[int, int], float] = {}
        self._warmed: set[tuple[int, int]] = set()  # (tier, bucket) whose first step ran
        self.picks = 0
        self.counts = [0] * len(tiers)  # steps run per tier (reporting)
        self.last_seen = [0] * len(tiers)  # the pick count when each tier last ran

    def pick(self, batch_size: int) -> int:
        self.picks += 1
        bucket = batch_bucket(batch_size)
        for t in range(len(self.tiers)):  # fill the table first
            if (t, bucket) not in self.seconds:
                return t
        scores = [
            batch_size * self.accept[t] / self.seconds[(t, bucket)] for t in range(len(self.tiers))
        ]
        best = max(range(len(self.tiers)), key=scores.__getitem__)
        if self.picks % self.explore_every == 0 and len(self.tiers) > 1:
            # the speculative tier observed longest ago, so its acceptance stays current
            others = [t for t in range(1, len(self.tiers)) if t != best]
            if others:
                return min(others, key=self.last_seen.__getitem__)
        return best

    def observe(self, tier: int, accept_lens: list[int], seconds: float | None) -> None:
        """A step of `tier` emitted accept_lens (per request) in `seconds` of device time."""
        self.counts[tier] += 1
        self.last_seen[tier] = self.picks
        if tier > 0 and accept_lens:
            mean = sum(accept_lens) / len(accept_lens)
            first = self.counts[tier] == 1  # the first observation replaces the prior
            self.accept[tier] = (
                mean if first else self.accept[tier] + EMA * (mean - self.accept[tier])
            )
        key = (tier, batch_bucket(len(accept_lens)))
        if key not in self._warmed:  # a first step compiles: its time says nothing
            self._warmed.add(key)
        elif seconds is not None and seconds > 0:
            old = self.seconds.get(key)
            self.seconds[key] = seconds if old is None else old + EMA * (seconds - old)

    def describe(self) -> dict:
        """What the policy has seen: steps run per tier, acceptance per tier, and step time
        in ms per tier and batch bucket."""
        return {
            "tiers": [str(t) for t in self.tiers],
            "steps": list(self.counts),
            "accept_length": [round(a, 3) for a in self.accept],
            "step_ms": {
                f"{self.tiers[t]}@{b}": round(s * 1e3, 3)
                for (t, b), s in sorted(self.seconds.items())
            },
        }
