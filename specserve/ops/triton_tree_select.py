"""The draft tree from the drafting candidates, and its ancestor mask, in one kernel.

Why: after the last drafting depth the tree used to be chosen and re-indexed by ~25 small
torch kernels (a top-k over order-preserving int64 keys, a sort, scatters, gathers, concats),
and verification then built the ancestor mask in a loop of 2 kernels per depth. At batch 1
on a small target every launch costs about as much as the work in it; one program per
request now does all of it.

What, per request b, from the candidates (column c = candidate id c + 1; `parents` holds
candidate ids, 0 for the root) and n = the tree width:
  chosen   = the n - 1 columns with the largest keys (NaN ranks as -inf, -0.0 equals +0.0,
             ties go to the lower column: what a stable descending sort gives);
  node ids = 1 + the chosen columns' rank in column order (parents have smaller columns
             than their children, so this order is topological); node 0 is the root;
  tokens, depths, scores at the chosen columns; parents re-indexed to node ids (-1 for the
  root); anc[i, j] = node j is node i or one of its ancestors.
Closure: a child's key never exceeds its parent's (greedy-chain keys fall with depth, other
keys are path log-probabilities, NaN ranks as -inf) and ties go to the parent's lower column,
so every chosen node's parent is chosen. Should a set ever not be closed, the kernel writes
parent -1 for the orphan, as the reference does.

`select_tree` dispatches: the kernel when the caller's kernels say so (`use_kernel`), else `select_tree_reference` (the CPU path). The mask comes with the kernel for trees of at most
MAX_MASK_NODES nodes (its walk holds rows of the mask in registers; wider trees would walk
a few rows at a time, one program per request); otherwise verification builds it with
`speculative/tree.py: ancestor_mask`.
"""

from __future__ import annotations

import torch

from specserve.ops import triton_available

MAX_CANDIDATES = 8192  # the kernel sorts a row's keys in one program (the config allows 3,856)
MAX_MASK_NODES = 256  # widest tree whose mask the kernel builds (see the module doc)


