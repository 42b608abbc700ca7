"""Randomized load-adaptive speculation: random tree shapes, drafts, page sizes, lag rings,
KV budgets, prefix caching over multi-turn waves, sampling and log-prob options, and a random
tier at every step. Whatever the draft does, the outputs (tokens, seeded samples, log-probs)
are those of plain decoding, every request finishes, and flushing the cache frees every page.
The verification plan and the draft-lag bookkeeping are fuzzed on their own too."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specserve import Engine
from specserve.runtime.draft_lag import DraftLag
from specserve.runtime.request import Request
from specserve.sampling_params import SamplingParams
from specserve.speculative.tree import DraftTrees
from specserve.speculative.verify_budget import plan_verify, ranks_by_key
from tests.engine_utils import TINY, mixed_prompts, random_trees, reference_kv, spec_args

VOCAB = 512  # the tiny preset's


def draw_case(rng: random.Random, root: str) -> dict:
    kind = rng.choice(["STANDALONE", "EAGLE", "EAGLE3"])
    if kind == "STANDALONE":
        draft = "tiny"
    else:
        from specserve.model.config import PRESETS
        from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint

        vocab = rng.choice([None, 40]) if kind == "EAGLE3" else None  # a reduced draft vocab
        seed = rng.randrange(100)
        draft = write_random_eagle_checkpoint(f"{root}/{kind}", PRESETS["tiny"], kind, vocab, seed)
    topk, steps = rng.randint(1, 4), rng.randint(1, 5)
    ndt = rng.randint(2, min(1 + topk + (steps - 1) * topk * topk, 24))
    spec = spec_args(draft, topk, steps, ndt, speculative_adaptive=True)
    spec["speculative_algorithm"] = kind
    spec["speculative_adaptive_lag_tokens"] = rng.choice([0, 1, 2, 5, 32])
    common = dict(
        page_size=rng.randint(1, 7),
        disable_overlap_schedule=rng.random() < 0.5,
        disable_radix_cache=rng.random() < 0.3,
        chunked_prefill_size=rng.choice([-1, 7, 64]),
        max_running_requests=rng.choice([2, 4, 64]),
    )
    if rng.random() < 0.4:  # retractions, yet room for any one request and a step's window
        common["max_total_tokens"] = rng.choice([160, 200, 320])
    prompts = mixed_prompts(rng.randint(1, 7), VOCAB, seed=rng.randrange(10**6), max_len=30)
    params = []
    for _ in prompts:
        sp = {"max_new_tokens": rng.randint(1, 40), "ignore_eos": rng.random() < 0.8}
        if rng.random() < 0.4:
            sp.update(
                temperature=rng.choice([0.7, 1.0, 1.3]),
                top_k=rng.choice([-1, 1, 5, 40]),
                top_p=rng.choice([1.0, 0.9, 0.5]),
                seed=rng.randrange(1000),
            )
        else:
            sp["temperature"] = 0.0
        if rng.random() < 0.3:
            sp["n"] = rng.randint(2, 3)
        if rng.random() < 0.2:
            sp["speculative"] = False
        params.append(sp)
    logprobs = dict(
        return_logprob=[rng.random() < 0.4 for _ in prompts],
        top_logprobs_num=[rng.choice([0, 0, 2]) for _ in prompts],
    )
    return dict(
        common=common,
        spec=spec,
        prompts=prompts,
        params=params,
        logprobs=logprobs,
        tier_seed=rng.randrange(10**6),
        plain_share=rng.choice([None, 0.8, 0.95]),  # None: every tier alike
        never_pays=rng.random() < 0.3,
        obey_can=rng.random() < 0.5,
        second_wave=rng.random() < 0.7,
        padded=rng.choice([None, 1, 4]),  # steps replayed as padded graphs of this batch
        more=[mixed_prompts(1, VOCAB, seed=rng.randrange(10**6), max_len=8)[0] for _ in prompts],
    )


def check_draft_lag(core, errors: list) -> None:
    """Of requests no launched step is changing: a speculating request's draft is exact up to where
    the host says (the device's draft_lens), never further behind than its ring holds, and
    a standalone draft (the target itself) holds the target's KV there."""
    rows, lag = core.rows, core.draft_lag
    for r in core.scheduler.running:
        decoding = r.output_ids and r.kv_len == len(r.prompt_ids) + len(r.output_ids) - 1
        if r.finished or r.inflight_steps or not decoding:
            continue
        if not r.params.speculative or r.draft_stale:
            continue
        exact = r.kv_len - r.draft_behind
        if lag is not None:
            device = int(rows.draft_lens[rows.row(r.rid)])
            if device != exact or r.draft_behind > lag.capacity:
                errors.append((r.rid, r.kv_len, r.draft_behind, device))
        if core.cfg.speculative_algorithm == "STANDALONE" and exact > 0:
            kv = core.worker.drafter.kv
            slots = core.table.slots(r.rid, 0, exact)
            ref_k, ref_v = reference_kv(core.runner.model, r.all_ids[:exact])
            for layer in range(len(ref_k)):
                for got, want in (
                    (kv.k[layer][slots], ref_k[layer]),
                    (kv.v[layer][slots], ref_v[layer]),
                ):
                    if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
                        errors.append((r.rid, "draft KV", layer, exact, r.kv_len))
                        return


def serve(case: dict, speculative: bool) -> list[list[dict]]:
    """Both waves' outputs; checks that flushing the cache after each frees every page."""
    kw = dict(TINY, debug_check_invariants=True, **case["common"])
    kw.update(case["spec"] if speculative else dict(no_default_draft=True))
    waves = []
    errors = []
    with Engine(**kw) as e:
        if case["padded"]:
            from specserve.runtime.cuda_graphs import DecodeGraphs

            e.core.worker.graphs = DecodeGraphs(
                e.core.worker, case["padded"], max_width=4096, capture=False
            )
        if speculative:
            e.step_hooks.append(lambda core: check_draft_lag(core, errors))
            adaptive = e.core.adaptive
            rng = random.Random(case["tier_seed"])
            count = len(adaptive.tiers)

            def pick(b, can=True, ready=None):
                if case["obey_can"] and not can:
                    return 0
                share = case["plain_share"]
                if share is not None and rng.random() < share:
                    return 0  # long runs of plain steps fill the rings
                return rng.randrange(count)

            adaptive.pick = pick
            if case["never_pays"]:
                adaptive.speculation_pays = lambda b: False
        prompts = case["prompts"]
        for _ in range(2 if case["second_wave"] else 1):
            outs = e.generate(input_ids=prompts, sampling_params=case["params"], **case["logprobs"])
            waves.append(outs)
            assert not errors, errors
            assert all(o["finished"] for o in outs)
            e.flush_cache()
            stats = e.stats()
            assert stats["num_running_requests"] == stats["num_waiting_requests"] == 0
            assert stats["kv_used_tokens"] == 0 and stats["kv_cached_tokens"] == 0, stats
            alloc = e.core.table.allocator
            assert alloc.num_free_pages == alloc.num_usable_pages
            # the next turn: the prompt, the first sample's output, more of the user's
            samples = [p.get("n", 1) for p in case["params"]]
            firsts = [sum(samples[:i]) for i in range(len(prompts))]
            prompts = [
                p + outs[f]["output_ids"] + m for p, f, m in zip(prompts, firsts, case["more"])
            ]
    return waves


def assert_same_logprobs(got: dict, want: dict, where) -> None:
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key not in want:
            assert key not in got, where
            continue
        a, b = got[key], want[key]
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            if key == "output_top_logprobs":
                assert (x is None) == (y is None), where
                if x is None:
                    continue
                assert [t for _, t, _ in x] == [t for _, t, _ in y], where
                pairs = [(u[0], v[0]) for u, v in zip(x, y)]
            else:
                assert x[1] == y[1], where
                pairs = [(x[0], y[0])]
            for u, v in pairs:
                assert (u is None) == (v is None), where
                if u is not None and not (math.isinf(u) and u == v):
                    assert abs(u - v) <= 1e-4, (where, u, v)


def check_case(seed: int, root: str) -> dict:
    case = draw_case(random.Random(seed), root)
    plain = serve(case, False)
    got = serve(case, True)
    where = dict(seed=seed, spec=case["spec"], common=case["common"])
    assert len(got) == len(plain)
    for wave, (outs, ref) in enumerate(zip(got, plain)):
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref], (wave, where)
        for o, r in zip(outs, ref):
            assert o["meta_info"]["finish_reason"] == r["meta_info"]["finish_reason"], where
            assert_same_logprobs(o["meta_info"], r["meta_info"], (wave, where))
    return case


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(16))
def test_random_adaptive_configuration_decodes_as_plain(tmp_path, seed):
    check_case(seed, str(tmp_path))


