"""One tree-drafting depth's bookkeeping in one kernel: score the children, pick the next
frontier, record the candidates.

Why: at batch 1 on a small model each GPU launch costs about as much as the work in it, and
after the draft head's top-k a depth used to be ~15 small torch kernels (add, and, where,
top-k, divide, five gathers, an expand copy, the ancestor-mask OR), and `_select_tree` then
concatenated every depth's candidate lists. Here one launch per depth does all of it and
writes the candidates straight into [B, C] buffers at the depth's columns. Launch sizes come
from host ints only (no device -> host copy), so the whole draft is CUDA-graph capturable.

What, per request b, expanding the frontier of depth `depth` (depth 0: the root alone, F = 1
node; else F = k nodes), given the head's top-k of every frontier node (c_logp, c_tok
[B*F, k]) and its output g [B*F, H]; child column c = parent p * k + rank r:
  score[c]  = frontier score[p] + c_logp[p, r]          (the root's score is 0: just c_logp)
  greedy[c] = frontier greedy[p] and r == 0              (the root is greedy)
  key[c]    = GREEDY_KEY - (depth + 1) if greedy[c] else score[c]
  parent[c] = frontier id[p]                             (the root's id is 0)
  candidates at columns col0 + c (col0 = 0 for depth 0, k + (depth - 1) * k * k after):
  tokens c_tok[p, r], scores, keys, parents; candidate id = column + 1.
  Next frontier (when asked for): sel = the k best columns by key in descending order,
  ids col0 + sel + 1, tokens/scores/greedy at sel, feat = g[b * F + sel // k] (the parent's
  draft output), anc = the parent's ancestor row (zeros at the root) plus the node's own bit
  at scratch column depth * k + j (when below S): the mask the next depth attends with.

Tie and NaN rules (kernel and reference alike): equal keys go to the lower column (what a
stable descending sort gives), -0.0 equals +0.0, and NaN keys rank as -inf (a NaN score is
never preferred), as `best_columns` in ops/triton_tree_select.py. The selection uses the
int64 keys of the top-k kernels (float bits in the high word, 0x7FFFFFFF - column in the low
word): one integer max is "largest key, lowest column". The next frontier is in that order.

`expand_frontier` dispatches: the kernel when the caller's kernels say so (`use_kernel`; on
CPU tensors that is the Triton interpreter), else `expand_frontier_reference`. The frontier and candidate
buffers are speculative/frontier.py's `Frontier` and `Candidates` (read here by field).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specserve.ops import triton_available

_FIELDS = ("ids", "tokens", "scores", "greedy", "feat", "anc")  # a Frontier's tensors

GREEDY_KEY = 1.0e6  # above any log-probability (<= 0); minus depth keeps parents first
MAX_K = 16  # the kernel's selection holds k * k <= 256 columns per request


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    """Bool tensors as bytes for the kernel (a view: no copy)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def first_column(depth: int, k: int) -> int:
    """Candidate column of the first child of depth `depth`'s frontier."""
    return 0 if depth == 0 else k + (depth - 1) * k * k


def greedy_key(depth: int) -> float:
    """The key of the greedy child of depth `depth`'s frontier: an integer below 2**24, so
    exact in float32 (the kernel gets it as a float32 argument)."""
    return GREEDY_KEY - (depth + 1.0)


