"""Shared helpers for engine-level tests: tiny models on disk and reference checks."""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch

from specserve.kv.pool import KVCache
from specserve.model.runner import ModelRunner
from specserve.ops.attention import TorchAttentionBackend
from specserve.ops.attention_metadata import Segment, build_metadata
from specserve.speculative.tree import DraftTrees

TINY = dict(
    model_path="tiny", load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu"
)
# the same tiny model on CUDA, float32 (exact comparisons), a fixed KV budget
GPU_TINY = dict(TINY, device="cuda", max_total_tokens=8192)


def write_dummy_config(folder: str, **overrides) -> str:
    """An HF-style config.json only: load it with load_format='dummy' for random weights."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "eos_token_id": 2,
    }
    cfg.update(overrides)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def mixed_prompts(
    n: int, vocab: int, seed: int = 0, min_len: int = 1, max_len: int = 40
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lens]


def plain_forward(model, tokens: list[int]):
    """A plain causal prefill of `tokens` into a fresh cache: (cache, ModelOutput)."""
    cfg = model.config
    n = len(tokens)
    cache = KVCache(
        cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, next(model.parameters()).dtype, "cpu"
    )
    slots = torch.arange(n)
    meta = build_metadata([Segment(slots, n, n)], slots, torch.device("cpu"))
    out = ModelRunner(model, cache, TorchAttentionBackend()).forward(
        torch.tensor(tokens), torch.arange(n), meta
    )
    return cache, out


def reference_kv(model, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V of every layer for a plain causal prefill of `tokens`."""
    cache, _ = plain_forward(model, tokens)
    return cache.k, cache.v


def assert_kv_matches_plain_prefill(core, atol: float = 1e-4) -> int:
    """Every running request's cached target KV equals a plain prefill of its tokens."""
    checked = 0
    for req in core.scheduler.running:
        if req.finished:  # waiting for its last launched step; its KV is no longer read
            continue
        tokens = req.all_ids[: req.kv_len]
        ref_k, ref_v = reference_kv(core.runner.model, tokens)
        slots = core.table.slots(req.rid, 0, req.kv_len)
        for layer in range(len(ref_k)):
            torch.testing.assert_close(
                core.kv_cache.k[layer][slots], ref_k[layer], atol=atol, rtol=1e-4
            )
            torch.testing.assert_close(
                core.kv_cache.v[layer][slots], ref_v[layer], atol=atol, rtol=1e-4
            )
        checked += 1
    return checked


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """float32 logits [len(tokens), vocab] of a plain causal forward."""
    _, out = plain_forward(model, tokens)
    with torch.inference_mode():
        return model.compute_logits(out.hidden)


def spec_args(
    draft: str, topk: int, steps: int, ndt: int, algorithm: str | None = None, **extra
) -> dict:
    """Engine arguments for speculative decoding: "tiny" is a STANDALONE draft (the target
    itself), anything else an EAGLE checkpoint folder unless `algorithm` says otherwise."""
    return dict(
        speculative_algorithm=algorithm or ("STANDALONE" if draft == "tiny" else "EAGLE"),
        speculative_draft_model_path=draft,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
        **extra,
    )


def random_trees(bsz: int, n: int, max_depth: int, g: torch.Generator) -> DraftTrees:
    """Random trees in topological order (parent id < child id), depth <= max_depth."""
    parents = torch.full((bsz, n), -1, dtype=torch.int64)
    depths = torch.zeros((bsz, n), dtype=torch.int64)
    for b in range(bsz):
        for i in range(1, n):
            while True:
                p = int(torch.randint(0, i, (1,), generator=g))
                if depths[b, p] < max_depth:
                    break
            parents[b, i], depths[b, i] = p, depths[b, p] + 1
    tokens = torch.arange(n).repeat(bsz, 1)  # siblings carry distinct tokens
    return DraftTrees(tokens, parents, depths, max_depth)


def target_following_random_paths(trees: DraftTrees, g: torch.Generator) -> torch.Tensor:
    """At each node the target draws one of its children's tokens (or, one time in ten or at
    a leaf, a token no child has), so accepted paths of every length occur."""
    bsz, n = trees.tokens.shape
    target = torch.full((bsz, n), -1, dtype=torch.int64)
    for b in range(bsz):
        for i in range(n):
            children = (trees.parents[b] == i).nonzero().flatten()
            if len(children) and float(torch.rand(1, generator=g)) > 0.1:
                pick = children[int(torch.randint(0, len(children), (1,), generator=g))]
                target[b, i] = trees.tokens[b, pick]
    return target


@contextlib.contextmanager
def recorded_drafts():
    """Yields a list that collects the drafted tokens ([B, N - 1], the root left out) of every
    `TreeDrafter.draft` call made eagerly inside the block (graph replays do not call it)."""
    from specserve.speculative.drafter import TreeDrafter

    drafted: list[torch.Tensor] = []
    real_draft = TreeDrafter.draft

    def recording_draft(self, batch, shape=None, **kw):
        trees = real_draft(self, batch, shape, **kw)
        drafted.append(trees.tokens[:, 1:].cpu())
        return trees

    TreeDrafter.draft = recording_draft
    try:
        yield drafted
    finally:
        TreeDrafter.draft = real_draft


