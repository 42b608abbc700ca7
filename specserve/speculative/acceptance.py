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
"""

from __future__ import annotations

from collections import Counter

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


class AcceptanceEstimates:
    def __init__(self, upper: list[float]):
        """upper: what each tier emits per request were all its drafted tokens accepted (the
        optimistic start)."""
        self.mean = list(upper)  # per tier: the estimate (updated in place)
        # decayed sums behind mean: mean[t] = _sum[t] / weight[t]
        self._sum = [a * ACCEPT_PRIOR_WEIGHT for a in upper]
        self.weight = [ACCEPT_PRIOR_WEIGHT] * len(upper)
        self.requests_seen = 0  # speculating requests over every step observed (the clock)
        self._clock = [0] * len(upper)  # requests_seen at each tier's last observation

    def served(self, requests: int) -> None:
        """A step served `requests` speculating requests, at any tier: older ones age."""
        self.requests_seen += requests

    def learn(self, tier: int, accepted: float, requests: int) -> None:
        """Fold a step of `tier` into its estimate: its speculating `requests` emitted
        `accepted` tokens in all."""
        # older requests weigh less by every request served since, at any tier: a tier
        # explored rarely is judged on what it does now, not on a regime long gone
        decay = (1.0 - ACCEPT_DECAY) ** (self.requests_seen - self._clock[tier])
        self._clock[tier] = self.requests_seen
        # (but what a tier was seen to do keeps ACCEPT_MIN_WEIGHT requests' weight, so one
        # request's single step cannot alone decide a tier explored rarely)
        weight = self.weight[tier]
        kept = max(weight * decay, min(weight, ACCEPT_MIN_WEIGHT))
        self._sum[tier] = self.mean[tier] * kept + accepted
        self.weight[tier] = kept + requests
        self.mean[tier] = self._sum[tier] / self.weight[tier]
        if self.weight[tier] > ACCEPT_MAX_WEIGHT:  # (the same mean, weighing less)
            self.weight[tier] = ACCEPT_MAX_WEIGHT
            self._sum[tier] = self.mean[tier] * ACCEPT_MAX_WEIGHT

    def learn_chains(self, chains: list[tuple[int, int]], chain_reach: list[int]) -> None:
        """Fold a tree's step into the estimates of the chains (tier, depth) no deeper than
        it: per speculating request, `chain_reach` of its accepted draft tokens lay on the
        draft's greedy chain, so a chain of depth d would have emitted 1 + min(d, reach)."""
        reaches = Counter(chain_reach)  # (few distinct values in a large batch)
        for tier, depth in chains:
            emitted = sum(k * (1 + min(depth, r)) for r, k in reaches.items())
            self.learn(tier, emitted, len(chain_reach))
