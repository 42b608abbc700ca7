"""Load-adaptive speculation: which tree shape each decode step drafts.

Speculation pays when the tokens a step emits per second of step time beat plain decoding's:
a wide tree wins at small batches (the target's weights are read once for many tokens) and
when the draft is accepted, and loses at large batches (verification turns compute-bound) or
when drafts are rejected. So every step picks one of a few tiers, plain decoding included:

    pick argmax over tiers t of  tokens[t] / max(step_seconds[t, bucket], host_seconds(tokens[t]))
    where tokens[t] = batch_size * accept_length[t] and
          host_seconds(n) = host_per_step[bucket] + host_per_token[bucket] * n
    (among the tiers scoring within EMIT_MORE_MARGIN of that where the host's time is close
    to the device's, the one emitting the most per step: it pays the per-step costs least
    often and leaves the shortest tail, which a step's score does not see; so also among
    ties, where the host sets the pace)

- host_seconds: the host's own time per step at the bucket (its stop checks, detokenizing,
  streaming and the next launch), measured as steps are served; under overlap the host works
  while the device runs the next step, so a step lasts as long as the longer of the two. It
  has a cost per step and a cost per emitted token, told apart as speculative/host_cost.py
  says.
- step_seconds: the device time of a step of tier t at a batch bucket, measured on this
  device when the engine starts (`prime`: every tier's CUDA graph at every bucket replayed on
  padding rows, so every tier is timed alike, and serving does not stop to capture and time
  every tier at a bucket it meets first), then as steps are served (a moving average of the
  launched steps' own time). Padding rows have no context to attend to: what served steps
  take beyond their replay is added to the replay of tiers not served yet. Without CUDA
  graphs a (tier, bucket) not yet timed is tried first (its first step, which compiles, is
  not counted; a replayed graph was compiled when timed, so its first served step counts).
- accept_length: tokens emitted per speculating request per step, an estimate per tier that
  weighs recent requests most, starts optimistic, learns the chains from deeper trees' steps
  too, and is carried to the text served now by how the chains' acceptance moved since
  (speculative/acceptance.py).
- a ragged tier whose step takes at least the device time of verifying its whole tree at the
  bucket never runs: it verifies a subset of that tree's nodes, so it cannot emit more.
  (SmolLM2-135M on an H200 at batch 1: the 6/8/64 tree's ragged budgets cost 1.78 ms a step
  against 1.51 ms whole, and their estimates, learnt on earlier text, kept them running.)
- exploration: a tier not picked is not observed, so every `explore_every` steps another
  tier runs once (among those that would beat the best if they accepted all they draft, but
  not a chain learnt within the last `explore_every` steps, the one scoring highest now: the
  likeliest to win; or one not run for `max_explore_gap` steps, whose estimate may be long
  stale), while some request can still speculate; speculation thus
  resumes, or widens, when the draft starts being accepted again. An exploration that finds
  nothing better doubles the wait for the next one (up to `max_explore_gap` steps), so a
  steady state costs less and less, unless it raised the tier's estimate (`RISING`: learnt
  on other text, it may yet win); when the best tier changes (then the first look comes
  within a few picks: `FIRST_LOOK`), or a batch's worth of new requests has arrived, the
  pace starts over. Whatever the pace, explorations take at most
  `EXPLORE_BUDGET` of the time: an exploring step's cost is its own time less what the best
  tier would take to emit what it is expected to emit, and an exploration runs only once the
  steps served since the last one (their expected time) make its cost the budget's share. (The 8B shape at batch 128
  with every draft rejected: a step of the 5/4/16 tree took about three plain steps' time,
  and exploring it at the starting pace after each batch's arrival cost 5% against plain
  decoding on an H100.) Where the tiers cost about the same, the pace alone decides.
- captures: under CUDA graphs a step replays the graph of its shape (batch bucket, context
  width, tier), or a larger shape's graph of its tier covering it; a shape nothing covers
  runs eagerly (slower steps) for a few steps, then is captured, which stalls the loop
  (runtime/cuda_graphs.py). Every tier is captured at every batch bucket at the shortest
  width when the engine starts (`prime`), and an idle engine captures the tiers run at a
  batch bucket at the other widths met there. Exploration runs only
  tiers replayable at the step's shape (accept lengths are learnt at any shape), and the
  best tier is swapped for a replayable one scoring within `CAPTURE_MARGIN` of it. As
  contexts grow a batch meets a new width every few steps, at each batch bucket its tail
  shrinks through: capturing every tier there stalls the loop for longer than the few
  steps at that width can win back.
A plain step skips the draft: the target's features and the emitted token are kept in a
per-request ring, and the next speculative step first runs the draft over them in one pass
(a catch-up), so its KV and root state are exactly what drafting every step would give. A
request whose ring fills while speculation does not pay stops speculating (it is decoded
plainly to its end and never pays for the draft again); see runtime/draft_lag.py.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet

from specserve.config.speculative import small_tree
from specserve.speculative.acceptance import AcceptanceEstimates, reference_chains
from specserve.speculative.decision_hold import DECIDE_EVERY, HOLD_DRIFT, DecisionHold
from specserve.speculative.host_cost import HostCost
from specserve.speculative.tree import PLAIN, TreeShape

EMA = 0.2  # weight of the newest step time
# A tier with no CUDA graph that can run the step's shape (its own or a covering one) is run
# instead of one that has only if it scores this much better. Its steps run eagerly (slower)
# until it is captured, and a capture stalls every request for 10-50 steps' time (on an H200:
# 0.08-0.1 s for SmolLM2 against 2-5 ms steps; 0.05-0.26 s at the 8B shape against 5-30 ms),
# and until a shape has served LONG_LIVED_SHAPE_STEPS (64) steps in a row
# (runtime/cuda_graphs.py: then any tier may capture there) a tier this much better wins
# back at most 13 steps. (At 0.03, an emulation of the bench's runs at batch 16-128 captured
# one to two graphs per run to the end; at 0.2, 18-25% more tokens per second.)
CAPTURE_MARGIN = 0.2
# An exploration that raised the explored tier's score by this factor or more does not slow
# the pace of explorations. (SmolLM2 on an H200 at batch 16, after batch 1: the 4/4/16
# tree's acceptance, learnt on one request's text, was 2.4 against 3.0 on the batch's; one
# exploration every 32 to 64 steps left the 6/8/64 tree serving, 8% slower.)
RISING = 1.05
# Scores within this fraction of one another are even (`_even`).
SCORE_TIE = 1e-9
# A tier emitting more a step is preferred to one scoring at most this fraction more: a
# step's score (the longer of its device and host time) misses what favours fewer, larger
# steps. SmolLM2 on an H100, the policy's trace at batch 64 and 128: where host and device
# times were close a step took longer than the longer of the two (a chain of 3 at 128: 2.27
# ms from launch to launch, modelled 1.90), a batch ends in fewer steps the more each emits,
# and a batch served by the 4/4/16 tree alone ran 4% faster than by the chain of 3 alone at
# 64, where the chain scored within 4% of the tree at 28% of the policy's picks.
EMIT_MORE_MARGIN = 0.04
# ... where the leading tier's host time is at least this share of its device time: only
# there does a step take longer than the longer of the two. (Elsewhere the margin only
# costs: in the policy's simulation of static batches of 16, where the host's time is half
# the device's, the 6/8/64 tree emitting more served within 4% of the 4/4/16 tree: 0.979 of
# the best fixed tier, 0.992 with this, ten seeds.)
HOST_CLOSE = 0.8
# The most of the decode time explorations may cost (see the module's docstring).
EXPLORE_BUDGET = 0.01
# A change of the best tier brings the next exploration this share of `explore_every` picks on
# (4 by default; still within the budget).
# (SmolLM2 at batch 16 on an H100: one step of 16 requests took the 4/4/16 tree's estimate
# from 2.39 to 2.18 against 2.95 served, the 6/8/64 tree and the chain of 3 served the next
# 45 steps, 13-17% slower, until the exploration due 32 picks on looked at it again: 0.95 of
# the best fixed tier there, 1.00 with this; in a simulation of those steps, the worst of ten
# seeds 0.95 against 0.97.)
FIRST_LOOK = 1 / 8


def speculation_tiers(shape: TreeShape) -> list[TreeShape]:
    """Plain decoding, chains of 1 to 3 steps, a small tree (at most 4 steps of topk 4, 16
    nodes), the configured tree verifying a quarter and a half of its nodes per request on
    average (ragged: each request as many as they are worth), and the whole configured tree
    (distinct, smallest first).
    - Every chain length is a tier because a step drafting deeper than its requests accept
      pays for draft steps and verified tokens that emit nothing, which costs most where
      speculation is marginal: at large batches, where verification is compute-bound.
    - The small tree because drafting a wide tree costs steps x topk frontier nodes per
      request whatever part of it is verified: at large batches a ragged budget on the
      configured tree still pays for all of its drafting. (SmolLM2-135M with its 6/8/64
      draft on an H200: a fixed 4/4/16 tree beat the 6/8/64 one from batch 16 on.)"""
    chains = [TreeShape(d, 1, d + 1) for d in range(1, min(shape.steps, 3) + 1)]
    small = small_tree(shape.steps, shape.topk, shape.tokens)
    smaller = [TreeShape(*small)] if small is not None else []
    budgets = []
    if shape.topk > 1:  # a chain has no nodes worth less than others
        budgets = [
            TreeShape(shape.steps, shape.topk, shape.tokens, v)
            for v in (shape.tokens // 4, shape.tokens // 2)
            if 2 <= v < shape.tokens
        ]
    tiers = [PLAIN]
    for t in (*chains, *smaller, *budgets, shape):
        if t not in tiers and t.tokens <= shape.tokens:
            tiers.append(t)
    return tiers


def _even(a: float, b: float) -> bool:
    """Scores equal but for rounding: host-bound tiers all score 1 / (host seconds per
    token), computed through their own token counts. (Compared exactly, the rounding broke
    the tie: SmolLM2 at batch 64 on an H100 alternated between chains of 2 and 3, and a tree
    bound by the host like them was never explored, its upper score a rounding below.)"""
    return abs(a - b) <= SCORE_TIE * max(abs(a), abs(b))


def _ahead(score: float, accept: float, other_score: float, other_accept: float) -> bool:
    """Whether (score, accept) beats (other_score, other_accept): the tier emitting more a
    step unless it scores EMIT_MORE_MARGIN less than the other (so among even scores, where
    the host sets the pace, always), else the higher score."""
    if accept > other_accept:
        return score >= (1.0 - EMIT_MORE_MARGIN) * other_score
    if accept < other_accept:
        return (1.0 - EMIT_MORE_MARGIN) * score > other_score
    return score > other_score and not _even(score, other_score)


def batch_bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size` (1 for an empty batch)."""
    return 1 << max(0, batch_size - 1).bit_length()