def draft_prefill_snapshots(prompt: list[int], engine_kwargs: dict, setup=None) -> list[tuple]:
    """Prefill `prompt` (one request, 2 new tokens) in an EngineCore built from
    `engine_kwargs` (`setup(core)` may change it first); after every prefill chunk record
    (chunk end, the draft's KV of the request's slots, its root state or None)."""
    from specserve.config import EngineConfig
    from specserve.runtime.engine_core import EngineCore
    from specserve.runtime.request import Request
    from specserve.sampling_params import SamplingParams

    core = EngineCore(EngineConfig.from_kwargs(**engine_kwargs).resolve())
    if setup is not None:
        setup(core)
    worker, drafter = core.worker, core.worker.drafter
    taken = []
    real_prefill = worker.prefill

    def prefill(chunks):
        result = real_prefill(chunks)
        c = chunks[0]
        slots = core.table.slots(c.req.rid, 0, c.end).to(drafter.kv.buffer.device)
        root = core.rows.features[core.rows.row(c.req.rid)].clone() if result else None
        taken.append((c.end, drafter.kv.buffer[:, :, slots].clone(), root))
        return result

    worker.prefill = prefill
    sp = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    core.add_request(Request("a", list(prompt), sp, seed=0))
    while core.has_work():
        core.step()
    return taken


def assert_same_draft_prefill(got: list[tuple], want: list[tuple], tol: float = 1e-5) -> None:
    assert [end for end, _, _ in got] == [end for end, _, _ in want]
    for (_, kv_got, root_got), (_, kv_want, root_want) in zip(got, want):
        torch.testing.assert_close(kv_got, kv_want, rtol=tol, atol=tol)
        assert (root_got is None) == (root_want is None)
        if root_want is not None:
            torch.testing.assert_close(root_got, root_want, rtol=tol, atol=tol)
    assert want[-1][2] is not None  # the prompt's last chunk left a root state


def padded_graphs(engine, max_bs: int = 4):
    """Give the engine's worker CUDA-graph bookkeeping that runs its padded, fixed-shape steps
    eagerly (how graph shapes are tested without CUDA); returns it."""
    from specserve.runtime.cuda_graphs import DecodeGraphs

    worker = engine.core.worker
    worker.graphs = DecodeGraphs(worker, max_bs, max_width=4096, capture=False)
    return worker.graphs


def wait_for_idle_captures(graphs, timeout: float = 60.0) -> None:
    """Until the idle engine has captured every decode graph its steps wanted (covered)."""
    deadline = time.monotonic() + timeout
    while graphs.wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not graphs.wanted, "the idle engine did not capture the covered shapes"


def record_graph_steps(graphs) -> list[tuple[int, str]]:
    """Wrap `graphs.run`: every decode step appends (its rows, how it ran: "own" graph,
    "covered" by a larger one, "captured" on the spot, "eager" where nothing covered its
    shape yet, or "unpadded": left to the caller's eager step) to the returned list."""
    steps: list[tuple[int, str]] = []
    run = graphs.run

    def recording_run(rows, sampling, width, tier=0, catch_up=False):
        out = run(rows, sampling, width, tier, catch_up)
        how = (
            "unpadded"
            if out is None
            else "covered"
            if graphs.covered_last
            else "captured"
            if graphs.captured_last
            else "eager"
            if graphs.eager_last
            else "own"
        )
        steps.append((len(rows), how))
        return out

    graphs.run = recording_run
    return steps


def check_plain_next_turn_reuse(base: dict, eagle: str, page_size: int, greedy: dict) -> None:
    """Under load-adaptive speculation, turn one asks for no drafts (so its answer has no draft
    KV); turn two, plain too, reuses the answer from the cache; a speculating request on the
    same history stops where the draft's KV ends (the prompt). Every output equals an
    engine's without a cache. base: the engine's model and device arguments."""
    from specserve import Engine

    g = torch.Generator().manual_seed(page_size)
    first = torch.randint(3, 500, (40,), generator=g).tolist()
    plain = {**greedy, "speculative": False}
    spec = dict(spec_args(eagle, 2, 3, 6), speculative_adaptive=True, page_size=page_size)
    with Engine(**base, **spec, disable_radix_cache=True) as uncached:
        answer = uncached.generate(input_ids=first, sampling_params=plain)["output_ids"]
        history = first + answer + [7, 8, 9]
        want = uncached.generate(input_ids=history, sampling_params=greedy)["output_ids"]
    with Engine(**base, **spec) as e:
        e.core.scheduler.will_decode_plainly = lambda req: not req.params.speculative
        assert e.generate(input_ids=first, sampling_params=plain)["output_ids"] == answer
        turn2 = e.generate(input_ids=history, sampling_params=plain)
        cached = turn2["meta_info"]["cached_tokens"]
        assert cached >= len(first) + len(answer) - page_size, (cached, len(first + answer))
        assert turn2["output_ids"] == want
        speculating = e.generate(input_ids=history, sampling_params=greedy)
        assert speculating["meta_info"]["cached_tokens"] <= len(first)
        assert speculating["output_ids"] == want
        assert assert_kv_matches_plain_prefill(e.core) == 0
        assert e.stats()["speculative_adaptive"]["started_plainly_from_cache"] == 1
        e.flush_cache()
        e.core.check_invariants()