# ---- torch reference (the CPU path) -----------------------------------------------------------
def expand_frontier_reference(
    c_logp: torch.Tensor,
    c_tok: torch.Tensor,
    g: torch.Tensor,
    frontier,
    depth: int,
    cands,
    out,
) -> None:
    """The module doc's computation in torch ops; frontier None = the root (depth 0)."""
    bsz, k = cands.tokens.shape[0], c_logp.shape[1]
    f = c_logp.shape[0] // bsz
    width, col0 = f * k, first_column(depth, k)
    # this depth's candidate columns, as [B, F, k] views: the results are written in place
    cols = slice(col0, col0 + width)
    tokens, scores, keys, parents = (
        x[:, cols].view(bsz, f, k) for x in (cands.tokens, cands.scores, cands.keys, cands.parents)
    )
    tokens.copy_(c_tok.view(bsz, f, k))
    greedy = torch.zeros(bsz, f, k, dtype=torch.bool, device=c_logp.device)
    if frontier is None:  # the root: score 0, greedy, id 0
        scores.copy_(c_logp.view(bsz, f, k))
        greedy[:, :, 0] = True
        parents.zero_()
    else:
        torch.add(frontier.scores[:, :, None], c_logp.view(bsz, f, k), out=scores)
        greedy[:, :, 0] = frontier.greedy
        parents.copy_(frontier.ids[:, :, None].expand(bsz, f, k))
    keys.copy_(scores).masked_fill_(greedy, greedy_key(depth))
    if out is None:
        return
    inf = float("inf")  # (nan_to_num would also turn +-inf into the largest finite floats)
    ranked = cands.keys[:, cols].nan_to_num(nan=-inf, posinf=inf, neginf=-inf)
    sel = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :k]
    parent = sel // k
    torch.add(sel, col0 + 1, out=out.ids)
    torch.gather(cands.tokens[:, cols], 1, sel, out=out.tokens)
    torch.gather(cands.scores[:, cols], 1, sel, out=out.scores)
    torch.gather(greedy.view(bsz, width), 1, sel, out=out.greedy)
    g3 = g.view(bsz, f, -1)
    torch.gather(g3, 1, parent[:, :, None].expand(bsz, k, g3.shape[-1]), out=out.feat)
    if frontier is None:
        out.anc.zero_()
    else:
        s = frontier.anc.shape[-1]
        torch.gather(frontier.anc, 1, parent[:, :, None].expand(bsz, k, s), out=out.anc)
    # node j's own bit at scratch column depth * k + j (the diagonal stops at column S - 1)
    out.anc.diagonal(offset=depth * k, dim1=1, dim2=2).fill_(True)


