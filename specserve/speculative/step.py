"""One decode step of a batch, on the device: draft -> verify -> accept -> commit -> extend.

Plain decoding is the same step with a root-only drafter (speculative/root_only.py): its tree
is the last token alone, verification is then an ordinary one-token forward, and nothing is
committed or extended. Everything a step reads and writes per request lives in its row of
`RequestRows` (kv/request_rows.py), so the host passes only the rows and upper bounds of the
KV lengths: a step can be launched before the previous one has been seen by the host, and
its shapes depend only on host values, so `DecodeGraphs` captures `DecodeStep.run` whole.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specserve.config.kernels import Kernels
from specserve.kv.request_rows import PAD_ROW, RequestRows
from specserve.ops.attention import PackedQueries
from specserve.ops.attention_metadata import build_device_metadata
from specserve.ops.logprobs import token_logprobs
from specserve.ops.sampling import SamplingTensors, sample
from specserve.ops.token_bitmask import apply_token_bitmask
from specserve.speculative.kv_commit import commit_accepted_path
from specserve.speculative.tree import (
    Acceptance,
    DraftTrees,
    TreeShape,
    accept,
    greedy_chain_reach,
    root_only_where,
)
from specserve.speculative.verify_budget import (
    CALIBRATION_EMA,
    VerifyPlan,
    node_values,
    plan_verify,
    pruned,
    ranks_by_key,
)
from specserve.speculative.verify_budget import observe as observe_acceptance


@dataclass
class DecodeBatch:
    """What drafting and verification share about one decode step. KV lengths and roots are
    read on the device from the requests' rows; the host only knows upper bounds."""

    rows: torch.Tensor  # [B] the requests' rows in RequestRows (PAD_ROW: padding)
    batch_size: int
    kv_upper: list[int]  # host upper bounds of each request's kv_len
    kv_lens_dev: torch.Tensor  # [B] exact, device
    roots: torch.Tensor  # [B] last token of each request, device
    window: int  # W: logical positions reserved past kv_len this step
    owned_slots: torch.Tensor  # [B, L] device slots of positions [0, L), L >= kv_len + W
    window_slots: torch.Tensor  # [B, W] device slots of positions [kv_len, kv_len + W)
    sampling: SamplingTensors
    kernels: Kernels
    root_g: torch.Tensor | None = None  # [B, H] the draft's state at the root (EAGLE)

    def metadata(self, visible_past_kv: int, q_len: int, extra_len: int, out_cache_loc, mask=None):
        """Requests see positions [0, kv_len + visible_past_kv); the last extra_len are masked."""
        return build_device_metadata(
            self.owned_slots,
            self.kv_lens_dev + visible_past_kv,
            [u + visible_past_kv for u in self.kv_upper],
            q_len,
            extra_len,
            out_cache_loc,
            mask,
            use_kernel=self.kernels.decode_metadata,
            decode_step=True,
        )


@dataclass
class StepLogprobs:
    """The target's log-probabilities of a step's emitted tokens (rows past accept_len are
    padding), computed only when the batch asks for them (`SamplingTensors.logprobs`)."""

    token: torch.Tensor  # [B, max_accept] float32: log-prob of emitted[b, j]
    top_values: torch.Tensor | None  # [B, max_accept, k] float32, descending
    top_ids: torch.Tensor | None  # [B, max_accept, k] int64

    def head(self, n: int) -> StepLogprobs:
        """The first n requests' rows."""
        top = (None, None) if self.top_values is None else (self.top_values[:n], self.top_ids[:n])
        return StepLogprobs(self.token[:n], *top)


class StepOutputs(NamedTuple):
    """A decode step's per-request results, on the device ([B] rows, padding included)."""

    accept_len: torch.Tensor  # [B] tokens emitted (accepted draft tokens + the bonus token)
    emitted: torch.Tensor  # [B, max_accept] the emitted tokens, padded
    logprobs: StepLogprobs | None  # their log-probs, when the batch asks for them
    # [B] accepted draft tokens on the draft's greedy chain (`tree.greedy_chain_reach`): what
    # a chain tier would have accepted; reported to load-adaptive speculation only
    chain_reach: torch.Tensor | None = None

    def head(self, n: int) -> StepOutputs:
        """The first n requests' results."""
        return StepOutputs(
            self.accept_len[:n],
            self.emitted[:n],
            None if self.logprobs is None else self.logprobs.head(n),
            None if self.chain_reach is None else self.chain_reach[:n],
        )


