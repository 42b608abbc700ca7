"""Verification's acceptance from the ancestor mask, in one kernel (the torch reference is
`spec.tree.accept` with a mask, ~25 small kernels: at batch 1 on a small target each
launch costs about as much as the work in it).

What, per request b, with the tree (tokens, parents, depths) [N], the target's draw at
every node target[N] and the ancestor-or-self mask anc [N, N]:
  disagrees[j] = j is not the root and (it has no parent or tokens[j] != target[parent[j]])
  accepted[i]  = no node on i's root path (anc[i, :]) disagrees
  path[d]      = the accepted node at depth d (accepted nodes form one root path), for
                 d >= accept_len the last accepted node again
  bonus        = target[path[accept_len - 1]]
  emitted[d]   = tokens[path[d + 1]], except bonus at d = accept_len - 1 and at d = D
exactly as `spec.tree.acceptance_of_path` writes them (D = max_depth).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_kernel(
    Tok, Par, Depth, Target, Anc,
    OLen, OPath, OBonus, OEmit,
    n,
    NP: tl.constexpr, WP: tl.constexpr, W: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    base = b * n
    cols = tl.arange(0, NP)
    live_c = cols < n
    tok = tl.load(Tok + base + cols, mask=live_c, other=0)
    par = tl.load(Par + base + cols, mask=live_c, other=-1)
    drawn = tl.load(Target + base + tl.maximum(par, 0), mask=live_c, other=0)
    disagrees = live_c & (cols > 0) & ((par < 0) | (tok != drawn))
    d_idx = tl.arange(0, WP)
    # sums of the accepted node ids at depth d and at depth d + 1 (at most one node each)
    at_d = tl.zeros([WP], tl.int64)
    at_next = tl.zeros([WP], tl.int64)
    n_acc = tl.zeros([1], tl.int64)
    for i0 in range(0, n, BLOCK_I):
        rows = i0 + tl.arange(0, BLOCK_I)
        live = rows < n
        anc = tl.load(Anc + (base + rows)[:, None] * n + cols[None, :],
                      mask=live[:, None] & live_c[None, :], other=0)  # fmt: skip
        bad = tl.max(((anc != 0) & disagrees[None, :]).to(tl.int32), 1)
        ok = live & (bad == 0)
        n_acc += tl.sum(ok.to(tl.int64), 0)
        depth = tl.load(Depth + base + rows, mask=live, other=-1)
        ids = tl.where(ok, rows.to(tl.int64), 0)[None, :]
        at_d += tl.sum(tl.where(depth[None, :] == d_idx[:, None], ids, 0), 1)
        at_next += tl.sum(tl.where(depth[None, :] == d_idx[:, None] + 1, ids, 0), 1)
    n_acc = tl.sum(n_acc, 0)
    last = tl.sum(tl.where(d_idx == n_acc - 1, at_d, 0), 0)
    path = tl.where(d_idx < n_acc, at_d, last)
    bonus = tl.load(Target + base + last)
    nxt = tl.where(d_idx + 1 < n_acc, at_next, last)  # path[d + 1], padded like path
    emitted = tl.load(Tok + base + nxt, mask=d_idx < W, other=0)
    emitted = tl.where((d_idx == n_acc - 1) | (d_idx == W - 1), bonus, emitted)
    in_w = d_idx < W
    tl.store(OPath + b * W + d_idx, path, mask=in_w)
    tl.store(OEmit + b * W + d_idx, emitted, mask=in_w)
    tl.store(OLen + b, n_acc)
    tl.store(OBonus + b, bonus)


def accept_triton(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    target_tokens: torch.Tensor,
    anc: torch.Tensor,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accept_len [B], path [B, D+1], bonus [B], emitted [B, D+1]), all int64 on the
    trees' device; the module doc says what each holds."""
    bsz, n = tokens.shape
    dev = tokens.device
    w = max_depth + 1
    parts = [t.contiguous() for t in (tokens, parents, depths, target_tokens)]
    assert all(t.dtype == torch.int64 for t in parts), "tree and target tensors are int64"
    anc = anc.contiguous().view(torch.uint8)
    accept_len = torch.empty(bsz, dtype=torch.int64, device=dev)
    path = torch.empty(bsz, w, dtype=torch.int64, device=dev)
    bonus = torch.empty(bsz, dtype=torch.int64, device=dev)
    emitted = torch.empty(bsz, w, dtype=torch.int64, device=dev)
    np_ = max(16, triton.next_power_of_2(n))
    _accept_kernel[(bsz,)](
        *parts, anc, accept_len, path, bonus, emitted, n,
        NP=np_, WP=max(2, triton.next_power_of_2(w)), W=w,
        BLOCK_I=max(1, min(np_, 4096 // np_)), num_warps=4,
    )  # fmt: skip
    return accept_len, path, bonus, emitted