# ---- the verification plan ------------------------------------------------------------------
def random_scored_trees(b: int, n: int, g: torch.Generator) -> DraftTrees:
    """Random trees whose path scores never grow from a parent to a child (as drafted)."""
    t = random_trees(b, n, max_depth=5, g=g)
    scores = torch.zeros(b, n)
    for i in range(1, n):
        step = -torch.rand(b, generator=g) * 2
        if float(torch.rand(1, generator=g)) < 0.3:
            step = torch.zeros(b)  # ties
        scores[:, i] = scores.gather(1, t.parents[:, i : i + 1]).squeeze(1) + step
    return DraftTrees(t.tokens, t.parents, t.depths, t.max_depth, scores)


@pytest.mark.parametrize("seed", range(200))
def test_random_verify_plans_keep_closed_trees_of_the_exact_total(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    b, n = rng.randint(1, 6), rng.randint(2, 12)
    trees = random_scored_trees(b, n, g)
    values = torch.rand(b, n, generator=g) * rng.choice([0.0, 1.0])
    plain = torch.rand(b, generator=g) < 0.3 if rng.random() < 0.5 else None
    speculating = b - (0 if plain is None else int(plain.sum()))
    room = b + speculating * (n - 1)  # every node of the speculating requests
    total = rng.randint(b, room if rng.random() < 0.8 else b * n)
    plan = plan_verify(trees, values, ranks_by_key(trees), plain, total)
    keep = plan.keep
    # the budget, or every node the speculating requests have (the rest of the fixed-size
    # forward is rows no tree keeps)
    assert int(keep.sum()) == min(total, room) and keep[:, 0].all()
    parents = trees.parents.clamp(min=0)
    assert not (keep[:, 1:] & ~keep.gather(1, parents)[:, 1:]).any()  # closed
    if plain is not None:
        assert not keep[plain, 1:].any()  # plain rows verify their root alone
    flat = keep.reshape(-1).nonzero().flatten()
    assert plan.packed[: len(flat)].tolist() == flat.tolist()
    assert len(set(plan.packed.tolist())) == total
    rows = plan.row_of.reshape(-1)[plan.packed]
    assert rows.tolist() == list(range(total))


# ---- draft-lag bookkeeping --------------------------------------------------------------
@pytest.mark.parametrize("seed", range(100))
def test_random_draft_lag_sequences(seed):
    """Against a model of what the device does: the draft is exact up to draft_len, which a
    catch-up moves to kv_len and a drafting step keeps there; a plain step adds to the lag.
    Requests join (their draft current) and finish between steps, as in a serving batch."""
    rng = random.Random(seed)
    cap = rng.randint(1, 6)
    lag = DraftLag(cap)
    joined = iter(range(10**6))

    def join() -> Request:
        r = Request(str(next(joined)), [1], SamplingParams(speculative=rng.random() < 0.8), seed=0)
        kv[r.rid] = draft_len[r.rid] = 1
        return r

    kv, draft_len = {}, {}
    reqs = [join() for _ in range(rng.randint(1, 4))]
    for _ in range(60):
        if rng.random() < 0.15:
            reqs.append(join())
        if len(reqs) > 1 and rng.random() < 0.1:
            reqs.pop(rng.randrange(len(reqs)))  # (finished)
        tier = rng.choice([0, 0, 1, 2])
        pays = rng.random() < 0.5
        step = lag.plan(reqs, tier, lambda pays=pays: pays)
        for r in reqs:
            n = 1 if tier == 0 or r.rid in step.stale else rng.randint(1, 3)
            speculating = r.rid not in step.stale
            if step.catch_up and speculating:
                assert kv[r.rid] - draft_len[r.rid] <= cap  # the ring holds the whole lag
                draft_len[r.rid] = kv[r.rid]
            if tier > 0 and speculating:  # (drafting needs the draft current)
                assert draft_len[r.rid] == kv[r.rid], (r.rid, step)
            if tier == 0 and speculating:
                assert kv[r.rid] - draft_len[r.rid] < cap  # room in the ring for this one
            kv[r.rid] += n
            if tier > 0 and speculating:  # drafting: the draft extends over what it emits
                draft_len[r.rid] = kv[r.rid]
            DraftLag.applied(step, r, n)
            if speculating:
                assert r.draft_behind == kv[r.rid] - draft_len[r.rid]
            else:
                assert r.draft_behind >= kv[r.rid] - draft_len[r.rid]
