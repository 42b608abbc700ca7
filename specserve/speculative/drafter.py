"""Tree drafting (EAGLE-2 style) and the draft model's KV upkeep.

Per decode step and request, from the root's draft state g_root:
  depth 1:  the topk likeliest tokens after the root;
  depth d:  the draft runs on the current frontier (topk nodes at depth d-1) and each
            frontier node proposes topk children; the topk children with the best path
            score (sum of draft log-probabilities) form the next frontier.
Then the best `num_draft_tokens - 1` candidates plus the root form the tree. The draft's own
greedy chain (top-1 of the top-1 ...) is always kept first, so a tree never verifies less of
the greedy continuation than a chain of the same depth would.

A child's score never exceeds its parent's (log-probabilities are <= 0) and ties are
broken by candidate id (parents have smaller ids), so the chosen set always contains every
chosen node's parent: the tree is closed by construction.

Draft KV: the draft entry of token x_j lives at logical position j - 1 + delta (delta is
the head's position_offset). Frontier nodes forwarded while drafting write scratch KV at
window positions [delta, delta + (num_steps-1)*topk); each attends to the draft prefix and
to its own ancestors only. After verification the accepted tokens are re-run through the
draft ("draft extend") so its KV for them is exactly what a plain pass would compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from specserve.config.kernels import Kernels
from specserve.device import to_device
from specserve.kv.pool import KVCache
from specserve.ops.attention import ForwardContext
from specserve.ops.attention_metadata import Segment, build_device_metadata, build_metadata
from specserve.ops.sampling import topk_logprobs
from specserve.ops.triton_draft_frontier import expand_frontier
from specserve.ops.triton_tree_select import select_tree
from specserve.speculative.draft_heads import DraftHead
from specserve.speculative.frontier import Candidates, Frontier
from specserve.speculative.tree import DraftTrees, TreeShape


@dataclass
class _DraftConstants:
    frontier_pos: torch.Tensor  # [num_steps - 1, k] position offsets past kv_len per depth
    cand_depths: torch.Tensor  # [C] the depth of every candidate column


class TreeDrafter:
    speculative = True

    def __init__(
        self,
        head: DraftHead,
        num_steps: int,
        topk: int,
        num_draft_tokens: int,
        capture_layers: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        kernels: Kernels,
    ):
        self.head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.kernels = kernels
        self.head.prepare_for_serving(kernels)
        # A tree of N nodes is at most N - 1 deep and holds the draft's greedy chain first, so
        # past depth N - 1 drafting only widens the step's window (KV it reserves) and work.
        num_steps = min(num_steps, num_draft_tokens - 1)
        self.shape = TreeShape(num_steps, topk, num_draft_tokens)  # the largest step drafts this
        self.delta = head.position_offset
        self.lookahead = self.delta
        self.window = self.shape.window(self.delta)  # positions past kv_len a step may write
        self.capture_layers = capture_layers
        # an EAGLE head's prefill of a chunk shares the target's positions and slots, so
        # PrefillGraphs can replay it after the target's (a standalone draft's cannot)
        self.graphs_prefill = self.delta == 0
        # an EAGLE head's KV at position p pairs the target's state at p with token p + 1: at
        # the end of a cached prefix that token is the new request's own (runtime/scheduler.py)
        self.draft_kv_reads_next_token = self.delta == 0
        self.device, self.dtype = device, dtype
        self._consts: dict[TreeShape, _DraftConstants] = {}
        c = head.config
        self.kv_bytes_per_slot = KVCache.bytes_per_slot(
            c.num_layers, c.num_kv_heads, c.head_dim, dtype
        )

    def attach(self, table, num_slots: int, backend, rows) -> None:
        """Share the target's page table; keep each request's root state in `rows` (the
        draft's hidden state after the last accepted token, what the next step drafts from)."""
        c = self.head.config
        self.table = table
        self.backend = backend
        self.rows_state = rows
        self.kv = KVCache(
            c.num_layers, num_slots, c.num_kv_heads, c.head_dim, self.dtype, self.device
        )
        rows.add_features(c.hidden_size, self.dtype)

    def kv_caches(self) -> list[KVCache]:
        return [self.kv]

    # ---- a growing draft vocabulary's input ----------------------------------------------------
    @property
    def observes_tokens(self) -> bool:
        """Whether the head wants the requests' tokens (else callers skip building them)."""
        return self.head.takes_request_tokens

    def observe_tokens(self, tokens_by_request: Mapping[str, Sequence[int]]) -> None:
        self.head.observe_tokens(tokens_by_request)

    def release_tokens(self, request_ids: Iterable[str]) -> None:
        self.head.release_tokens(request_ids)

    # ---- the draft forward ------------------------------------------------------------------
    def feature_dim(self, target_hidden: int) -> int:
        """Width of the target features the head reads per position (0: none)."""
        kind = self.head.target_feature
        if kind == "none":
            return 0
        return target_hidden if kind == "final" else target_hidden * len(self.capture_layers)

    def features_of(self, target_out, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The target's outputs the head reads (its final hidden state, or the captured
        layers' inputs), at `rows` (None: all)."""
        kind = self.head.target_feature
        if kind == "none":
            return None
        if kind == "final":
            h = target_out.hidden
        else:
            h = torch.cat(target_out.aux_hidden, dim=-1)
        return h if rows is None else h[rows]

    def forward(self, tokens, features, positions, meta) -> torch.Tensor:
        """The head over tokens at positions, writing its KV per `meta`; returns its state g."""
        ctx = ForwardContext(self.backend, self.kv, meta, kernels=self.kernels)
        if features is None:
            features = torch.zeros(tokens.shape[0], 1, device=self.device, dtype=self.dtype)
        with torch.inference_mode():
            return self.head(tokens, features, positions, ctx)

    # ---- prefill ---------------------------------------------------------------------------
    @torch.inference_mode()
    def extend_after_prefill(self, chunks, target_out, done, sampled) -> torch.Tensor | None:
        """Draft entries for the chunk: EAGLE pairs x_{j} with h_{j-1}; a standalone draft
        takes the chunk's tokens (plus the sampled token once the prompt is complete).
        Returns the root state of each completed chunk (in `done` order), or None."""
        d = self.delta
        host_tokens, token_pos, seg, out, feat_rows = [], [], [], [], []
        sampled_at: list[tuple[int, int]] = []  # (flat index, index into `sampled`)
        last_rows: dict[str, int] = {}
        row = 0
        done_index = {i: j for j, i in enumerate(done)}
        for i, c in enumerate(chunks):
            ids = c.req.all_ids
            first, last = c.start + 1 - d, c.end + (1 if (c.completes or d == 0) else 0)
            # token x_j for j in [first, last): position j - 1 + d
            for j in range(first, last):
                if j < len(ids):
                    host_tokens.append(ids[j])
                else:
                    sampled_at.append((len(host_tokens), done_index[i]))
                    host_tokens.append(0)
            n = last - first
            p0 = first - 1 + d
            if d == 0:
                feat_rows.extend(range(row, row + n))
            seg.append(Segment(self.table.slots(c.req.rid, 0, p0 + n), n, n))
            out.append(self.table.slots(c.req.rid, p0, p0 + n))
            token_pos.extend(range(p0, p0 + n))
            row += c.end - c.start
            if c.completes:
                last_rows[c.req.rid] = len(host_tokens) - 1
        tokens = torch.tensor(host_tokens, dtype=torch.int64).to(self.device)
        if sampled_at:
            idx = torch.tensor([a for a, _ in sampled_at]).to(self.device)
            src = torch.tensor([b for _, b in sampled_at]).to(self.device)
            tokens[idx] = sampled[src]
        feats = (
            self.features_of(target_out, torch.tensor(feat_rows).to(self.device))
            if d == 0
            else None
        )
        pos = torch.tensor(token_pos, dtype=torch.int64).to(self.device)
        g = self.forward(tokens, feats, pos, build_metadata(seg, torch.cat(out), self.device))
        if not done:
            return None
        rows = [last_rows[chunks[i].req.rid] for i in done]
        return g[to_device(torch.tensor(rows, dtype=torch.int64), self.device)]

    # ---- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, batch, shape: TreeShape | None = None, penalties=None) -> DraftTrees:
        """The trees of `shape` (default: the configured one; a one-token shape: the root).
        penalties: the batch's (runtime/penalties.py `BatchPenalties`): the draft proposes
        from penalized logits too, as the target will draw from them (what it proposes does
        not change what is emitted, only how much of it is accepted)."""
        shape = (shape or self.shape).drafted
        if shape.tokens == 1:
            return DraftTrees.root_only(batch.roots)
        # Few, fused kernels per depth: at batch 1 on a small target every launch costs about
        # as much as the work in it. After the head's top-k, one expand_frontier call (one
        # kernel on CUDA) per depth scores the children, writes them into the candidate
        # buffers and picks the next frontier (ops/triton_draft_frontier.py). Scores are
        # float32 (sums of at most num_steps log-probabilities); equal keys resolve to the
        # lower candidate id (the parent before its children).
        k, d, dev, num_steps = shape.topk, self.delta, self.device, shape.steps
        bsz = batch.batch_size
        g_root = batch.root_g
        c = self._constants(shape)
        scratch = (num_steps - 1) * k
        cands = Candidates.empty(bsz, k + scratch * k, dev)  # candidate id = column + 1
        # A depth reads one frontier and writes the other: the next one's ancestor rows are
        # gathered from the current ones, and the current mask is still read by attention.
        fronts = (None, None)
        if num_steps > 1:
            fronts = Frontier.empty_pair(bsz, k, g_root.shape[-1], scratch, self.dtype, dev)
        use_kernel = self.kernels.draft_tree
        topk = self._topk
        if penalties is not None:
            topk = self._penalized_topk(bsz, penalties, (num_steps - 1) * k, dev)
        logp, tok = topk(g_root, k, 0, None)
        # depth 1: the root is a frontier of one node; its children come out in rank order
        front = fronts[0]
        expand_frontier(logp, tok, g_root, None, 0, cands, front, use_kernel)
        if num_steps > 1:
            # Every depth sees the draft prefix [0, kv_len + delta) and the whole scratch;
            # scratch not yet written this step is masked out (its ancestor bits are False),
            # so one metadata serves all depths and only the mask and the output slots change.
            shared = batch.metadata(d + scratch, k, scratch, None, front.anc.reshape(-1))
            # depth-major [num_steps - 1, B, k]: each depth's slots and positions are then
            # contiguous views (no copy per depth when B > 1)
            slots = batch.window_slots[:, d : d + scratch].reshape(bsz, num_steps - 1, k)
            slots = slots.transpose(0, 1).contiguous()
            # Masked-out scratch still enters attention with weight 0, and 0 * NaN is NaN:
            # clear it, so stale values (a page's earlier owner, a broken earlier step) are inert.
            self.kv.buffer.index_fill_(2, slots.reshape(-1), 0)
            # positions of every depth's frontier at once: kv_len + delta - 1 + depth
            all_pos = batch.kv_lens_dev[None, :, None] + c.frontier_pos[:, None, :]
        for depth in range(1, num_steps):
            meta = dataclasses.replace(
                shared,
                out_cache_loc=slots[depth - 1].reshape(-1),
                custom_mask=front.anc.reshape(-1),
            )
            g = self.forward(
                front.tokens.reshape(-1),
                front.feat.reshape(bsz * k, -1),
                all_pos[depth - 1].reshape(-1),
                meta,
            )
            c_logp, c_tok = topk(g, k, depth, front)
            nxt = fronts[depth % 2] if depth + 1 < num_steps else None  # last: none needed
            expand_frontier(c_logp, c_tok, g, front, depth, cands, nxt, use_kernel)
            front = nxt
        return self._select_tree(batch.roots, cands, shape)

    def _topk(self, g: torch.Tensor, k: int, depth: int, front: Frontier | None):
        """The head's k likeliest children of the nodes at `depth` (their features `g`; the
        frontier holding them, None for the root)."""
        return self.head.topk(g, k, self.kernels)

    def _penalized_topk(self, bsz: int, penalties, scratch: int, device):
        """`_topk` over logits penalized as each node's request asks (its output so far and
        the node's path below the root, its bias, its allowed tokens, the stop tokens its
        minimum length holds back at the children's depth): the draft proposes what the
        target will draw more often."""
        head = self.head
        # the tokens of each scratch column (a depth's frontier node), for the nodes' paths
        path_of = torch.full((bsz, max(1, scratch)), -1, dtype=torch.int64, device=device)

        def topk(g: torch.Tensor, k: int, depth: int, front: Frontier | None):
            logits = head.logits(g, self.kernels)
            request = torch.arange(bsz, device=g.device).repeat_interleave(g.shape[0] // bsz)
            path = None
            if front is not None:
                width = front.tokens.shape[1]
                path_of[:, (depth - 1) * width : depth * width] = front.tokens
                path = torch.where(front.anc, path_of[:, None, :], -1).reshape(g.shape[0], -1)
            columns = head.vocab_ids()
            logits = penalties.draft_draws(logits, request, depth, columns, path)
            return topk_logprobs(logits, k, columns, self.kernels)

        return topk

    def _constants(self, shape: TreeShape) -> _DraftConstants:
        """Index tensors that depend only on the tree shape, made once per shape."""
        if shape not in self._consts:
            k, dev = shape.topk, self.device
            depths = [torch.full((k,), 1, device=dev)] + [
                torch.full((k * k,), dep + 1, device=dev) for dep in range(1, shape.steps)
            ]
            steps = torch.arange(1, max(shape.steps, 2), device=dev)
            self._consts[shape] = _DraftConstants(
                frontier_pos=(self.delta - 1 + steps)[:, None].expand(len(steps), k).contiguous(),
                cand_depths=torch.cat(depths),
            )
        return self._consts[shape]

    def _select_tree(self, roots, cands: Candidates, shape: TreeShape) -> DraftTrees:
        tokens, parents, depths, scores, anc = select_tree(
            roots,
            cands,
            self._constants(shape).cand_depths,
            shape.tokens,
            shape.max_depth,
            use_kernel=self.kernels.draft_tree,
        )
        return DraftTrees(tokens, parents, depths, shape.max_depth, scores, anc)

    # ---- after verification ---------------------------------------------------------------------
    @torch.inference_mode()
    def extend_after_verify(
        self, batch, trees: DraftTrees, acc, target_out, path_rows: torch.Tensor
    ) -> torch.Tensor:
        """Run the draft over the accepted tokens (fixed width max_depth+1 per request; entries
        past the accepted length land in scratch positions and are never read). path_rows
        [B, max_depth + 1]: the accepted path's rows in the target's outputs. Returns the
        new root state [B, H]: the draft's output at the last accepted token. After a plain
        step (a one-node tree) this is the one token decoded: the draft stays caught up."""
        d, w = self.delta, trees.max_depth + 1
        bsz = trees.tokens.shape[0]
        tokens = acc.emitted.reshape(-1)
        feats = self.features_of(target_out, path_rows.reshape(-1))
        positions = (
            batch.kv_lens_dev[:, None] + d + torch.arange(w, device=self.device)[None, :]
        ).reshape(-1)
        out_slots = batch.window_slots[:, d : d + w].reshape(-1)
        meta = batch.metadata(d + w, w, w, out_slots)
        g = self.forward(tokens, feats, positions, meta).view(bsz, w, -1)
        last = torch.gather(
            g, 1, (acc.accept_len - 1)[:, None, None].expand(bsz, 1, g.shape[-1])
        ).squeeze(1)
        return last

    # ---- skipping the draft (load-adaptive speculation) -------------------------------------
    @torch.inference_mode()
    def record_skipped(self, batch, target_out, acc, rows: torch.Tensor) -> None:
        """A plain step that did not run the draft: keep, at ring index kv_len % capacity,
        what the draft's entry of position kv_len pairs (the target's features there and the
        token after it), for `catch_up`."""
        ring = self.rows_state
        at = batch.kv_lens_dev % ring.lag_capacity
        ring.ring_tokens[rows, at] = acc.emitted[:, 0]
        feats = self.features_of(target_out, None)
        if feats is not None:
            ring.ring_features[rows, at] = feats.to(ring.ring_features.dtype)

    @torch.inference_mode()
    def catch_up(self, batch, rows: torch.Tensor) -> torch.Tensor:
        """Run the draft over the positions [draft_len, kv_len) that plain steps skipped (at
        most the ring's capacity per request, in one fixed-width pass), so its KV there is
        what running it every step would have written. Returns the root state [B, H] (the
        draft's output at kv_len - 1; unchanged for a request with nothing to catch up) and
        marks the rows caught up."""
        ring, d = self.rows_state, self.delta
        cap = ring.lag_capacity
        bsz, dev = batch.batch_size, self.device
        kv_lens = batch.kv_lens_dev
        # A request that is not speculating (asked for plain decoding, or left behind) is
        # never caught up on purpose, so its lag can outgrow the ring while others in its
        # batch catch up: bound its pass to the ring (its draft entries are never used).
        draft_lens = torch.maximum(torch.minimum(ring.draft_lens[rows], kv_lens), kv_lens - cap)
        q = draft_lens[:, None] + torch.arange(cap, device=dev)[None, :]  # [B, cap]
        valid = q < batch.kv_lens_dev[:, None]
        at = q % cap
        tokens = ring.ring_tokens[rows[:, None], at]
        feats = None
        if self.head.target_feature != "none":
            feats = ring.ring_features[rows[:, None], at].reshape(bsz * cap, -1)
        # entries past a request's lag go to the scratch slot (page 0), never to its pages
        slots = torch.gather(batch.owned_slots, 1, q + d)
        out_slots = torch.where(valid, slots, 0).reshape(-1)
        meta = build_catch_up_metadata(batch, draft_lens + d, d, cap, out_slots)
        g = self.forward(tokens.reshape(-1), feats, (q + d).reshape(-1), meta).view(bsz, cap, -1)
        lag = batch.kv_lens_dev - draft_lens
        last = torch.gather(g, 1, (lag - 1).clamp(min=0)[:, None, None].expand(bsz, 1, g.shape[-1]))
        root_g = torch.where((lag > 0)[:, None], last.squeeze(1), batch.root_g)
        ring.features[rows] = root_g.to(ring.features.dtype)
        ring.draft_lens[rows] = batch.kv_lens_dev
        return root_g


def build_catch_up_metadata(batch, starts, delta: int, width: int, out_slots: torch.Tensor):
    """Each request's `width` catch-up queries at positions starts + j see the draft's KV at
    [0, starts + j] (causal over the queries); starts <= kv_len + delta."""
    return build_device_metadata(
        batch.owned_slots,
        starts + width,
        [u + delta + width for u in batch.kv_upper],
        width,
        width,
        out_slots,
        None,
        use_kernel=batch.kernels.decode_metadata,
        decode_step=True,
    )
