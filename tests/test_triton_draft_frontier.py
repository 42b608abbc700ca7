"""One drafting depth's bookkeeping kernel against its torch reference (ties, NaN, greedy
chains, the root and the last depth), and the reference against the loop it replaced."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from specserve.ops.triton_draft_frontier import (  # noqa: E402
    GREEDY_KEY,
    expand_frontier_reference,
    first_column,
)
from specserve.speculative.frontier import Candidates, Frontier  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_inputs(bsz, k, hidden, scratch, depth, num_steps, *, seed, ties=False, nans=False,
                  dtype=torch.float32):  # fmt: skip
    """Head outputs for the frontier of `depth` (depth 0: the root) and that frontier."""
    g = torch.Generator().manual_seed(seed)
    f = 1 if depth == 0 else k
    c_logp = -torch.rand(bsz * f, k, generator=g) * 4
    if ties:  # few distinct values: many exactly equal keys
        c_logp = (c_logp * 2).round() / 2
    if nans:  # NaN ranks as -inf: the two tie
        c_logp[torch.rand(bsz * f, k, generator=g) < 0.2] = float("nan")
        c_logp[torch.rand(bsz * f, k, generator=g) < 0.2] = float("-inf")
    c_logp = c_logp.sort(dim=1, descending=True).values  # as a top-k returns them
    c_tok = torch.randint(0, 1000, (bsz * f, k), generator=g)
    h = torch.randn(bsz * f, hidden, generator=g).to(dtype)
    frontier = None
    if depth > 0:
        scores = -torch.rand(bsz, k, generator=g) * 3
        if ties:
            scores = (scores * 2).round() / 2
        greedy = torch.zeros(bsz, k, dtype=torch.bool)
        greedy[torch.arange(bsz), torch.randint(0, k, (bsz,), generator=g)] = True
        greedy[0] = False  # a request off the greedy chain
        frontier = Frontier(
            ids=torch.randint(1, 500, (bsz, k), generator=g),
            tokens=torch.randint(0, 1000, (bsz, k), generator=g),
            scores=scores,
            greedy=greedy,
            feat=torch.randn(bsz, k, hidden, generator=g).to(dtype),
            anc=torch.rand(bsz, k, scratch, generator=g) < 0.4,
        )
        frontier = Frontier(*(t.to(DEVICE) for t in vars(frontier).values()))
    num_cand = k + (num_steps - 1) * k * k
    return (c_logp.to(DEVICE), c_tok.to(DEVICE), h.to(DEVICE)), frontier, num_cand


def filled_outputs(bsz, k, hidden, scratch, num_cand, dtype):
    """Candidate buffers and a next frontier full of garbage (what is not written stays)."""
    cands = Candidates.empty(bsz, num_cand, DEVICE)
    for t in vars(cands).values():
        t.fill_(-7)
    out = Frontier.empty_pair(bsz, k, hidden, scratch, dtype, DEVICE)[0]
    for t in vars(out).values():
        t.fill_(1 if t.dtype == torch.bool else -3)
    return cands, out


def assert_same(a, b):
    for name, x in vars(a).items():
        y = getattr(b, name)
        assert x.dtype == y.dtype, name
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=name)


CASES = [  # (bsz, k, hidden, scratch, depth, num_steps)
    (1, 1, 8, 3, 0, 4),  # a chain: k = 1
    (1, 1, 8, 3, 2, 4),
    (1, 1, 8, 3, 3, 4),  # the last depth's self column is past the scratch
    (1, 4, 16, 12, 0, 4),  # the root
    (3, 4, 40, 12, 1, 4),
    (2, 4, 40, 12, 3, 4),  # past the scratch: no own bit
    (2, 3, 33, 9, 2, 4),  # k, H, S not powers of two
    (2, 16, 72, 48, 1, 4),  # k = 16: 256 columns
    (1, 16, 24, 48, 0, 4),
    (2, 8, 4100, 24, 2, 4),  # several H blocks
]


@pytest.mark.parametrize("variant", ["plain", "ties", "nans", "ties+nans"])
@pytest.mark.parametrize("bsz,k,hidden,scratch,depth,num_steps", CASES)
def test_kernel_matches_reference(bsz, k, hidden, scratch, depth, num_steps, variant):
    pytest.importorskip("triton", reason="the frontier kernel needs the triton package")
    from specserve.ops.triton_draft_frontier import expand_frontier_triton

    dtype = torch.bfloat16 if hidden % 2 else torch.float16
    ties, nans = "ties" in variant, "nans" in variant
    seed = hash((bsz, k, hidden, depth, variant)) % 10_000
    args, frontier, num_cand = random_inputs(
        bsz, k, hidden, scratch, depth, num_steps, seed=seed, ties=ties, nans=nans, dtype=dtype
    )
    for last in (False, True):  # the last depth writes candidates only
        want_c, want_o = filled_outputs(bsz, k, hidden, scratch, num_cand, dtype)
        got_c, got_o = filled_outputs(bsz, k, hidden, scratch, num_cand, dtype)
        expand_frontier_reference(*args, frontier, depth, want_c, None if last else want_o)
        expand_frontier_triton(*args, frontier, depth, got_c, None if last else got_o)
        assert_same(got_c, want_c)
        assert_same(got_o, want_o)
    # the written columns, and no others
    col0, width = first_column(depth, k), (1 if depth == 0 else k) * k
    written = (want_c.tokens != -7).any(0).nonzero().flatten()
    assert written.tolist() == list(range(col0, col0 + width))


def test_ties_go_to_the_lower_column_and_nan_last():
    """Equal keys: the lower column first, across parents too; NaN after -inf."""
    bsz, k, hidden, scratch = 1, 3, 4, 6
    frontier = Frontier(
        ids=torch.tensor([[5, 6, 7]]),
        tokens=torch.zeros(1, 3, dtype=torch.int64),
        scores=torch.tensor([[-1.0, 0.0, -1.0]]),
        greedy=torch.zeros(1, 3, dtype=torch.bool),
        feat=torch.zeros(1, 3, hidden),
        anc=torch.zeros(1, 3, scratch, dtype=torch.bool),
    )
    nan, inf = float("nan"), float("inf")
    # path scores: parent 0: -1, -2, -inf; parent 1: nan, -1, -1; parent 2: -1, -inf, nan
    c_logp = torch.tensor([[0.0, -1.0, -inf], [nan, -1.0, -1.0], [0.0, -inf, nan]])
    c_tok = torch.arange(9).view(3, 3)
    g = torch.arange(3 * hidden, dtype=torch.float32).view(3, hidden)
    # on a CUDA machine the kernel is compiled and takes CUDA tensors only
    frontier = Frontier(*(t.to(DEVICE) for t in vars(frontier).values()))
    c_logp, c_tok, g = c_logp.to(DEVICE), c_tok.to(DEVICE), g.to(DEVICE)
    impls = [expand_frontier_reference]
    try:
        from specserve.ops.triton_draft_frontier import expand_frontier_triton

        impls.append(expand_frontier_triton)
    except ImportError:
        pass
    for impl in impls:
        cands = Candidates.empty(bsz, 3 + 9, DEVICE)
        out = Frontier.empty_pair(bsz, k, hidden, scratch, torch.float32, DEVICE)[0]
        impl(c_logp, c_tok, g, frontier, 1, cands, out)
        # keys by column: -1 -2 -inf | nan -1 -1 | -1 -inf nan  -> columns 0, 4, 5
        assert out.ids.tolist() == [[3 + 1 + 0, 3 + 1 + 4, 3 + 1 + 5]], impl
        assert out.feat[0, :, 0].tolist() == [0.0, hidden, hidden]
        out2 = Frontier.empty_pair(bsz, 9, hidden, scratch, torch.float32, DEVICE)[0]
        cands2 = Candidates.empty(bsz, 9 + 9 * 81, DEVICE)  # k = 9 from one root: all columns
        impl(c_logp.view(1, 9), c_tok.view(1, 9), g[:1], None, 0, cands2, out2)
        # the greedy column 0, then 0, -1 x 3, -inf or NaN x 4: equal keys in column order
        assert out2.tokens.tolist() == [[0, 6, 1, 4, 5, 2, 3, 7, 8]], impl


def test_reference_equals_the_previous_loop():
    """Without ties the reference is the torch code the drafter ran before (depth 1 from the
    root, then depths >= 1), up to the order of a frontier, which was topk's."""
    g = torch.Generator().manual_seed(3)
    bsz, k, hidden, num_steps = 3, 4, 16, 4
    scratch = (num_steps - 1) * k
    first_rank = torch.arange(k) == 0
    # -- depth 1 as before: the root's top-k, in rank order
    logp = (-torch.rand(bsz, k, generator=g) * 3).sort(dim=1, descending=True).values
    tok = torch.randint(0, 1000, (bsz, k), generator=g)
    g_root = torch.randn(bsz, hidden, generator=g)
    old_cand = dict(
        tokens=[tok],
        scores=[logp],
        keys=[torch.where(first_rank, GREEDY_KEY - 1.0, logp)],
        parents=[torch.zeros(bsz, k, dtype=torch.int64)],
    )
    f_ids, f_scores, f_greedy = 1 + torch.arange(k).expand(bsz, k), logp, first_rank.expand(bsz, k)
    f_tokens, f_feat = tok, g_root[:, None, :].expand(bsz, k, hidden)
    f_anc = torch.zeros(bsz, k, scratch, dtype=torch.bool)
    next_id = 1 + k
    cands = Candidates.empty(bsz, k + scratch * k, "cpu")
    fronts = Frontier.empty_pair(bsz, k, hidden, scratch, torch.float32, "cpu")
    new = fronts[0]
    expand_frontier_reference(logp, tok, g_root, None, 0, cands, new)
    for depth in range(1, num_steps):
        col0 = (depth - 1) * k
        f_anc[:, :, col0 : col0 + k] |= torch.eye(k, dtype=torch.bool)[None]
        # the new frontier is in key order; the old one in topk's (also key order: no ties)
        for name, old in [
            ("ids", f_ids), ("tokens", f_tokens), ("scores", f_scores), ("greedy", f_greedy),
            ("feat", f_feat), ("anc", f_anc),
        ]:  # fmt: skip
            assert torch.equal(getattr(new, name), old), (depth, name)
        # the draft's outputs for this frontier
        h = torch.randn(bsz * k, hidden, generator=g)
        c_logp = (-torch.rand(bsz * k, k, generator=g) * 3).sort(dim=1, descending=True).values
        c_tok = torch.randint(0, 1000, (bsz * k, k), generator=g)
        # -- the old loop body
        c_scores = (f_scores[:, :, None] + c_logp.view(bsz, k, k)).view(bsz, k * k)
        c_tokens = c_tok.view(bsz, k * k)
        c_parent = f_ids[:, :, None].expand(bsz, k, k).reshape(bsz, k * k)
        c_greedy = (f_greedy[:, :, None] & first_rank).view(bsz, k * k)
        c_keys = torch.where(c_greedy, GREEDY_KEY - (depth + 1.0), c_scores)
        for name, x in [
            ("tokens", c_tokens), ("scores", c_scores), ("keys", c_keys), ("parents", c_parent),
        ]:  # fmt: skip
            old_cand[name].append(x)
        sel = c_keys.topk(k, dim=1).indices
        parent_idx = sel // k
        f_ids = sel + next_id
        next_id += k * k
        f_tokens = torch.gather(c_tokens, 1, sel)
        f_scores = torch.gather(c_scores, 1, sel)
        f_greedy = torch.gather(c_greedy, 1, sel)
        g3 = h.view(bsz, k, -1)
        f_feat = torch.gather(g3, 1, parent_idx[:, :, None].expand(bsz, k, hidden))
        f_anc = torch.gather(f_anc, 1, parent_idx[:, :, None].expand(bsz, k, scratch))
        # -- the reference
        nxt = fronts[depth % 2]
        expand_frontier_reference(c_logp, c_tok, h, new, depth, cands, nxt)
        new = nxt
    for name, parts in old_cand.items():
        assert torch.equal(getattr(cands, name), torch.cat(parts, dim=1)), name
    assert cands.keys.isfinite().all()