class DecodeStep:
    def __init__(
        self,
        target,
        drafter,
        rows: RequestRows,
        kernels: Kernels,
        simulator=None,
        tiers: list[TreeShape] | None = None,
    ):
        """target: the model runner; drafter: a TreeDrafter or a RootOnlyDrafter; simulator:
        forces acceptance lengths (benchmarking); tiers: the tree shapes a step may draft
        (speculative/adaptive.py), by default the drafter's own alone. With tiers and a lag
        ring in `rows`, a plain-tier step skips the draft (its catch-up comes later)."""
        self.tiers = tiers or [drafter.shape]
        self.target = target
        self.drafter = drafter
        self.rows = rows
        self.kernels = kernels
        self.simulator = simulator
        self.device = rows.device
        self.skips_draft = drafter.speculative and rows.lag_capacity > 0
        # several tiers: load-adaptive speculation, which learns from each step's acceptance
        self.reports_acceptance = drafter.speculative and len(self.tiers) > 1

    @property
    def window(self) -> int:
        """Logical positions past kv_len a step writes (target tree + draft scratch)."""
        return self.drafter.window

    @property
    def slot_width(self) -> int:
        """Logical positions past kv_len a step may read slots of: the window, or a catch-up's
        reach (its entries past a request's lag go to scratch, so it reserves nothing)."""
        if not self.skips_draft:
            return self.window
        return max(self.window, self.drafter.delta + self.rows.lag_capacity)

    def tier_window(self, tier: int) -> int:
        """Logical positions past kv_len a step of `tier` writes (<= `window`)."""
        if len(self.tiers) == 1:
            return self.window
        return min(self.window, self.tiers[tier].window(self.drafter.delta))

    def tier_slot_width(self, tier: int, catch_up: bool) -> int:
        """`slot_width` for a step of `tier` alone: its own window, or with a catch-up the
        catch-up's reach too. A step's context width (kv_len + this) picks its attention
        splits and its graph's width bucket, so a small tier of a wide configured tree runs
        at the width the small tree configured alone would (at the configured 6/8/64 tree's
        width, SmolLM2's 4/4/16 steps crossed into the next width bucket tens of tokens
        earlier than the fixed 4/4/16 tree's)."""
        if len(self.tiers) == 1:
            return self.slot_width
        own = self.tier_window(tier)
        return max(own, self.drafter.delta + self.rows.lag_capacity) if catch_up else own

    @functools.cached_property
    def max_accept(self) -> int:
        """Most tokens one step can add to a request (read per request per step: cached)."""
        return max(t.max_depth for t in self.tiers) + 1

    def run(
        self,
        rows: torch.Tensor,
        sampling: SamplingTensors,
        width: int,
        kv_upper: list[int],
        tier: int = 0,
        catch_up: bool = False,
        grammar=None,
        penalties=None,
    ) -> StepOutputs:
        """One step of the requests in `rows` (PAD_ROW: padding, touching only scratch);
        `width` bounds every kv_len + tier_slot_width(tier, catch_up). catch_up: first run
        the draft over the positions plain steps skipped. grammar: the batch's structured
        output (runtime/grammar.py `BatchGrammar`), which masks each node's draw to what its
        request's grammar allows after the node's path; the host waits for the drafts.
        penalties: the batch's logit biases and penalties (runtime/penalties.py
        `BatchPenalties`), each node's after its path."""
        batch = self._read(rows, sampling, width, kv_upper, self.tier_window(tier))
        if catch_up:
            batch.root_g = self.drafter.catch_up(batch, rows)
        shape = self.tiers[tier]
        trees = self.drafter.draft(batch, shape, penalties=penalties)
        extra = {k: v for k, v in (("grammar", grammar), ("penalties", penalties)) if v is not None}
        acc, target_out, logprobs, path_rows, reach = self.verify(
            batch, trees, shape.verified, **extra
        )
        if penalties is not None:  # (its counts and minimum lengths, kept on the device)
            penalties.advance(acc.accept_len, acc.emitted)
        new_lens = batch.kv_lens_dev + acc.accept_len
        if self.skips_draft and shape.tokens == 1:
            self.drafter.record_skipped(batch, target_out, acc, rows)
            self.rows.set_state(rows, new_lens, acc.bonus)
        else:
            features = self.drafter.extend_after_verify(batch, trees, acc, target_out, path_rows)
            self.rows.set_state(rows, new_lens, acc.bonus, features, new_lens)
        if reach is not None:
            # rows of one tensor, so the host brings both back in one copy without a launch
            # to stack them (PendingDecode)
            counts = torch.stack((acc.accept_len, reach))
            return StepOutputs(counts[0], acc.emitted, logprobs, counts[1])
        return StepOutputs(acc.accept_len, acc.emitted, logprobs, reach)

    def _read(self, rows, sampling, width, kv_upper, window: int) -> DecodeBatch:
        """The batch's state, read by row on the device (window: the step's tier's)."""
        st = self.rows
        pad = rows == PAD_ROW
        kv_lens = torch.where(pad, 0, st.kv_lens[rows])
        owned = st.slots(rows, width)
        cols = kv_lens[:, None] + torch.arange(window, device=self.device)[None, :]
        return DecodeBatch(
            rows=rows,
            batch_size=rows.shape[0],
            kv_upper=kv_upper,
            kv_lens_dev=kv_lens,
            roots=torch.where(pad, 0, st.roots[rows]),
            window=window,
            owned_slots=owned,
            window_slots=torch.gather(owned, 1, cols),
            sampling=sampling,
            kernels=self.kernels,
            root_g=st.features[rows] if st.features is not None else None,
        )

    def verify(
        self,
        batch: DecodeBatch,
        trees: DraftTrees,
        verified: int = 0,
        grammar=None,
        penalties=None,
    ) -> tuple[Acceptance, object, StepLogprobs | None, torch.Tensor, torch.Tensor | None]:
        """One target forward over every tree of the batch (node i at position kv_len +
        depth[i], its KV written at kv_len + i, seeing its ancestors); the target draws a token
        per node; acceptance follows the draft where it agrees; the accepted path's KV moves to
        [kv_len, kv_len + accept_len). verified > 0 (and below the trees' width): only
        B * verified nodes are verified, each request's best ones (ragged verification).
        Returns (acceptance, the target's outputs, the emitted tokens' log-probs when the batch
        asks for them, the accepted path's rows in the target's outputs, the greedy chain's
        reach when `reports_acceptance`)."""
        b, n = trees.tokens.shape
        kernels = self.kernels
        positions = (batch.kv_lens_dev[:, None] + trees.depths).reshape(-1)
        anc = None if n == 1 else trees.ancestors()
        mask = None if anc is None else anc.reshape(-1)
        slots = batch.window_slots[:, :n].reshape(-1)
        meta = batch.metadata(n, n, n, slots, mask)
        plan = self._plan(batch, trees, verified) if 1 < verified < n else None
        tokens, packed = trees.tokens.reshape(-1), None
        if plan is not None:
            # pruned nodes' KV slots are zeros: attention never weighs what it masks out, but
            # 0 * NaN would still be NaN
            self.target.kv_cache.buffer.index_fill_(2, slots, 0)
            tokens, positions = tokens[plan.packed], positions[plan.packed]
            packed = PackedQueries(plan.packed, b * n, slots[plan.packed])
        out = self.target.forward(tokens, positions, meta, self.drafter.capture_layers, packed)
        st = batch.sampling
        logits = self.target.model.compute_logits(out.hidden, kernels, upcast=not st.all_greedy)
        drawn_from = logits  # (log-probs stay the model's own, as vLLM reports them)
        if penalties is not None:
            drawn_from = penalties.tree_draws(logits, trees, None if plan is None else plan.packed)
        if grammar is not None:
            bitmask = grammar.tree_bitmask(trees.tokens, trees.parents)
            drawn_from = drawn_from.clone() if drawn_from is logits else drawn_from
            apply_token_bitmask(drawn_from, bitmask if plan is None else bitmask[plan.packed])
        if n > 1 and not st.all_greedy:  # greedy rows need no per-node sampling parameters
            st = st.expand(n) if plan is None else st.expand(n).take(plan.packed)
        # each node's draw is for the position after it: kv_len + depth + 1
        drawn = sample(drawn_from, st, positions + 1, kernels)
        if plan is None:
            target_tokens = drawn.view(b, n)
            node_rows = torch.arange(b * n, device=self.device).view(b, n)
        else:  # a pruned node has no draw (-2 is no token and no pruned node's -1)
            target_tokens = torch.full((b * n,), -2, dtype=drawn.dtype, device=self.device)
            target_tokens = target_tokens.index_copy_(0, plan.packed, drawn).view(b, n)
            node_rows = plan.row_of
            trees = pruned(trees, plan.keep)
        if self.simulator is not None and anc is not None:
            acc = self.simulator.accept(trees, target_tokens, anc)
        else:
            acc = accept(trees, target_tokens, anc, use_kernel=kernels.tree_accept)
        if n > 1 and batch.sampling.any_plain:  # requests that asked to decode plainly
            acc = root_only_where(batch.sampling.plain_rows, trees, acc, target_tokens)
        reach = None
        if n > 1:  # a one-node tree's KV is already where it belongs
            commit_accepted_path(
                [self.target.kv_cache], batch.window_slots, acc.path, kernels.kv_commit
            )
            if self.reports_acceptance:
                reach = self._acceptance_stats(batch, trees, acc)
        path_rows = torch.gather(node_rows, 1, acc.path)
        logprobs = (
            emitted_logprobs(logits, path_rows, acc, st.top_logprobs) if st.logprobs else None
        )
        return acc, out, logprobs, path_rows, reach

    def _plan(self, batch: DecodeBatch, trees: DraftTrees, verified: int) -> VerifyPlan:
        """Which nodes this step verifies: B * verified in all, by their estimated worth."""
        rows = batch.rows
        values = node_values(trees, self.rows.reached[rows], self.rows.predicted[rows])
        plain = rows == PAD_ROW  # padding rows of a graph's batch verify their root alone
        if batch.sampling.any_plain:
            plain = plain | batch.sampling.plain_rows
        limit = (rows != PAD_ROW).sum() * (verified - 1)  # the real rows' extra nodes
        total = batch.batch_size * verified
        return plan_verify(trees, values, ranks_by_key(trees), plain, total, limit)

    def _acceptance_stats(
        self, batch: DecodeBatch, trees: DraftTrees, acc: Acceptance
    ) -> torch.Tensor:
        """What adaptive speculation learns from a step: each request's calibration for
        ragged budgets (updated in its row, when ragged tiers exist) and the greedy chain's
        reach on the accepted path (returned; pruning keeps the trees' parents). Under
        simulated acceptance the reach is the forced length: a chain would have been forced
        the same, capped at its depth."""
        rows = batch.rows if self.rows.reached is not None else None
        forced = self.simulator is not None
        if self.kernels.accept_stats:
            from specserve.ops.triton_accept_stats import acceptance_stats_triton

            reach = acceptance_stats_triton(
                trees.parents, acc.path, acc.accept_len, trees.depths, trees.scores,
                self.rows.reached, self.rows.predicted, rows, CALIBRATION_EMA,
            )  # fmt: skip
        else:
            if rows is not None:
                reached, predicted = observe_acceptance(
                    self.rows.reached[rows], self.rows.predicted[rows], trees, acc.accept_len
                )
                self.rows.reached[rows], self.rows.predicted[rows] = reached, predicted
            reach = None if forced else greedy_chain_reach(trees.parents, acc.path, acc.accept_len)
        return acc.accept_len - 1 if forced else reach


def emitted_logprobs(
    logits: torch.Tensor, path_rows: torch.Tensor, acc: Acceptance, k: int
) -> StepLogprobs:
    """logits [R, V] of the verified nodes; path_rows [B, W]: the accepted path's rows. The
    emitted token j is the target's own draw at the accepted path's node j, so its log-prob
    is read from that node's row (rows past accept_len repeat the last node and are
    discarded on the host)."""
    b, width = path_rows.shape
    rows = logits[path_rows.reshape(-1)]
    token, values, ids = token_logprobs(rows, acc.emitted.reshape(-1), k)
    if values is None:
        return StepLogprobs(token.view(b, width), None, None)
    return StepLogprobs(token.view(b, width), values.view(b, width, -1), ids.view(b, width, -1))