class AdaptiveSpeculation:
    def __init__(
        self,
        tiers: list[TreeShape],
        measure: Callable[[int, int], float | None] | None = None,
        explore_every: int = 32,
        max_explore_gap: int = 1024,
        decide_every: int = DECIDE_EVERY,
    ):
        """measure(batch_size, tier): the device seconds of one such step, or None when it
        cannot be measured apart from serving (then launched steps are timed instead).
        decide_every: picks per scoring while a choice holds (speculative/decision_hold.py)."""
        assert tiers[0] == PLAIN
        self.tiers = tiers
        # ragged tiers -> the tier verifying their whole drafted tree
        self.whole_tree = {
            t: tiers.index(shape.drafted)
            for t, shape in enumerate(tiers)
            if shape.ragged and shape.drafted in tiers
        }
        # per tier: the chains (other than itself; as (tier, depth)) whose acceptance its
        # steps report, those no deeper than its tree (deeper ones could have gone on where
        # its tree ended)
        self._chains_within = [
            [
                (c, chain.max_depth)
                for c, chain in enumerate(tiers)
                if c != t and chain.topk == 1 and chain.tokens > 1 and not chain.ragged
                and chain.max_depth <= shape.max_depth
            ]
            for t, shape in enumerate(tiers)
        ]  # fmt: skip
        # what each tier emits per request were all its drafted tokens accepted
        self._upper_accept = [float(t.max_depth + 1) for t in tiers]
        self._ragged = [t.ragged for t in tiers]
        self.measure = measure
        self.explore_every = explore_every
        self.max_explore_gap = max_explore_gap
        self.hold = DecisionHold(decide_every)  # (a scored choice serves a few picks)
        self.explore_gap = explore_every
        self.first_look = max(1, round(explore_every * FIRST_LOOK))
        self.next_explore = explore_every
        # the optimistic start: a tier accepts all it drafts until observed otherwise
        self.acceptance = AcceptanceEstimates(self._upper_accept, reference_chains(tiers))
        self.accept = self.acceptance.mean  # (per tier; the estimates update it in place)
        self.replayed: dict[tuple[int, int], float] = {}  # (tier, bucket): a replay's time
        self.observed: dict[tuple[int, int], float] = {}  # (tier, bucket): steps served
        # per bucket: what served steps take beyond their replay (attention over real
        # contexts, which padding rows do not have), carried over to tiers not yet served
        self.context_cost: dict[int, float] = {}
        self.host = HostCost()  # the host's time per step and per token, per bucket
        self._warmed: set[tuple[int, int]] = set()  # (tier, bucket) whose first step ran
        self._timed_buckets: set[int] = set()  # buckets where every tier has a time
        self.picks = 0
        self.counts = [0] * len(tiers)  # steps run per tier (reporting)
        self.last_seen = [0] * len(tiers)  # the pick count when each tier last ran
        # the pick count when each chain's acceptance was last learnt from a deeper tree's step
        self.inferred = [-explore_every] * len(tiers)
        self._explored: int | None = None  # the tier of an exploring step in flight
        # expected seconds of the steps served since the last exploration, and what the due
        # exploration needs of them (EXPLORE_BUDGET)
        self._served_since = 0.0
        self._budget_needed = (0.0, 0)  # (seconds, at this batch bucket)
        self._explored_score = 0.0  # its score when it was picked
        self._best = 0  # the tier the last pick found best
        self._batch = 1  # the last pick's batch size
        self._arrived = 0  # requests that started decoding since the pace last started over
        self._new_text = False  # a batch's worth arrived since the last exploration

    def seconds(self, tier: int, bucket: int) -> float | None:
        """The expected device time of a step of `tier` at `bucket`."""
        key = (tier, bucket)
        if key in self.observed:
            return self.observed[key]
        if key in self.replayed:
            # (served steps faster than their replay say that replay was pessimistic, not
            # that other tiers' attention is free: only a positive excess carries over)
            return self.replayed[key] + max(0.0, self.context_cost.get(bucket, 0.0))
        return None

    def _seconds_at(self, bucket: int) -> list[float | None]:
        """`seconds(t, bucket)` of every tier t."""
        observed, replayed = self.observed, self.replayed
        extra = max(0.0, self.context_cost.get(bucket, 0.0))
        out = []
        for t in range(len(self.tiers)):
            key = (t, bucket)
            seconds = observed.get(key)
            if seconds is None:
                replay = replayed.get(key)
                seconds = None if replay is None else replay + extra
            out.append(seconds)
        return out

    def prime(self, max_batch_size: int) -> int:
        """Time every tier at every bucket up to `max_batch_size` now (engine start): capturing
        a tier's graph compiles its kernels for that batch shape, which would otherwise stall
        the first step served at that bucket for every tier at once. Returns how many
        (tier, bucket) were timed; buckets that cannot be replayed (past the graphs' largest
        batch) are left to serving. The largest bucket first: smaller captures reuse its
        memory in the graphs' shared pool (runtime/cuda_graphs.py, `capture_at_start`)."""
        buckets = [1]
        while buckets[-1] < batch_bucket(max_batch_size):
            buckets.append(buckets[-1] * 2)
        timed = 0
        for bucket in reversed(buckets):
            self._fill(bucket)
            timed += sum(1 for t, b in self.replayed if b == bucket)
        return timed

    def _fill(self, bucket: int) -> int | None:
        """Time every tier at this bucket; returns a tier to try online when it cannot."""
        if bucket in self._timed_buckets:
            return None  # (a time once known is never forgotten)
        for t in range(len(self.tiers)):
            if self.seconds(t, bucket) is not None:
                continue
            replay = self.measure(bucket, t) if self.measure is not None else None
            if replay is None:
                return t
            self.replayed[(t, bucket)] = replay
        self._timed_buckets.add(bucket)
        return None

    def _scores(
        self, batch_size: int, accept: list[float] | None = None, dominated: bool = True
    ) -> list[float]:
        """Tokens per second of each tier at this load: what its steps emit in their device
        time or the host's time for them, whichever is longer. A ragged tier whose device
        time is at least its whole tree's scores 0 (unless `dominated` is False): it verifies
        a subset of that tree's nodes, so it never emits more (its own estimate, learnt on
        other text than the served tier's, could say otherwise)."""
        bucket = batch_bucket(batch_size)
        seconds = self._seconds_at(bucket)
        per_step, per_token = self.host.cost_at(bucket)
        scores = []
        for a, device in zip(accept or self.accept, seconds):
            tokens = batch_size * a
            scores.append(tokens / max(device, per_step + per_token * tokens))
        for t, whole in self.whole_tree.items() if dominated else ():
            if seconds[t] >= seconds[whole]:
                scores[t] = 0.0
        return scores

    def _best_of(self, tiers, scores: list[float], batch_size: int) -> int:
        """Among the tiers scoring within EMIT_MORE_MARGIN of the highest score (where the
        host's time is close to the device's, else even with it), the one emitting the most
        per step, then the highest scoring, then among even scores (the host sets the pace)
        the one of least device time. (Measured from the highest score, not tier by tier, so
        that a run of near scores does not drift below the margin.)"""
        tiers = list(tiers)
        if not tiers:
            raise ValueError("no tier to choose from")
        accept = self.accept
        leader = max(tiers, key=lambda t: scores[t])
        top = scores[leader]
        margin = EMIT_MORE_MARGIN if self._host_close(leader, batch_size) else 0.0
        near = [t for t in tiers if scores[t] >= (1.0 - margin) * top or _even(scores[t], top)]
        most = max(accept[t] for t in near)
        best = max((t for t in near if accept[t] == most), key=lambda t: scores[t])
        even = [t for t in near if accept[t] == most and _even(scores[t], scores[best])]
        if len(even) > 1:  # (a tie: only then the device times)
            seconds = self._seconds_at(batch_bucket(batch_size))
            best = min(even, key=lambda t: (float("inf") if seconds[t] is None else seconds[t], t))
        return best

    def _host_close(self, tier: int, batch_size: int) -> bool:
        """Whether the host's time for a step of `tier` is at least HOST_CLOSE of its device
        time: where EMIT_MORE_MARGIN applies (see there)."""
        device = self.seconds(tier, batch_bucket(batch_size))
        return device is None or self._host_seconds(tier, batch_size) >= HOST_CLOSE * device

    def _host_seconds(self, tier: int, batch_size: int) -> float:
        """The host's expected time for a step of `tier`: its cost per step and per token
        for the tokens the tier is expected to emit."""
        per_step, per_token = self.host.cost_at(batch_bucket(batch_size))
        return per_step + per_token * batch_size * self.accept[tier]

    def _upper_scores(self, batch_size: int) -> list[float]:
        """Each tier's score were all its drafted tokens accepted."""
        return self._scores(batch_size, self._upper_accept)

    def pick(
        self, batch_size: int, can_speculate: bool = True, ready: AbstractSet[int] | None = None
    ) -> int:
        """The tier of the next step of `batch_size` requests; can_speculate: some of them
        may still draft (else plain decoding, the only tier that helps them); ready: the
        tiers a graph can run at this step's shape without a capture (None: every tier starts
        alike)."""
        if not can_speculate:
            return 0
        self.picks += 1
        self._batch = batch_size
        held = self.hold.next(batch_bucket(batch_size), self.accept, ready, self._exploring)
        if held is not None:
            self._served_since += held[1]
            return held[0]
        untimed = self._fill(batch_bucket(batch_size))
        if untimed is not None:
            return untimed
        scores = self._scores(batch_size)
        best = self._best_of(range(len(self.tiers)), scores, batch_size)
        if best != self._best:
            # the load or the acceptance moved: look around at the first pace again, the
            # first look within a few picks (the tier just demoted is no longer observed: one
            # unlucky step would otherwise leave its estimate low until that look)
            self.explore_gap = self.explore_every
            self.next_explore = min(self.next_explore, self.picks + self.first_look)
            self._best = best
        served = self._served(batch_size, best, scores, ready)
        wall = self._step_wall(served, batch_size)
        self._served_since += wall
        needed, at_bucket = self._budget_needed  # (at another bucket: weighed afresh)
        if self.picks >= self.next_explore and (
            self._served_since >= needed or at_bucket != batch_bucket(batch_size)
        ):
            new_text = self._new_text
            # among the tiers that could beat the best one if they accepted all they draft
            # (a wide tree at a large batch never can) and are replayable at this shape, the
            # one scoring highest now (the likeliest to win; unless one has not run for
            # max_explore_gap steps: then the one observed longest ago). New text may
            # capture one only where none of them is replayable (where one is, exploring it
            # tries the new requests at no capture's cost) and the step would decode
            # plainly (else the new requests speculate)
            upper = self._upper_scores(batch_size)
            # (a chain whose acceptance recent steps of a deeper tree told has nothing to show;
            # where the host sets the pace, a tier could win the tie by emitting more a step)
            could = [
                t
                for t in range(1, len(self.tiers))
                if t not in (best, served)  # (the served tier shows nothing new)
                and _ahead(upper[t], self._upper_accept[t], scores[best], self.accept[best])
                and self.picks - self.inferred[t] > self.explore_every
            ]
            hopeful = [t for t in could if ready is None or t in ready]
            if not hopeful and new_text and served == 0:
                hopeful = could
            explored = min(hopeful, key=self._exploring_order(scores)) if hopeful else None
            if explored is not None:
                cost = self._exploring_cost(batch_size, explored, served)
                if self._served_since < cost / EXPLORE_BUDGET:
                    # (due once that is served)
                    self._budget_needed = (cost / EXPLORE_BUDGET, batch_bucket(batch_size))
                    self._hold(served, best, batch_size, wall)
                    return served
            self.next_explore = self.picks + self.explore_gap
            self._new_text = False  # (used here, or not at all)
            if explored is not None:
                self._served_since, self._budget_needed = 0.0, (0.0, 0)
                self._explored, self._explored_score = explored, scores[explored]
                return explored
        self._hold(served, best, batch_size, wall)
        return served

    def _hold(self, served: int, best: int, batch_size: int, wall: float) -> None:
        """Let the tier just scored best serve the next picks unscored; not a stand-in for
        it (`_served`: once the best one is replayable it runs)."""
        if served == best:
            self.hold.hold(served, batch_bucket(batch_size), wall, self.accept[served])

    def _exploring(self, wall: float) -> bool:
        """Whether a pick serving a step of `wall` seconds would explore (as `pick` decides)."""
        needed, at_bucket = self._budget_needed
        due = self._served_since + wall >= needed or at_bucket != batch_bucket(self._batch)
        return self.picks >= self.next_explore and due

    def _exploring_order(self, scores: list[float]):
        """Sort key of the tiers to explore: first any not run for max_explore_gap picks
        (their estimates may be long stale), the longest ago first; then the highest
        scoring. (By age alone, SmolLM2 at batch 64 on an H100: the 4/4/16 tree, learnt on
        a batch's first two steps at 2.2-2.5 tokens against 3.1 later, waited 165 steps
        behind three wide ragged tiers scoring 14-35% less than it, while a chain served
        10% below it.)"""

        def key(t: int):
            stale = self.picks - self.last_seen[t] > self.max_explore_gap
            return (not stale, self.last_seen[t] if stale else 0, -scores[t], self.last_seen[t])

        return key

    def _step_wall(self, tier: int, batch_size: int) -> float:
        """A step's expected seconds: the longer of its device time and the host's for the
        tokens it is expected to emit (also for a dominated ragged tier, which scores 0)."""
        device = self.seconds(tier, batch_bucket(batch_size))
        return max(device or 0.0, self._host_seconds(tier, batch_size))

    def _exploring_cost(self, batch_size: int, explored: int, served: int) -> float:
        """Seconds a step of `explored` takes beyond the served tier's time for the tokens it
        is expected to emit (it runs once served steps worth this / EXPLORE_BUDGET seconds
        have run since the last exploration)."""
        served_per_token = self._step_wall(served, batch_size) / (batch_size * self.accept[served])
        tokens = batch_size * self.accept[explored]
        return max(0.0, self._step_wall(explored, batch_size) - tokens * served_per_token)

    def _served(self, batch_size: int, best: int, scores: list[float], ready) -> int:
        """The tier a step runs when not exploring: the best one, or where no graph runs it at
        the step's shape, the best replayable one scoring within CAPTURE_MARGIN of it."""
        if ready is not None and best not in ready and (candidates := list(ready)):
            # (a ragged tier stands in for its unreplayable whole tree on its own score: close
            # enough, it saves the capture)
            own = self._scores(batch_size, dominated=False)
            near = self._best_of(candidates, own, batch_size)
            if own[near] >= (1.0 - CAPTURE_MARGIN) * scores[best]:
                return near
        return best

    def arrived(self, count: int = 1) -> None:
        """`count` requests started decoding. Once as many have arrived as a step holds, the
        batch is other text than the one the explorations found nothing for: they start
        over at the first pace, and the next one may run a tier no graph runs at the step's
        shape where none worth exploring is and the step would decode plainly (one capture
        per batch of new requests, at most). Else new requests, after a stretch that
        drafts could not help, would decode plainly until their drafts fell too far behind
        to catch up (runtime/draft_lag.py), never tried. Where such a tier is captured,
        exploring it tries them without a capture (one per batch of new requests stalled
        every batch's first steps), and where a speculative tier is the best they are tried
        already: a capture there stalled a SmolLM2 batch of 128's tail on an H200 for
        0.27 s, as long as the rest of its decode."""
        self._arrived += count
        if self._arrived >= self._batch:
            self._arrived, self._new_text = 0, True
            self.hold.drop()
            self.explore_gap = self.explore_every
            self.next_explore = min(self.next_explore, self.picks + self.explore_gap)

    def speculation_pays(self, batch_size: int) -> bool:
        """Whether, by what was observed so far, a speculative tier is the best at this load
        (what decides if lagging drafts are caught up or let go)."""
        if self._fill(batch_bucket(batch_size)) is not None:
            return True  # not timed yet: keep the draft until it is
        return self._best_of(range(len(self.tiers)), self._scores(batch_size), batch_size) != 0

    def observe(
        self,
        tier: int,
        batch_size: int,
        accept_lens: list[int],
        seconds: float | None,
        chain_reach: list[int] | None = None,
    ) -> None:
        """A step of `tier` over `batch_size` requests emitted accept_lens (per speculating
        request) in `seconds` of device time (None: not a time of this tier alone, e.g. it
        also caught up, or captured its graph). chain_reach: per speculating request, how
        many of its accepted draft tokens lie on the draft's greedy chain
        (`tree.greedy_chain_reach`), which says what each chain no deeper than this tier's
        tree would have accepted."""
        self.counts[tier] += 1
        self.last_seen[tier] = self.picks
        acceptance = self.acceptance
        acceptance.served(len(accept_lens))  # (requests that do not speculate say nothing)
        if tier > 0 and accept_lens:
            # (a ragged step may have pruned the chain's nodes: its reach is no measure)
            reach = chain_reach if chain_reach and not self._ragged[tier] else None
            chains = self._chains_within[tier] if reach else []
            acceptance.learn(tier, sum(accept_lens), len(accept_lens), reach, chains)
            for c, _ in chains:
                self.inferred[c] = self.picks
        bucket = batch_bucket(batch_size)
        if tier == self._explored:
            self._explored = None
            scores = self._scores(batch_size) if self._fill(bucket) is None else None
            if (
                scores is not None
                and self._best_of(range(len(scores)), scores, batch_size) != tier
                and scores[tier] < RISING * self._explored_score
            ):
                # a vain exploration: look again twice as late (what it costs shrinks away).
                # One that raised the tier's estimate found it underrated (learnt on other
                # text): it is looked at again at the same pace, until it wins or stops rising
                self.explore_gap = min(2 * self.explore_gap, self.max_explore_gap)
        key = (tier, bucket)
        if key not in self._warmed and key not in self.replayed:
            # an eager first step compiles: its time says nothing (a replayed graph was
            # compiled when it was timed, so its first served step counts)
            self._warmed.add(key)
            return
        if seconds is None or seconds <= 0:
            return
        before = self.seconds(tier, bucket)
        old = self.observed.get(key)
        self.observed[key] = seconds if old is None else old + EMA * (seconds - old)
        if before and abs(self.observed[key] - before) >= HOLD_DRIFT * before:
            self.hold.drop()  # (a step time that moved may change the choice, e.g. dominance)
        if key in self.replayed:
            extra = self.observed[key] - self.replayed[key]
            prev = self.context_cost.get(bucket)
            self.context_cost[bucket] = extra if prev is None else prev + EMA * (extra - prev)

    def observe_host(self, tier: int, batch_size: int, seconds: float, tokens: int) -> None:
        """The host's own time around a step of `tier` over `batch_size` requests that emitted
        `tokens` tokens in all (applying its results and launching the next), measured while
        steps overlapped."""
        self.host.observe(tier, batch_bucket(batch_size), seconds, tokens)

    def describe(self) -> dict:
        """What the policy has seen: steps run per tier, acceptance per tier, and step time
        in ms per tier and batch bucket (the device's, and the host's where measured: a
        moving average per tier), and the host's time per step and per emitted token that
        tiers were last weighed by (per bucket, in microseconds). Read from other threads
        (`Engine.stats`) while the loop's thread updates the policy: every dict is copied
        whole first (one step under the GIL, where iterating it is not), and nothing is
        refitted here."""
        host_mean, host_cost = dict(self.host.mean), dict(self.host.cost)
        return {
            "tiers": [str(t) for t in self.tiers],
            "steps": list(self.counts),
            "accept_length": [round(a, 3) for a in self.accept],
            "step_ms": {
                f"{self.tiers[t]}@{b}": round(self.seconds(t, b) * 1e3, 3)
                for t, b in sorted(set(self.replayed) | set(self.observed))
            },
            "host_ms": {
                f"{self.tiers[t]}@{b}": round(v * 1e3, 3) for (t, b), v in host_mean.items()
            },
            "host_us_per_step_and_token": {
                b: [round(v * 1e6, 3) for v in cost] for b, cost in sorted(host_cost.items())
            },
        }