@pytest.mark.slow
def test_drafter_with_the_kernel_drafts_the_reference_trees(monkeypatch, tmp_path):
    """Whole decodes (batch > 1, k = 4, several depths) with the kernel in the drafter
    (interpreted on CPU, compiled on CUDA) draft exactly the trees the torch path drafts: the kernel's
    arguments and double-buffered frontiers are wired as the reference's."""
    pytest.importorskip("triton", reason="the frontier kernel needs the triton package")
    from specserve import Engine
    from specserve.config import Kernels
    from specserve.model.config import PRESETS
    from specserve.speculative import drafter as drafter_module
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
    from tests.engine_utils import TINY, mixed_prompts

    draft = write_random_eagle_checkpoint(str(tmp_path / "eagle"), PRESETS["tiny"], "EAGLE")
    prompts = mixed_prompts(3, 512, seed=5, min_len=2, max_len=20)
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    trees = []
    plain_draft = drafter_module.TreeDrafter.draft

    def recording_draft(self, batch, shape=None, **kw):
        t = plain_draft(self, batch, shape, **kw)
        trees.append([x.clone() for x in (t.tokens, t.parents, t.depths, t.scores)])
        return t

    monkeypatch.setattr(drafter_module.TreeDrafter, "draft", recording_draft)
    runs = []
    # only the drafting-depth kernel differs between the runs (tree selection stays torch)
    for kernels in (Kernels(), Kernels(draft_tree=True)):
        trees.clear()
        with Engine(
            **{**TINY, "device": DEVICE.type},
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=draft,
            speculative_num_steps=3,
            speculative_eagle_topk=4,
            speculative_num_draft_tokens=12,
            max_total_tokens=4096,  # the previous engine may not be collected yet (CUDA)
            disable_cuda_graph=True,  # graphs call draft() only while capturing: record every step
            kernels=kernels,
        ) as e:
            outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
        runs.append((outs, list(trees)))
    (outs_ref, trees_ref), (outs_k, trees_k) = runs
    assert outs_k == outs_ref
    assert len(trees_k) == len(trees_ref) > 0
    for a, b in zip(trees_ref, trees_k):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
