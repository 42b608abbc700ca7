"""What a tier of load-adaptive speculation emits per speculating request per step (its
accept length), as speculative/adaptive.py weighs it; under simulated acceptance, the forced
one.

Each tier's estimate is a mean over the speculating requests observed, each weighing
`ACCEPT_DECAY` less for every speculating request served since, at any tier (requests with
speculation off neither report nor age the estimates).
- A step of 128 speculating requests, whose mean is precise, mostly replaces it; but an
  estimate never weighs more than `ACCEPT_MAX_WEIGHT` requests (what single requests build
  up), since that precise mean is of its own text only.
- At batch 1 an estimate spans about 50 steps. One request's accept length varies from step
  to step by more than the tiers differ. An estimate moved 20% by each single step locked the
  worse tier in for long runs: in simulation, 0.69 of the best fixed tier's tokens/s on
  bursty text, against 0.95 now
  (`test_one_requests_noisy_accept_lengths_do_not_lock_the_policy_out_of_the_best_tier`).
- A tier explored rarely is judged on what it does now: its old requests have decayed, down
  to `ACCEPT_MIN_WEIGHT` requests' worth, so that at batch 1 one exploring step (one
  request's accept length, which varies more than the tiers differ) does not alone decide
  the tier: in simulation that took the policy from 0.93 to 0.99 of the best fixed tier.
- It starts optimistic (all drafted tokens accepted, weighing `ACCEPT_PRIOR_WEIGHT`
  requests), so speculation is tried before it is judged.
- A chain is also learnt from the steps of every tier at least as deep that is not ragged:
  a step reports how many of each request's accepted tokens lie on the draft's greedy chain,
  which every tree keeps (`tree.greedy_chain_reach`), and a chain of depth d would have
  accepted 1 + min(d, that) there. Such chains need no exploring (on an H200 at batch 1,
  SmolLM2's chain of 3 explored from its 6/8/64 tree emits about half the tree's tokens in
  0.8 of its time).
- Estimates are carried to the text served now (`mean`, what the policy weighs): the text's
  difficulty moves every tier alike, and the short chains (the references) are learnt on
  every speculative step at least as deep that is not ragged. Each tier keeps, beside what
  it was seen to emit (`learnt`), what each reference emitted over the same requests (where
  its steps tell: a ragged step's do not, nor a shallower chain's); its estimate is its
  tokens beyond the root scaled by how those of the reference learnt last (the deepest
  such: it moves most with the text) moved since, unless it was learnt with it or since, or
  is much deeper than it (`CARRY_MAX_DEPTH_RATIO`). (SmolLM2 on an H100 at batch
  64 and 128: the 4/4/16 tree, learnt on a batch's tail of slow requests at 2.70 tokens,
  emitted 3.17 on the next batch, and a chain of 3 served instead, 4% slower.)
"""

from __future__ import annotations

from collections import Counter

from specserve.speculative.tree import TreeShape

ACCEPT_DECAY = 0.02  # how much less an accept length weighs per request observed after it
ACCEPT_MIN_WEIGHT = 8.0  # the least weight decay leaves a tier's observed acceptance
# The most weight a tier's observed acceptance carries: what a stream of single requests
# builds up under ACCEPT_DECAY. A large batch's step measures its mean precisely, but only for
# its own text: after a long stretch of rejected drafts at batch 128 a tree's estimate weighed
# 136 requests, and at batch 1 a request whose drafts were accepted moved it 3% per
# exploration, too little to keep the exploring pace (adaptive.py's RISING), so the draft was found only
# after hundreds of steps.
ACCEPT_MAX_WEIGHT = 1.0 / ACCEPT_DECAY
ACCEPT_PRIOR_WEIGHT = 0.1  # the optimistic start counts as this many requests
# Below this many tokens beyond the root a request, a reference's acceptance when a tier was
# learnt is too little to scale by (its drafts were all but rejected then): the tier's
# estimate is what it was seen to do.
CARRY_MIN_SIGNAL = 0.05
# The most a tier's estimate (its tokens beyond the root) is scaled up, or down, by how the
# reference moved: one step of a few requests moves the reference a lot.
CARRY_MAX_FACTOR = 2.0
# A tier deeper than this many times the reference is not carried: its acceptance, compounded
# over more draft steps, moves with the text more than in proportion to a short chain's. (In
# the policy's simulation the 6/8/64 tree, 6 deep, carried by the chain of 3 stayed
# overrated in static batches' tails: static batches of 16 ran 0.966 of the best fixed tier,
# 0.981 with this; twenty seeds.)
CARRY_MAX_DEPTH_RATIO = 1.5
# The deepest chain the text's difficulty is read from: adaptive.py's own chains go this deep
# (the deeper the chain the more its acceptance moves with the text: a chain of 1 sees the
# first draft token only).
REFERENCE_MAX_DEPTH = 3


def reference_chains(tiers: list[TreeShape]) -> dict[int, int]:
    """The tiers the text's difficulty is read from (`AcceptanceEstimates`), and their
    depths: the chains of at most REFERENCE_MAX_DEPTH steps, each learnt on its own steps and
    on every deeper tier's that is not ragged."""
    return {
        t: s.max_depth for t, s in enumerate(tiers)
        if s.topk == 1 and s.tokens > 1 and not s.ragged and s.max_depth <= REFERENCE_MAX_DEPTH
    }  # fmt: skip