# ---- the kernel -----------------------------------------------------------------------------
if triton_available():
    import triton
    import triton.language as tl

    from specserve.ops.triton_topk import _EMPTY, _decode, _encode

    @triton.jit
    def _expand_frontier_kernel(
        CLogp, CTok, G,
        FScores, FIds, FGreedy, FAnc,
        CandTok, CandScore, CandKey, CandPar,
        OIds, OTok, OScore, OGreedy, OFeat, OAnc,
        n_cand, hidden, scratch, col0, self_col, key_greedy,
        K: tl.constexpr, F: tl.constexpr, ROOT: tl.constexpr, NEXT: tl.constexpr,
        WP: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        # one program per (request, block of H); each redoes the (tiny) selection, block 0
        # alone writes the candidates and the next frontier's small fields
        b = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        offs = tl.arange(0, WP)
        valid = offs < F * K
        par = offs // K
        rank = offs % K
        row = b * F + par  # the parent's row of c_logp / c_tok / g
        logp = tl.load(CLogp + row * K + rank, mask=valid, other=0.0)
        if ROOT:
            score = logp
            greedy = rank == 0
            pid = tl.zeros([WP], tl.int64)
        else:
            score = tl.load(FScores + b * K + par, mask=valid, other=0.0) + logp
            greedy = (tl.load(FGreedy + b * K + par, mask=valid, other=0) != 0) & (rank == 0)
            pid = tl.load(FIds + b * K + par, mask=valid, other=0)
        key = tl.where(greedy, key_greedy, score)
        if hb == 0:
            cand = b * n_cand + col0 + offs
            tok = tl.load(CTok + row * K + rank, mask=valid, other=0)
            tl.store(CandTok + cand, tok, mask=valid)
            tl.store(CandScore + cand, score, mask=valid)
            tl.store(CandKey + cand, key, mask=valid)
            tl.store(CandPar + cand, pid, mask=valid)
        if NEXT:
            # K rounds of "take the largest key, drop it": descending, ties to the lower column
            ranked = tl.where(key != key, float("-inf"), key)
            enc = tl.where(valid, _encode(ranked, offs), _EMPTY)
            offs_k = tl.arange(0, KP)
            kmask = offs_k < K
            top = tl.full([KP], _EMPTY, tl.int64)
            for r in tl.static_range(K):
                best = tl.max(enc, 0)
                top = tl.where(offs_k == r, best, top)
                enc = tl.where(enc == best, _EMPTY, enc)
            _, sel = _decode(top)
            sel = tl.where(kmask, sel, 0)
            s_par = sel // K
            s_rank = sel % K
            s_row = b * F + s_par
            node = b * K + offs_k  # row of the next frontier
            if hb == 0:
                s_logp = tl.load(CLogp + s_row * K + s_rank)
                if ROOT:
                    s_score = s_logp
                    s_greedy = s_rank == 0
                else:
                    s_score = tl.load(FScores + b * K + s_par) + s_logp
                    s_greedy = (tl.load(FGreedy + b * K + s_par) != 0) & (s_rank == 0)
                tl.store(OIds + node, sel + col0 + 1, mask=kmask)
                tl.store(OTok + node, tl.load(CTok + s_row * K + s_rank), mask=kmask)
                tl.store(OScore + node, s_score, mask=kmask)
                tl.store(OGreedy + node, s_greedy.to(tl.uint8), mask=kmask)
                offs_s = tl.arange(0, SP)
                amask = kmask[:, None] & (offs_s[None, :] < scratch)
                if ROOT:
                    anc = tl.zeros([KP, SP], tl.uint8)
                else:
                    src = (b * K + s_par)[:, None] * scratch + offs_s[None, :]
                    anc = tl.load(FAnc + src, mask=amask, other=0)
                own = offs_s[None, :] == self_col + offs_k[:, None]
                anc = tl.where(own, 1, anc).to(tl.uint8)
                tl.store(OAnc + node[:, None] * scratch + offs_s[None, :], anc, mask=amask)
            h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            fmask = kmask[:, None] & (h[None, :] < hidden)
            x = tl.load(G + s_row[:, None] * hidden + h[None, :], mask=fmask)
            tl.store(OFeat + node[:, None] * hidden + h[None, :], x, mask=fmask)

    def expand_frontier_triton(
        c_logp: torch.Tensor,
        c_tok: torch.Tensor,
        g: torch.Tensor,
        frontier,
        depth: int,
        cands,
        out,
    ) -> None:
        """The kernel: same arguments and results as expand_frontier_reference."""
        bsz, num_cand = cands.tokens.shape
        k = c_logp.shape[1]
        f = c_logp.shape[0] // bsz
        hidden = g.shape[-1]
        if not 1 <= k <= MAX_K:
            raise ValueError(f"topk must be in [1, {MAX_K}], got {k}")
        c_logp, c_tok, g = c_logp.contiguous(), c_tok.contiguous(), g.contiguous()
        assert c_logp.dtype == cands.scores.dtype == torch.float32
        for part in (cands, frontier, out):
            assert part is None or all(t.is_contiguous() for t in vars(part).values())
        # The root has no frontier tensors and the last depth no next frontier: constexpr
        # branches skip them, so any tensor serves as the (never dereferenced) pointer.
        unused = cands.tokens
        fr = frontier if frontier is not None else SimpleNamespace(**dict.fromkeys(_FIELDS, unused))
        o = out if out is not None else SimpleNamespace(**dict.fromkeys(_FIELDS, unused))
        scratch = out.anc.shape[-1] if out is not None else 1
        kp = max(2, triton.next_power_of_2(k))
        block_h = min(triton.next_power_of_2(hidden), max(64, 4096 // kp))
        grid = (bsz, triton.cdiv(hidden, block_h) if out is not None else 1)
        _expand_frontier_kernel[grid](
            c_logp, c_tok, g,
            fr.scores, fr.ids, _as_u8(fr.greedy), _as_u8(fr.anc),
            cands.tokens, cands.scores, cands.keys, cands.parents,
            o.ids, o.tokens, o.scores, _as_u8(o.greedy), o.feat, _as_u8(o.anc),
            num_cand, hidden, scratch, first_column(depth, k), depth * k, greedy_key(depth),
            K=k, F=f, ROOT=frontier is None, NEXT=out is not None,
            WP=max(2, triton.next_power_of_2(f * k)), KP=kp,
            SP=max(2, triton.next_power_of_2(scratch)), BLOCK_H=block_h,
            num_warps=4,
        )  # fmt: skip


def expand_frontier(
    c_logp: torch.Tensor,
    c_tok: torch.Tensor,
    g: torch.Tensor,
    frontier,
    depth: int,
    cands,
    out,
    use_kernel: bool = False,
) -> None:
    """Expand depth `depth`'s frontier (None: the root, depth 0): write its children into
    `cands` at their columns and, unless `out` is None (the last depth), the next frontier
    into `out` (not `frontier`'s storage). c_logp, c_tok: the head's top-k [B*F, k] of the
    frontier's outputs g [B*F, H]. One launch on CUDA, the torch reference elsewhere."""
    if use_kernel and c_logp.shape[1] <= MAX_K:  # (config caps k at 16)
        expand_frontier_triton(c_logp, c_tok, g, frontier, depth, cands, out)
    else:
        expand_frontier_reference(c_logp, c_tok, g, frontier, depth, cands, out)
