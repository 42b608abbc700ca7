"""Prefills in CUDA-graph shape: a single request's chunk padded to a token bucket, its KV
slots read on the device from its row, padding tokens writing only the scratch slot.

On CPU the padded forward runs eagerly (`PrefillGraphs(capture=False)`): everything a graph
replays except the capture itself (tests/test_gpu.py captures on CUDA). Outputs must equal
eager prefills token for token, and every running request's KV must stay equal to a plain
prefill of its tokens after every step (a padding write into a live slot would break it),
with chunked prompts (chunks starting past 0), decodes in between, and every page size."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.errors import InvalidArgument
from specserve.runtime.prefill_graphs import PrefillGraphs
from tests.engine_utils import (
    TINY,
    assert_kv_matches_plain_prefill,
    assert_same_draft_prefill,
    draft_prefill_snapshots,
    mixed_prompts,
    spec_args,
)


def generate(prompts, sps, padded: bool, max_tokens: int = 64, **kw):
    """Outputs, the graph shapes used, and how many steps had their KV checked."""
    checked = []
    with Engine(**TINY, debug_check_invariants=True, **kw) as e:
        worker = e.core.worker
        assert worker.prefill_graphs is None  # CPU: graphs are off by default
        if padded:
            worker.prefill_graphs = PrefillGraphs(
                worker, max_tokens, max_width=e.core.context_len, capture=False
            )
        e.step_hooks.append(lambda core: checked.append(assert_kv_matches_plain_prefill(core)))
        outs = e.generate(input_ids=prompts, sampling_params=sps)
        shapes = sorted(worker.prefill_graphs.graphs) if padded else []
        assert e.stats()["kv_used_tokens"] == 0
    return [o["output_ids"] for o in outs], shapes, sum(checked)


def params(n: int):
    out = []
    for i in range(n):
        sp = {"max_new_tokens": 4 + 3 * i, "ignore_eos": True, "temperature": 0.0}
        if i % 2:
            sp.update(temperature=0.8, top_k=10, seed=7 + i)
        out.append(sp)
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_chunked_prefills_padded_equal_eager(page_size):
    """Chunks of 24 tokens one request at a time (the single-chunk case the graphs take),
    starting at 0 and past it; prompts up to 90 tokens, decodes interleaved."""
    prompts = mixed_prompts(5, 512, seed=41, min_len=3, max_len=90)
    kw = dict(page_size=page_size, chunked_prefill_size=24, max_running_requests=3)
    eager, _, _ = generate(prompts, params(5), padded=False, **kw)
    padded, shapes, checked = generate(prompts, params(5), padded=True, **kw)
    assert padded == eager
    assert checked > 10
    assert {t for t, _ in shapes} >= {16, 32}  # 24-token chunks and shorter tails


@pytest.fixture(scope="module")
def eagle_drafts(tmp_path_factory):
    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint

    root = tmp_path_factory.mktemp("drafts")
    return {
        kind: write_random_eagle_checkpoint(str(root / kind), PRESETS["tiny"], kind, seed=3)
        for kind in ("EAGLE", "EAGLE3")
    }


@pytest.mark.parametrize(
    "draft, topk, steps, ndt",
    [("tiny", 1, 3, 4), ("tiny", 3, 2, 7), ("EAGLE", 2, 3, 6), ("EAGLE3", 1, 3, 4)],
)
def test_speculative_prefills_padded_equal_plain(eagle_drafts, draft, topk, steps, ndt):
    """The draft's own prefill reads the graph's outputs (views of its static buffers): the
    final hidden states (EAGLE), the captured layers' inputs (EAGLE3), or nothing (a
    standalone draft)."""
    prompts = mixed_prompts(4, 512, seed=42, min_len=2, max_len=70)
    kw = dict(page_size=3, chunked_prefill_size=32, max_running_requests=2)
    plain, _, _ = generate(prompts, params(4), padded=False, **kw)
    spec_kw = spec_args(eagle_drafts.get(draft, draft), topk, steps, ndt)
    if draft == "EAGLE3":
        spec_kw["speculative_algorithm"] = "EAGLE3"
    spec, shapes, _ = generate(prompts, params(4), padded=True, **kw, **spec_kw)
    assert spec == plain  # lossless: speculative output equals plain decoding
    assert shapes


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_few_prompts_together_replay_a_graph_each(eagle_drafts, page_size):
    """Prompts admitted together, up to MAX_GRAPHED_PREFILL_CHUNKS, replay one prefill graph
    each (a cached prefix's copied page among them); more than that run as one eager batch.
    Either way the tokens are those of eager batched prefills."""
    from specserve.runtime.worker import MAX_GRAPHED_PREFILL_CHUNKS as most

    shared = mixed_prompts(1, 512, seed=44, min_len=9, max_len=9)[0]
    prompts = [shared + p for p in mixed_prompts(most, 512, seed=45, min_len=2, max_len=30)]
    kw = dict(page_size=page_size, **spec_args(eagle_drafts["EAGLE"], 2, 3, 6))
    for group in (prompts, prompts + mixed_prompts(2, 512, seed=46)):
        sps = params(len(group))
        with Engine(**TINY, debug_check_invariants=True, **kw) as e:
            worker = e.core.worker
            graphs = worker.prefill_graphs = PrefillGraphs(worker, 64, e.core.context_len, False)
            e.generate(input_ids=[shared], sampling_params=sps[:1])  # caches the prefix
            replays = []
            graphs.forward = _counting(graphs.forward, replays)
            outs = e.generate(input_ids=group, sampling_params=sps)
        expected, _, _ = generate(group, sps, padded=False, **kw)
        assert [o["output_ids"] for o in outs] == expected
        assert len(replays) == (len(group) if len(group) <= most else 0)


def _counting(fn, calls: list):
    def counted(*args):
        calls.append(args)
        return fn(*args)

    return counted


def test_longer_chunks_than_the_graphs_take_run_eagerly():
    prompts = mixed_prompts(2, 512, seed=43, min_len=40, max_len=60)
    eager, _, _ = generate(prompts, params(2), padded=False, max_running_requests=1)
    padded, shapes, _ = generate(
        prompts, params(2), padded=True, max_tokens=32, max_running_requests=1
    )
    assert padded == eager
    assert shapes == []  # 40-60 token prompts in one chunk: above the 32-token limit


def test_prefill_graph_limit_is_validated():
    with pytest.raises(InvalidArgument, match="cuda_graph_max_prefill_tokens"):
        Engine(**TINY, cuda_graph_max_prefill_tokens=-1)


def test_padding_never_writes_a_stale_page_of_its_row():
    """Past a request's pages its row may still name pages of the row's previous owner, now
    another live request's. A short prompt's padding positions fall there: they must write
    the scratch slot, leaving the other request's KV intact."""
    from specserve.config import EngineConfig
    from specserve.runtime.engine_core import EngineCore
    from specserve.runtime.request import Request
    from specserve.sampling_params import SamplingParams

    core = EngineCore(EngineConfig.from_kwargs(**TINY, page_size=2).resolve())
    worker, rows = core.worker, core.rows
    worker.prefill_graphs = PrefillGraphs(worker, 64, max_width=core.context_len, capture=False)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    long_prompt, short_prompt = mixed_prompts(2, 512, seed=44, min_len=3, max_len=3)
    long_prompt = long_prompt * 10
    core.add_request(Request("b", long_prompt, sp, seed=0))
    while not core.requests["b"].output_ids:
        core.step()

    poisoned = []
    add_pages = rows.on_pages_added

    def stale_row(rid, first_index, pages):
        add_pages(rid, first_index, pages)
        if rid == "c" and "b" in core.table._pages:  # later entries still name b's pages
            b_pages = core.table._pages["b"]
            end = first_index + len(pages)
            rows.pages[rows.row("c"), end : end + len(b_pages)] = torch.tensor(b_pages)
            poisoned.append(end)

    rows.on_pages_added = stale_row
    core.add_request(Request("c", short_prompt, sp, seed=0))
    checked = 0
    while core.has_work():
        core.step()
        checked += assert_kv_matches_plain_prefill(core)
    assert poisoned and checked > 0
    assert worker.prefill_graphs.graphs  # c's 3-token prompt took the padded path


def test_padding_never_reads_stale_kv():
    """Masked keys still enter the attention sums at weight 0, and 0 * NaN is NaN: padding
    positions must not read slots past the request's KV (freed pages, a page's unused tail),
    whatever they hold. Every slot starts as NaN here; each prefill writes its own."""
    prompts = mixed_prompts(3, 512, seed=45, min_len=2, max_len=11)
    outs = []
    for padded in (False, True):
        with Engine(**TINY, page_size=4, max_running_requests=1) as e:
            worker = e.core.worker
            if padded:
                worker.prefill_graphs = PrefillGraphs(
                    worker, 64, max_width=e.core.context_len, capture=False
                )
            e.core.kv_cache.buffer.fill_(float("nan"))
            res = e.generate(input_ids=prompts, sampling_params=params(3))
            outs.append([o["output_ids"] for o in res])
    assert outs[1] == outs[0]


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_replayed_draft_prefill_writes_the_eager_draft_kv_and_root(eagle_drafts, kind, chunk):
    """An EAGLE/EAGLE3 draft's prefill runs in graph shape after the target's (token x_{j+1}
    with h_j at position j; the token after the chunk is the sampled one, or for a chunk that
    does not complete the prompt, the prompt's own). After every prefill chunk the draft's KV
    of the request and its root state equal the eager path's (tests/test_gpu.py: captured)."""
    prompt = mixed_prompts(1, 512, seed=46, min_len=40, max_len=40)[0]
    kw = dict(**TINY, page_size=4, chunked_prefill_size=chunk)
    kw.update(spec_args(eagle_drafts[kind], 2, 3, 6), speculative_algorithm=kind)

    def padded(core):
        core.worker.prefill_graphs = PrefillGraphs(
            core.worker, 64, max_width=core.context_len, capture=False
        )

    eager = draft_prefill_snapshots(prompt, kw)
    graphed = draft_prefill_snapshots(prompt, kw, padded)
    assert len(eager) == -(-40 // chunk)
    assert_same_draft_prefill(graphed, eager)


@pytest.mark.parametrize(
    "max_tokens, chunk, shapes",
    [
        (64, None, [(16, 256), (32, 256), (64, 256)]),
        (100, None, [(16, 256), (32, 256), (64, 256), (128, 256)]),  # (100 pads to 128)
        (512, 48, [(16, 256), (32, 256), (64, 256)]),  # (no chunk is longer than 48)
    ],
)
def test_every_chunk_length_is_ready_at_start_and_serves_real_prompts(max_tokens, chunk, shapes):
    """Start-up capture makes one shape per chunk-length bucket up to the limit (the graphs'
    and the scheduler's chunk size), at its shortest width, from padding alone; requests then
    prefill through those shapes with the tokens of eager prefills (CPU: the padded forward
    runs eagerly)."""
    prompts = mixed_prompts(4, 512, seed=43, min_len=3, max_len=min(max_tokens, 120))
    sps = params(4)
    kw = dict(page_size=4, max_running_requests=1, chunked_prefill_size=chunk or -1)
    eager, _, _ = generate(prompts, sps, padded=False, **kw)
    with Engine(**TINY, **kw) as e:
        worker = e.core.worker
        graphs = PrefillGraphs(worker, max_tokens, max_width=e.core.context_len, capture=False)
        layers = worker.drafter.capture_layers
        assert graphs.capture_at_start(layers, chunk) == len(shapes)
        assert sorted(graphs.graphs) == shapes
        assert graphs.capture_at_start(layers, chunk) == 0  # (kept)
        worker.prefill_graphs = graphs
        outs = e.generate(input_ids=prompts, sampling_params=sps)
        assert sorted(graphs.graphs) == shapes  # (short prompts: no shape beyond them)
    assert [o["output_ids"] for o in outs] == eager


def test_a_chunk_without_memory_for_its_graph_prefills_eagerly_and_fails_no_request():
    """A prefill capture that runs out of device memory (at start or while serving) leaves
    that chunk length to eager prefills: every request gets the tokens of eager prefills,
    the other lengths replay their graphs, and the failed one is not tried again."""
    prompts = mixed_prompts(4, 512, seed=44, min_len=20, max_len=30)  # (32-token chunks)
    sps = params(4)
    kw = dict(page_size=4, max_running_requests=1)
    eager, _, _ = generate(prompts, sps, padded=False, **kw)
    with Engine(**TINY, **kw) as e:
        worker = e.core.worker
        graphs = PrefillGraphs(worker, 64, max_width=e.core.context_len, capture=False)
        capture, tried = graphs._capture, []

        def capture_out_of_memory_at_32_tokens(tokens, width, layers):
            if tokens != 32:
                return capture(tokens, width, layers)
            tried.append((tokens, width))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

        graphs._capture = capture_out_of_memory_at_32_tokens
        # start: 16 captured, 32 out of memory, so 64 left to serving (longer chunks need more)
        assert graphs.capture_at_start(worker.drafter.capture_layers, None) == 1
        worker.prefill_graphs = graphs
        outs = e.generate(input_ids=prompts, sampling_params=sps)
    assert [o["output_ids"] for o in outs] == eager
    assert tried == [(32, 256)]  # (at start alone: serving does not try again)
    assert all(t != 32 for t, _ in graphs.graphs)
