"""The host's time per decode step, as load-adaptive speculation weighs it
(speculative/adaptive.py): a cost per step plus a cost per emitted token, per batch bucket.

What is measured: the host's own time around each step (its stop checks, detokenizing,
streaming and the next launch), as steps are served (completing finished requests
is set aside: each costs it once whatever the tier; runtime/host_clock.py). Under overlap
the host works while the device runs the next step, so a step lasts as long as the longer
of the two. The host's part has a cost per step and a cost per emitted token, and which
dominates depends on the load: SmolLM2 on an H200 at batch 16 took 1.65 ms a step after
steps of the 4/4/16 tree and of the 6/8/64 tree alike, which emits more; at batch 128, 8.1
us per token after steps of a chain of 3 (2.3 ms a step) and 8.4 after steps of the 4/4/16
tree (3.2 ms), which emits a third more. (Weighed per step alone, a wide tree looked free
wherever the host was slower than the device, and a chain dear; weighed per token alone,
the 6/8/64 tree ran a third of the steps at batch 16, 2.21 ms each against 1.77 for the
4/4/16 tree.) So each tier's host time is the median of its latest `HOST_WINDOW` steps at
the bucket (host time spikes: a collection, a burst of requests finishing; a spike says
nothing of the next steps), and a line through the tiers' (tokens, seconds) medians gives
both costs (`HOST_MIN_STEPS` steps make a tier's median; tiers emitting within
`HOST_SPREAD` of one another cannot tell the two costs apart; a tier not run within the
bucket's last `HOST_POINT_AGE` steps no longer counts, as the host's speed moves with the
machine's load). Until two tiers tell it, the host's time is taken as per token, the
median of the bucket's latest steps whatever their tier, so a tier run rarely is not
judged on the few intervals it happened to run in.
"""

from __future__ import annotations

import statistics
from collections import deque

EMA = 0.2  # weight of the newest step in the reported moving average
# A tier's host time per step, and the host's time per token before two tiers tell its per-step
# and per-token costs apart, is the median of this many of the latest steps. (SmolLM2 on an
# H200 at batch 128, with a moving average instead: each spike made wider tiers, whose device
# time then hid under the host's, look free for a few steps; the 6/8/64 tree's 16-node budget
# ran a fifth of the steps at 5.0 ms of wall time each, against 4.1 ms for the 4/4/16 tree,
# which emits about as much.)
HOST_WINDOW = 15
# A tier's median host time joins the line through the tiers' only after this many steps: an
# exploring step's one interval (a collection, a burst of arrivals in it) would tilt it.
HOST_MIN_STEPS = 3
# Tiers whose steps emit within this fraction of one another cannot tell a per-step cost from
# a per-token one (their host times differ by less than the noise between steps).
HOST_SPREAD = 0.15
# A tier's host time not renewed within the bucket's last this many steps is no longer weighed,
# and starts afresh when the tier runs again: the host's speed moves with the machine's load
# (about a second of SmolLM2 steps at batch 128 on an H200), and an old point beside a fresh
# one tilts the line (a host grown faster since made a rarely run wide tree look dear per
# token, so dear it was no longer explored, and its point never renewed).
HOST_POINT_AGE = 256


class HostCost:
    def __init__(self):
        # the host's time per step by (tier, bucket) (a moving average, reported); per bucket,
        # what steps are weighed by: (seconds per step, seconds per emitted token)
        self.mean: dict[tuple[int, int], float] = {}
        self.cost: dict[int, tuple[float, float]] = {}
        self._stale: set[int] = set()  # buckets whose cost awaits a refit
        self._per_token: dict[int, deque[float]] = {}  # bucket -> its latest steps'
        # bucket -> tier -> its latest steps' (tokens, host seconds); (tier, bucket) -> their
        # medians (taken when the line is next fitted, once per pick, not per observation)
        self._steps: dict[int, dict[int, deque[tuple[int, float]]]] = {}
        self._medians: dict[tuple[int, int], tuple[float, float]] = {}
        self._clock: dict[int, int] = {}
        self._seen: dict[tuple[int, int], int] = {}  # (tier, bucket) -> its last step

    def observe(self, tier: int, bucket: int, seconds: float, tokens: int) -> None:
        """A step of `tier` at `bucket` whose requests emitted `tokens` in all took the host
        `seconds`."""
        if seconds <= 0 or tokens <= 0:
            return
        key = (tier, bucket)
        old = self.mean.get(key)
        self.mean[key] = seconds if old is None else old + EMA * (seconds - old)
        per_token = self._per_token.setdefault(bucket, deque(maxlen=HOST_WINDOW))
        per_token.append(seconds / tokens)
        now = self._clock[bucket] = self._clock.get(bucket, 0) + 1
        steps = self._steps.setdefault(bucket, {}).setdefault(tier, deque(maxlen=HOST_WINDOW))
        if now - self._seen.get(key, now) > HOST_POINT_AGE:
            steps.clear()  # (stale: the tier starts afresh)
        self._seen[key] = now
        steps.append((tokens, seconds))
        self._medians.pop(key, None)
        self._stale.add(bucket)

    def cost_at(self, bucket: int) -> tuple[float, float]:
        """(seconds per step, seconds per emitted token) at `bucket`, fitted again if steps
        were observed there since it last was (once per pick, not once per observation: the
        medians cost more than the rest of an observation)."""
        if bucket in self._stale:
            self._stale.discard(bucket)
            self.cost[bucket] = self._fit(bucket)
        return self.cost.get(bucket, (0.0, 0.0))

    def _fit(self, bucket: int) -> tuple[float, float]:
        """The line through the tiers' median (tokens, seconds) per step, each weighing its
        steps, where they emit far enough apart to tell; else all per token."""
        now = self._clock[bucket]
        points = []  # (median tokens, median seconds, steps) of each tier timed lately
        for tier, steps in self._steps[bucket].items():
            key = (tier, bucket)
            if len(steps) < HOST_MIN_STEPS or now - self._seen[key] > HOST_POINT_AGE:
                continue
            if key not in self._medians:
                self._medians[key] = (
                    statistics.median(n for n, _ in steps),
                    statistics.median(s for _, s in steps),
                )
            points.append((*self._medians[key], len(steps)))
        per_token = statistics.median(self._per_token[bucket])
        if not points or max(p[0] for p in points) < (1 + HOST_SPREAD) * min(p[0] for p in points):
            return 0.0, per_token
        weight = sum(w for _, _, w in points)
        mean_n = sum(n * w for n, _, w in points) / weight
        mean_s = sum(s * w for _, s, w in points) / weight
        spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
        slope = sum(w * (n - mean_n) * (s - mean_s) for n, s, w in points) / spread
        if slope <= 0:  # (noise around a cost per step alone)
            return mean_s, 0.0
        if mean_s - slope * mean_n <= 0:  # (noise around a cost per token alone)
            return 0.0, mean_s / mean_n
        return mean_s - slope * mean_n, slope
