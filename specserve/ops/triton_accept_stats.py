"""What adaptive speculation learns from a step's acceptance, in one kernel (the torch
references are `spec.tree.greedy_chain_reach` and `spec.verify_budget.observe` with the
gather and scatter of the calibration rows, ~20 small kernels: at batch 1 on a small target
each launch costs about as much as the work in it).

What, per request b, with the tree's parents and depths [N], its path log-probs scores [N]
(None: probability 1 everywhere), the accepted path [P] and accept_len:
  first[p]    = p's child of lowest id: its greedy child (the drafter writes children in
                rank order)
  reach       = how many leading d in [1, accept_len) have path[d] == first[path[d - 1]]
and, when the request has a calibration row r = rows[b] (W depths; node depths clamped to
[0, W - 1], so pruned nodes, depth -1, count at depth 0 as in the reference):
  got[w]      = accept_len - 1 >= w
  best[w]     = max(0, exp(score) of the nodes at depth w)
  drafted[w]  = some node lies at depth w
  reached[r, w]   += ema * (got[w] - reached[r, w])    where drafted[w]
  predicted[r, w] += ema * (best[w] - predicted[r, w]) where drafted[w]
in place. Rows repeated in `rows` (a graph's padding rows share one scratch row) race on it:
whichever write lands, the scratch row is never read for a real request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _accept_stats_kernel(
    Par, Path, Len, Depth, Score, Reached, Predicted, Rows, OReach,
    n, p, w, s_r0, s_r1, s_p0, s_p1, ema,
    NP: tl.constexpr, WP: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SCORES: tl.constexpr, CALIBRATE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, NP)
    par = tl.load(Par + b * n + cols, mask=cols < n, other=-1)
    acc_len = tl.load(Len + b)
    # a masked min over the parents per depth: no [N, N] tile, no children table
    prev = tl.load(Path + b * p)
    alive = acc_len * 0 + 1  # every depth so far on the greedy chain
    reach = acc_len * 0
    for d in range(1, p):
        node = tl.load(Path + b * p + d)
        first = tl.min(tl.where(par == prev, cols, NP), 0)
        alive *= ((node == first) & (d < acc_len)).to(tl.int64)
        reach += alive
        prev = node
    tl.store(OReach + b, reach)
    if CALIBRATE:
        row = tl.load(Rows + b)
        ws = tl.arange(0, WP)
        best = tl.zeros([WP], tl.float32)
        drafted = tl.zeros([WP], tl.int32)
        for n0 in range(0, n, BLOCK_N):
            idx = n0 + tl.arange(0, BLOCK_N)
            live = idx < n
            dep = tl.load(Depth + b * n + idx, mask=live, other=0)
            dep = tl.minimum(tl.maximum(dep, 0), w - 1)
            if HAS_SCORES:
                s = tl.load(Score + b * n + idx, mask=live, other=0.0).to(tl.float32)
                if LIBDEVICE_EXP:  # expf, as torch's exp: tl.exp is ex2.approx on NVIDIA
                    prob = libdevice.exp(s)
                else:
                    prob = tl.exp(s)
            else:
                prob = tl.full([BLOCK_N], 1.0, tl.float32)
            hit = (dep[None, :] == ws[:, None]) & live[None, :]
            best = tl.maximum(best, tl.max(tl.where(hit, prob[None, :], 0.0), 1))
            drafted = tl.maximum(drafted, tl.max(hit.to(tl.int32), 1))
        got = (acc_len - 1 >= ws).to(tl.float32)
        upd = (ws < w) & (drafted > 0)  # depths nothing was drafted at keep their values
        r_at = Reached + row * s_r0 + ws * s_r1
        old = tl.load(r_at, mask=upd, other=0.0)
        tl.store(r_at, old + ema * (got - old), mask=upd)
        p_at = Predicted + row * s_p0 + ws * s_p1
        old = tl.load(p_at, mask=upd, other=0.0)
        tl.store(p_at, old + ema * (best - old), mask=upd)


def acceptance_stats_triton(
    parents: torch.Tensor,
    path: torch.Tensor,
    accept_len: torch.Tensor,
    depths: torch.Tensor,
    scores: torch.Tensor | None,
    reached: torch.Tensor | None,
    predicted: torch.Tensor | None,
    rows: torch.Tensor | None,
    ema: float,
) -> torch.Tensor:
    """[B] int64 greedy chain reach; with rows [B] (None: no calibration, and reached /
    predicted may be None too) also updates reached / predicted [R, W] float32 in place at
    those rows. parents, depths [B, N] and path [B, P] int64, accept_len [B] int64 in [1, P];
    the module doc says what is computed."""
    bsz, n = parents.shape
    calibrate = rows is not None
    if not calibrate:  # (unread: any float32 tensor stands in)
        reached = predicted = torch.zeros(1, 1, dtype=torch.float32, device=parents.device)
    p = path.shape[1]
    w = reached.shape[1]
    parents, path, accept_len, depths = (
        t.contiguous() for t in (parents, path, accept_len, depths)
    )
    assert all(t.dtype == torch.int64 for t in (parents, path, accept_len, depths))
    assert reached.dtype == predicted.dtype == torch.float32
    assert predicted.shape[1] == w
    out = torch.empty(bsz, dtype=torch.int64, device=parents.device)
    if bsz == 0:
        return out
    rows = rows.contiguous() if rows is not None else accept_len  # (unread without rows)
    score = scores.contiguous() if scores is not None else depths  # (unread without scores)
    np_ = max(16, triton.next_power_of_2(n))
    wp = max(2, triton.next_power_of_2(w))
    _accept_stats_kernel[(bsz,)](
        parents, path, accept_len, depths, score, reached, predicted, rows, out,
        n, p, w, reached.stride(0), reached.stride(1), predicted.stride(0), predicted.stride(1),
        float(ema),
        NP=np_, WP=wp, BLOCK_N=max(16, min(np_, 4096 // wp)),
        HAS_SCORES=scores is not None, CALIBRATE=calibrate,
        LIBDEVICE_EXP=parents.is_cuda,  # (CPU tensors: the interpreter, which has no libdevice)
        # a * x + y rounded twice, as torch's separate kernels round it
        enable_fp_fusion=False, num_warps=4,
    )  # fmt: skip
    return out