def best_columns(keys: torch.Tensor, m: int) -> torch.Tensor:
    """Columns of the m largest float32 keys per row, ties to the lower column (what a stable
    descending sort gives), in no particular order; NaN ranks as -inf (a NaN score is never
    preferred, and a NaN child never outranks its parent). One top-k over unique int64 keys:
    the float's bits made order-preserving (-0.0 equal to +0.0), then the reversed column."""
    keys = torch.nan_to_num(keys, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    bits = keys.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
    width = keys.shape[1]
    reversed_col = torch.arange(width - 1, -1, -1, device=keys.device)
    return (ordered * width + reversed_col).topk(m, dim=1, sorted=False).indices


def select_tree_reference(
    roots: torch.Tensor,
    cands,
    cand_depths: torch.Tensor,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module doc's selection in torch ops: (tokens, parents, depths, scores) [B, n].
    roots [B]; cands [B, C] (drafting's buffers); cand_depths [C]."""
    tokens, scores, keys, parents = cands.tokens, cands.scores, cands.keys, cands.parents
    bsz, num_cand = tokens.shape
    dev = tokens.device
    order = best_columns(keys, n - 1)
    chosen = torch.sort(order, dim=1).values  # candidate order = topological order
    # old id -> new node index (root 0 -> 0)
    new_index = torch.full((bsz, num_cand + 1), -1, dtype=torch.int64, device=dev)
    new_index[:, 0] = 0
    new_index.scatter_(1, chosen + 1, torch.arange(1, n, device=dev).expand(bsz, n - 1))
    tree_parents = torch.gather(new_index, 1, torch.gather(parents, 1, chosen))
    depths = cand_depths.expand(bsz, num_cand)
    return (
        torch.cat([roots[:, None], torch.gather(tokens, 1, chosen)], dim=1),
        torch.cat([torch.full_like(roots[:, None], -1), tree_parents], dim=1),
        torch.cat([torch.zeros_like(roots[:, None]), torch.gather(depths, 1, chosen)], dim=1),
        torch.cat(
            [torch.zeros_like(roots[:, None], dtype=scores.dtype), torch.gather(scores, 1, chosen)],
            dim=1,
        ),
    )


if triton_available():
    import triton
    import triton.language as tl

    from specserve.ops.triton_topk import _EMPTY, _encode

    @triton.jit
    def _select_tree_kernel(
        Roots, CandTok, CandScore, CandKey, CandPar, CandDepth, NodeOf,
        OTok, OPar, ODepth, OScore, OAnc,
        n_cand, n_nodes,
        CP: tl.constexpr, NP: tl.constexpr, BLOCK_I: tl.constexpr, MAX_DEPTH: tl.constexpr,
        WITH_MASK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, CP)
        valid = offs < n_cand
        cand = b * n_cand + offs
        key = tl.load(CandKey + cand, mask=valid, other=0.0)
        key = tl.where(key != key, float("-inf"), key)
        enc = tl.where(valid, _encode(key, offs), _EMPTY)
        # the (n-1)-th largest key: every key at or above it is chosen (keys are distinct)
        ranked = tl.sort(enc, descending=True)
        threshold = tl.max(tl.where(offs == n_nodes - 2, ranked, _EMPTY), 0)
        chosen = valid & (enc >= threshold)
        node = tl.cumsum(chosen.to(tl.int32), 0).to(tl.int64)  # 1-based rank in column order
        row = b * CP
        tl.store(NodeOf + row + offs, tl.where(chosen, node, -1), mask=valid)
        tl.debug_barrier()  # NodeOf is read back below at other threads' columns
        par = tl.load(CandPar + cand, mask=chosen, other=0)
        par_node = tl.load(NodeOf + row + par - 1, mask=chosen & (par > 0), other=0)
        out = b * n_nodes + node
        tl.store(OTok + out, tl.load(CandTok + cand, mask=chosen), mask=chosen)
        tl.store(OPar + out, par_node, mask=chosen)
        tl.store(ODepth + out, tl.load(CandDepth + offs, mask=chosen), mask=chosen)
        tl.store(OScore + out, tl.load(CandScore + cand, mask=chosen), mask=chosen)
        root = b * n_nodes
        tl.store(OTok + root, tl.load(Roots + b))
        tl.store(OPar + root, -1)
        tl.store(ODepth + root, 0)
        tl.store(OScore + root, 0.0)
        if WITH_MASK:
            tl.debug_barrier()  # the walk below reads parents written by other threads
            cols = tl.arange(0, NP)
            for i0 in range(0, n_nodes, BLOCK_I):
                rows = i0 + tl.arange(0, BLOCK_I)
                live = rows < n_nodes
                cur = tl.where(live, rows, -1).to(tl.int64)
                bits = tl.zeros([BLOCK_I, NP], tl.int1)
                # a node and its at most MAX_DEPTH ancestors; -1 past the root matches no column
                for _ in tl.static_range(MAX_DEPTH + 1):
                    bits = bits | (cols[None, :] == cur[:, None])
                    up = cur > 0
                    cur = tl.where(up, tl.load(OPar + root + cur, mask=up, other=-1), -1)
                dst = OAnc + (root + rows)[:, None] * n_nodes + cols[None, :]
                tl.store(dst, bits.to(tl.uint8), mask=live[:, None] & (cols[None, :] < n_nodes))

    def select_tree_triton(
        roots: torch.Tensor,
        cands,
        cand_depths: torch.Tensor,
        n: int,
        max_depth: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The kernel: select_tree_reference's four tensors plus the ancestor mask [B, n, n]
        (bool; None above MAX_MASK_NODES nodes); max_depth bounds every node's depth."""
        tokens, scores, keys, parents = cands.tokens, cands.scores, cands.keys, cands.parents
        bsz, num_cand = tokens.shape
        if not 2 <= n <= num_cand + 1 or num_cand > MAX_CANDIDATES:
            raise ValueError(f"tree of {n} nodes from {num_cand} candidates is out of range")
        dev = tokens.device
        parts = [tokens, scores, keys, parents]
        assert all(t.is_contiguous() for t in parts) and scores.dtype == keys.dtype == torch.float32
        roots = roots.contiguous()
        cand_depths = cand_depths.contiguous()
        cp = max(16, triton.next_power_of_2(num_cand))
        np_ = max(16, triton.next_power_of_2(n))
        out_tok = torch.empty(bsz, n, dtype=torch.int64, device=dev)
        out_par = torch.empty(bsz, n, dtype=torch.int64, device=dev)
        out_depth = torch.empty(bsz, n, dtype=cand_depths.dtype, device=dev)
        out_score = torch.empty(bsz, n, dtype=torch.float32, device=dev)
        with_mask = n <= MAX_MASK_NODES
        anc = torch.empty(bsz, n, n, dtype=torch.bool, device=dev) if with_mask else None
        node_of = torch.empty(bsz, cp, dtype=torch.int64, device=dev)  # column -> node id
        _select_tree_kernel[(bsz,)](
            roots, tokens, scores, keys, parents, cand_depths, node_of,
            out_tok, out_par, out_depth, out_score, anc.view(torch.uint8) if with_mask else out_tok,
            num_cand, n,
            CP=cp, NP=np_, BLOCK_I=max(1, min(np_, 4096 // np_)), MAX_DEPTH=max_depth,
            WITH_MASK=with_mask,
            num_warps=4 if cp <= 1024 else 8,
        )  # fmt: skip
        return out_tok, out_par, out_depth, out_score, anc


def select_tree(
    roots: torch.Tensor,
    cands,
    cand_depths: torch.Tensor,
    n: int,
    max_depth: int,
    use_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(tokens, parents, depths, scores, ancestor mask or None) of the tree of n nodes: one
    launch on CUDA (the mask up to MAX_MASK_NODES nodes), the torch reference (no mask)
    elsewhere."""
    if use_kernel and cands.tokens.shape[1] <= MAX_CANDIDATES:
        return select_tree_triton(roots, cands, cand_depths, n, max_depth)
    return (*select_tree_reference(roots, cands, cand_depths, n), None)