class AcceptanceEstimates:
    def __init__(self, upper: list[float], references: dict[int, int] | None = None):
        """upper: what each tier emits per request were all its drafted tokens accepted (the
        optimistic start; a tier's depth is one less); references: the chain tiers the text's
        difficulty is read from, and their depths (none: estimates are not carried)."""
        self.upper = list(upper)
        self.references = dict(references or {})  # tier: depth
        self.learnt = list(upper)  # per tier: what its steps emitted (a decayed mean)
        self.mean = list(upper)  # per tier: that, carried to the text now (updated in place)
        # per reference, per tier: what the reference emitted over the requests `learnt` is
        # the mean of (None: not known)
        self.reference_then: dict[int, list[float | None]] = {
            r: [None] * len(upper) for r in self.references
        }
        self.weight = [ACCEPT_PRIOR_WEIGHT] * len(upper)  # requests' worth behind learnt
        self.requests_seen = 0  # speculating requests over every step observed (the clock)
        self._clock = [0] * len(upper)  # requests_seen at each tier's last observation
        self._learnt_at = [-1] * len(upper)  # the step count at each tier's last learning
        self._steps = 0

    def served(self, requests: int) -> None:
        """A step served `requests` speculating requests, at any tier: older ones age."""
        self.requests_seen += requests
        self._steps += 1

    def learn(
        self,
        tier: int,
        accepted: float,
        requests: int,
        chain_reach: list[int] | None = None,
        chains: list[tuple[int, int]] = (),
    ) -> None:
        """Fold a step of `tier` into the estimates: its speculating `requests` emitted
        `accepted` tokens in all. chain_reach: per request, its accepted draft tokens on the
        draft's greedy chain, where the step tells (not a ragged one's: its pruning may have
        cut the chain); then also the `chains` (tier, depth) no deeper than the step's tree
        learn from it: a chain of depth d would have emitted 1 + min(d, reach)."""
        if requests <= 0:
            return
        told = {tier: accepted} if tier in self.references else {}
        if chain_reach is not None:
            reaches = Counter(chain_reach)  # (few distinct values in a large batch)
            depth = self.upper[tier] - 1
            told.update(
                {r: self._emitted(d, reaches) for r, d in self.references.items() if d <= depth}
            )
            for chain, d in chains:
                self._learn(chain, self._emitted(d, reaches), len(chain_reach), told)
        self._learn(tier, accepted, requests, told)
        self._carry()

    @staticmethod
    def _emitted(depth: int, reaches: Counter) -> int:
        """What a chain of `depth` would have emitted over requests of these chain reaches."""
        return sum(k * (1 + min(depth, r)) for r, k in reaches.items())

    def _learn(self, tier: int, accepted: float, requests: int, told: dict[int, float]):
        """told: what each reference would have emitted over the step's requests, where the
        step tells."""
        # older requests weigh less by every request served since, at any tier: a tier
        # explored rarely is judged on what it does now, not on a regime long gone
        decay = (1.0 - ACCEPT_DECAY) ** (self.requests_seen - self._clock[tier])
        self._clock[tier] = self.requests_seen
        # (but what a tier was seen to do keeps ACCEPT_MIN_WEIGHT requests' weight, so one
        # request's single step cannot alone decide a tier explored rarely)
        weight = self.weight[tier]
        kept = max(weight * decay, min(weight, ACCEPT_MIN_WEIGHT))
        total = kept + requests
        self.learnt[tier] = (self.learnt[tier] * kept + accepted) / total
        for r, then in self.reference_then.items():
            if r not in told:
                # (a ragged step, or a chain shallower than the reference: not known. Paired
                # with the reference as last seen, a text that changed while the tier served
                # would count twice when it is carried)
                then[tier] = None
            elif then[tier] is None:  # (also the first learning: the prior has no text)
                then[tier] = told[r] / requests
            else:
                then[tier] = (then[tier] * kept + told[r]) / total
        self.weight[tier] = min(total, ACCEPT_MAX_WEIGHT)  # (past it: the same means)
        self._learnt_at[tier] = self._steps

    def _carry(self) -> None:
        """Every tier's estimate for the text now: its tokens beyond the root scaled by the
        reference's now against the reference's over the requests it was learnt on. The
        reference is the deepest of those learnt last (the deeper, the more it moves with the
        text); a tier learnt with it or since is of the text now."""
        if not self.references:
            self.mean[:] = self.learnt
            return
        ref = max(self.references, key=lambda r: (self._learnt_at[r], self.references[r]))
        now, ref_at = self.learnt[ref] - 1.0, self._learnt_at[ref]
        for t, learnt in enumerate(self.learnt):
            then = self.reference_then[ref][t]
            if (
                then is None
                or not 0 <= self._learnt_at[t] < ref_at
                or then - 1.0 < CARRY_MIN_SIGNAL
                or self.upper[t] - 1.0 > CARRY_MAX_DEPTH_RATIO * self.references[ref]
            ):
                # (a tier never learnt keeps its optimistic start: it is to be tried)
                self.mean[t] = learnt
                continue
            factor = min(max(now / (then - 1.0), 1.0 / CARRY_MAX_FACTOR), CARRY_MAX_FACTOR)
            self.mean[t] = min(1.0 + (learnt - 1.0) * factor, self.upper[t])
