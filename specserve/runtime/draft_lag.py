"""Host bookkeeping of decode steps that skipped the draft (load-adaptive speculation).

A plain step of a speculative engine does not run the draft; it leaves what the draft needs
in the request's lag ring (kv/request_rows.py), which holds `capacity` positions. Before a
speculative step the draft catches up on every lagging request of the batch, in the step
itself. A request whose ring is full must catch up before its next plain step, unless
speculation does not pay at this load: then it stops speculating for good (`draft_stale`;
decoded plainly, as a request with `speculative: false` is) and costs no draft work again.

Two counts per request: `draft_lag`, plain steps launched since the draft was last current
(what launch decisions read, under overlap one step ahead of the results), and
`draft_behind`, tokens at the end of its KV the draft has no exact entry for, as of the
results applied (what the prefix cache may keep, runtime/scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.runtime.request import Request


@dataclass
class LaggedStep:
    """What a launched step did to the draft, applied with its results."""

    catch_up: bool
    skipped: bool  # a plain step: the draft did not run
    stale: frozenset[str]  # requests not speculating when it was launched (left behind, or
    # asking for plain decoding): their draft entries are never made exact again


class DraftLag:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.num_catch_ups = 0
        self.num_stale = 0
        # whether a plain step was planned since the last catch-up: if not, no speculating
        # request lags (a catch-up leaves every one of them current, a request joins current,
        # and only a plain step puts one behind), so the batch need not be looked through
        self._skipped_since_catch_up = False

    def speculating(self, req: Request) -> bool:
        return req.params.speculative and not req.draft_stale

    def catches_up(self, tier: int, live: list[Request], speculation_pays) -> bool:
        """Whether a step of `tier` first catches the draft up, `live` being its speculating
        requests: a speculative step wherever one of them lags, a plain one only where one's
        ring is full and speculation pays (else those stop speculating)."""
        if not self._skipped_since_catch_up:
            return False
        if tier > 0:
            return any(r.draft_lag > 0 for r in live)
        return any(r.draft_lag >= self.capacity for r in live) and speculation_pays()

    def plan(
        self,
        reqs: list[Request],
        tier: int,
        speculation_pays,
        live: list[Request] | None = None,
        catch_up: bool | None = None,
    ) -> LaggedStep:
        """Whether the step of `tier` over `reqs` first catches the draft up (and which
        requests stop speculating instead); speculation_pays(): whether keeping drafts
        current is worth it at this load; live: those of `reqs` speculating, and catch_up:
        `catches_up(tier, live, ...)`, where the caller knows them."""
        # (every step of an adaptive engine plans: at a batch of 128 of a small model the
        # host's time is the step's, so the common case, all speculating, loops least)
        if live is None:
            live = [r for r in reqs if self.speculating(r)]
        everyone = len(live) == len(reqs)
        if catch_up is None:
            catch_up = self.catches_up(tier, live, speculation_pays)
        if tier == 0 and not catch_up:
            full = [r for r in live if r.draft_lag >= self.capacity]
            for r in full:
                r.draft_stale = True
            self.num_stale += len(full)
            everyone = everyone and not full
        if catch_up:
            self.num_catch_ups += 1
            self._skipped_since_catch_up = False
            for r in live:  # (none of them was just left behind: that needs no catch-up)
                r.draft_lag = 0
        if tier == 0:
            self._skipped_since_catch_up = True
            for r in reqs:
                r.draft_lag += 1
        stale = (
            frozenset() if everyone else frozenset(r.rid for r in reqs if not self.speculating(r))
        )
        return LaggedStep(catch_up, tier == 0, stale)

    @staticmethod
    def changes_nothing(step: LaggedStep) -> bool:
        """Whether applying the step's results leaves every request's draft count as it was
        (`applied` need not run): a speculative step without catch-up, every request in it
        speculating."""
        return not (step.catch_up or step.skipped or step.stale)

    @staticmethod
    def applied(step: LaggedStep, req: Request, accept_len: int) -> None:
        """The step's results for `req`: how far behind its KV the draft now is."""
        if req.rid in step.stale:
            req.draft_behind += accept_len
            return
        if step.catch_up:
            req.draft_behind = 0
        if step.skipped:
            req.draft_behind += accept_len
