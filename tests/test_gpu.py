"""The same engine on CUDA: losslessness, sync-free sampling, the Triton backend end to end."""

from __future__ import annotations

import pytest
import torch

from specserve import Engine
from specserve.config.kernels import REFERENCE, Kernels
from specserve.ops.sampling import SamplingTensors, sample
from tests.engine_utils import (
    GPU_TINY,
    assert_same_draft_prefill,
    draft_prefill_snapshots,
    mixed_prompts,
    recorded_drafts,
    wait_for_idle_captures,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU = GPU_TINY
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_matches_cpu_and_speculation_is_lossless(backend, page_size):
    prompts = mixed_prompts(6, 512, seed=4)
    with Engine(**GPU, attention_backend=backend, page_size=page_size) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    for topk, ndt in [(1, 4), (8, 16)]:
        with Engine(
            **GPU,
            attention_backend=backend,
            page_size=page_size,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path="tiny",
            speculative_num_steps=3,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=ndt,
            debug_check_invariants=True,
        ) as e:
            spec = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
            assert e.stats()["spec_accept_length"] > 3.5  # the model is its own draft
        assert spec == plain


@pytest.mark.parametrize("kernels", [REFERENCE, Kernels(sampling_reductions=True)])
@pytest.mark.parametrize("filtered", [True, False])
def test_sampling_has_no_host_sync(kernels, filtered):
    logits = torch.randn(8, 1000, device="cuda")
    st = SamplingTensors(
        temperatures=torch.full((8,), 0.7, device="cuda"),
        top_ks=torch.full((8,), 50 if filtered else -1, device="cuda", dtype=torch.int64),
        top_ps=torch.full((8,), 0.9 if filtered else 1.0, device="cuda"),
        min_ps=torch.zeros(8, device="cuda"),
        seeds=torch.arange(8, device="cuda"),
        all_greedy=False,
        needs_filter=filtered,
    )
    positions = torch.arange(8, device="cuda")
    sample(logits, st, positions, kernels)  # (compiles first)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, st, positions, kernels)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (8,)


def test_bf16_default_dtype_runs_speculatively():
    with Engine(
        model_path="tiny",
        load_format="dummy",
        skip_tokenizer_init=True,
        max_total_tokens=8192,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="tiny",
        speculative_num_steps=3,
        speculative_eagle_topk=4,
        speculative_num_draft_tokens=8,
    ) as e:
        assert e.resolved_args()["dtype"] == "bfloat16"
        assert e.resolved_args()["attention_backend"] == "triton"
        out = e.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert len(out["output_ids"]) == 24


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("topk, ndt", [(1, 4), (8, 16)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_steps_launch_without_host_sync(topk, ndt, page_size, graphs):
    """Draft, verify, KV commit and draft extend are launched under sync-debug 'error' mode,
    with overlap on (the host applies each step one step later), replayed from CUDA graphs
    or eager."""
    engine = Engine(
        **GPU,
        attention_backend="triton",
        page_size=page_size,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path="tiny",
        speculative_num_steps=3,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
        disable_cuda_graph=not graphs,
    )
    prompts = mixed_prompts(8, 512, seed=5)
    if graphs:  # capture (which synchronises once per shape) before the strict run
        engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 64})
        wait_for_idle_captures(engine.core.worker.graphs, timeout=120)
        assert engine.core.worker.graphs.num_captures > 0
    worker = engine.core.worker
    launch = worker.launch_decode
    launched = []

    def strict_launch(reqs, kv_upper, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = launch(reqs, kv_upper, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launched.append(len(reqs))
        return pending

    worker.launch_decode = strict_launch
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 64})
        ahead = engine.core.num_launched_ahead
    finally:
        engine.shutdown()
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert len(launched) >= 10 and ahead > 0


def _outputs(prompts, sps, **kw):
    with Engine(**GPU, attention_backend="triton", **kw) as e:
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sps)]
        graphs = e.core.worker.graphs
        captures = graphs.num_captures if graphs is not None else 0
        stats = e.stats()
    return outs, captures, stats


SPEC = dict(
    speculative_algorithm="STANDALONE",
    speculative_draft_model_path="tiny",
    speculative_num_steps=3,
)


@pytest.mark.parametrize(
    "spec",
    [{}, dict(SPEC, speculative_eagle_topk=1, speculative_num_draft_tokens=4),
     dict(SPEC, speculative_eagle_topk=8, speculative_num_draft_tokens=16)],
)  # fmt: skip
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graphs_match_eager(spec, page_size):
    """Replayed graphs (padded batches, bucketed widths) give the eager engine's tokens, for
    greedy and seeded sampling, while the batch shrinks through the buckets. (Contexts past
    the shortest width: the graphs captured at start do not serve them.)"""
    prompts = mixed_prompts(11, 512, seed=6, min_len=260, max_len=300)
    sps = [
        {"max_new_tokens": 8 + 4 * i, "ignore_eos": True, "temperature": 0.8 * (i % 2), "seed": i}
        for i in range(11)
    ]
    eager, none, _ = _outputs(prompts, sps, page_size=page_size, disable_cuda_graph=True, **spec)
    assert none == 0
    with Engine(**GPU, attention_backend="triton", page_size=page_size, **spec) as e:
        graphs = e.core.worker.graphs
        covered = e.generate(input_ids=prompts, sampling_params=sps)  # the tail on covers
        wait_for_idle_captures(graphs, timeout=120)
        assert graphs.num_idle_captures > 0  # (so the first pass did run on covers)
        own = e.generate(input_ids=prompts, sampling_params=sps)  # every shape its own graph
        assert graphs.num_captures + graphs.num_idle_captures >= 3
    assert [o["output_ids"] for o in covered] == [o["output_ids"] for o in own] == eager


@pytest.mark.parametrize("spec", [{}, dict(SPEC, speculative_eagle_topk=4)])
def test_decode_captures_out_of_device_memory_leave_steps_eager_and_fail_no_request(
    monkeypatch, spec
):
    """Every other decode capture runs out of device memory inside the capture itself (as a
    large sampled tree step did while serving), beside graphs alive in the same pool: engine
    start and serving leave those shapes to eager steps, the device stays usable, and every
    request gets the eager engine's tokens."""
    from specserve.runtime import cuda_graphs

    capture, captures = cuda_graphs.capture_graph, []

    def capture_needing_more_than_the_device(fn, pool, device):
        captures.append(None)
        if len(captures) % 2:
            return capture(fn, pool, device)
        runs = []

        def step():
            out = fn()
            runs.append(None)
            if len(runs) == 3:  # (the captured run: the two warm-up runs went first)
                too_much = 2 * torch.cuda.get_device_properties(device).total_memory
                torch.empty(too_much, dtype=torch.uint8, device=device)
            return out

        return capture(step, pool, device)

    monkeypatch.setattr(cuda_graphs, "capture_graph", capture_needing_more_than_the_device)
    prompts = mixed_prompts(6, 512, seed=16, min_len=4, max_len=300)
    sps = [
        {"max_new_tokens": 12 + 4 * i, "ignore_eos": True, "temperature": 0.8 * (i % 2), "seed": i}
        for i in range(6)
    ]
    with Engine(**GPU, attention_backend="triton", **spec) as e:
        graphs = e.core.worker.graphs
        assert graphs.graphs and graphs._no_memory  # (half fitted at start)
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sps)]
        wait_for_idle_captures(graphs, timeout=120)
        assert e.generate(input_ids=prompts, sampling_params=sps)[0]["output_ids"] == outs[0]
    monkeypatch.undo()
    eager, _, _ = _outputs(prompts, sps, disable_cuda_graph=True, **spec)
    assert outs == eager


def test_cuda_graphs_simulated_acceptance_draws_fresh_lengths():
    """The simulated length counter lives on the device: replays draw new lengths."""
    prompts = mixed_prompts(16, 512, seed=7, min_len=2, max_len=8)
    sp = {"temperature": 0, "max_new_tokens": 96, "ignore_eos": True}
    kw = dict(SPEC, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    _, captures, stats = _outputs(
        prompts, sp, simulate_acc_len=2.3, simulate_acc_method="match-expected", **kw
    )
    assert captures > 0
    assert abs(stats["spec_accept_length"] - 2.3) < 0.1, stats


@pytest.mark.parametrize("spec", [{}, dict(SPEC, speculative_eagle_topk=4)])
def test_short_requests_at_every_batch_size_run_on_graphs_captured_at_start(spec):
    """Every batch bucket a batch can meet and every prefill length bucket a chunk can have
    are captured before the first request (their kernels compile then, not in a request's
    time): short requests alone and batched, greedy or at the default sampling (temperature
    1, no filter) alone or mixed in a batch, need no capture while they are served."""
    spec = dict(spec, speculative_num_draft_tokens=8) if spec else spec
    kw = dict(max_running_requests=8, cuda_graph_max_bs=32, chunked_prefill_size=100)
    with Engine(**GPU, attention_backend="triton", **kw, **spec) as e:
        graphs, prefill = e.core.worker.graphs, e.core.worker.prefill_graphs
        assert graphs.buckets == [1, 2, 4, 8, 16, 32]
        assert sorted({key[0] for key in graphs.graphs}) == [1, 2, 4, 8]  # (8 at most)
        assert sorted(prefill.graphs) == [(16, 256), (32, 256), (64, 256), (128, 256)]
        at_start = graphs.num_captures, prefill.num_captures
        sampled = dict(GREEDY, temperature=1.0)
        for n, params in ((1, GREEDY), (3, GREEDY), (8, GREEDY), (1, sampled), (5, sampled)):
            prompts = mixed_prompts(n, 512, seed=n, min_len=4, max_len=40)
            mixed = [params if i % 2 == 0 else GREEDY for i in range(n)]
            outs = e.generate(input_ids=prompts, sampling_params=mixed)
            assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)
        assert (graphs.num_captures, prefill.num_captures) == at_start


@pytest.mark.parametrize(
    "spec", [{}, dict(SPEC, speculative_eagle_topk=4, speculative_num_draft_tokens=8)]
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_graphs_match_eager_prefill(spec, page_size):
    """Single-chunk prefills replayed from captured graphs (chunks starting at 0 and past it,
    while other requests decode) give the tokens of eager prefills."""
    prompts = mixed_prompts(6, 512, seed=9, min_len=2, max_len=150)
    sps = [
        {"max_new_tokens": 6 + 3 * i, "ignore_eos": True, "temperature": 0.8 * (i % 2), "seed": i}
        for i in range(6)
    ]
    kw = dict(page_size=page_size, chunked_prefill_size=48, max_running_requests=2,
              debug_check_invariants=True, **spec)  # fmt: skip
    runs = []
    for limit in (0, 64):
        with Engine(**GPU, cuda_graph_max_prefill_tokens=limit, **kw) as e:
            graphs, replays = e.core.worker.prefill_graphs, []
            if graphs is not None:  # (count the chunks a graph ran: not those captured)

                def counted(*args, forward=graphs.forward, seen=replays):
                    out = forward(*args)
                    seen.append(out is not None)
                    return out

                graphs.forward = counted
            outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sps)]
            runs.append((outs, sum(replays)))
    (eager, none), (graphed, replayed) = runs
    assert none == 0 and replayed > 0
    assert graphed == eager


@pytest.mark.parametrize(
    "spec", [{}, dict(SPEC, speculative_eagle_topk=4, speculative_num_draft_tokens=8)]
)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefill_graph_tokens", [0, 64])
def test_prefills_beside_the_step_in_flight_match_drained_steps(
    spec, page_size, prefill_graph_tokens
):
    """On the device, prompts prefilled while a decode step is still running (queued behind
    it, graphed or eager, new requests and a long prompt's later chunks, prefixes from the
    cache) give the tokens of the engine without overlap."""
    shared = mixed_prompts(1, 512, seed=12, min_len=40, max_len=40)[0]
    prompts = mixed_prompts(8, 512, seed=13, min_len=2, max_len=150)
    prompts += [shared + p for p in mixed_prompts(6, 512, seed=14, min_len=1, max_len=20)]
    sps = [
        {
            "max_new_tokens": 6 + 5 * (i % 6),
            "ignore_eos": True,
            "temperature": 0.8 * (i % 2),
            "seed": i,
        }
        for i in range(len(prompts))
    ]
    kw = dict(page_size=page_size, chunked_prefill_size=48, max_running_requests=4,
              cuda_graph_max_prefill_tokens=prefill_graph_tokens, debug_check_invariants=True,
              **spec)  # fmt: skip
    drained, _, _ = _outputs(prompts, sps, disable_overlap_schedule=True, **kw)
    beside, _, stats = _outputs(prompts, sps, **kw)
    assert stats["num_prefill_batches_beside_decode"] > 0
    assert beside == drained


@pytest.mark.parametrize("ndt", [16, 48, 64, 65, 128, 200])
def test_self_draft_accepts_every_depth_for_every_tree_size(ndt):
    """The target as its own draft (float32) must accept nearly its whole depth at every tree
    size: a verify mask or kernel tile that mishandles some node count shows up as lost
    acceptance here long before it shows up in outputs."""
    steps = 6
    prompts = mixed_prompts(4, 512, seed=10, min_len=4, max_len=40)
    sp = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}
    with Engine(**GPU) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
    with Engine(**GPU, **dict(SPEC, speculative_num_steps=steps), speculative_eagle_topk=8,
                speculative_num_draft_tokens=ndt) as e:  # fmt: skip
        spec = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=sp)]
        accept = e.stats()["spec_accept_length"]
    assert spec == plain
    assert accept > 0.9 * (steps + 1), accept


@pytest.mark.parametrize("kind", ["EAGLE3", "EAGLE+token_map", "EAGLE+token_map+growth"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_reduced_draft_vocabularies_are_lossless_on_cuda(tmp_path, kind, page_size):
    """EAGLE3's d2t and an EAGLE token map both reach the top-k kernel as its id map: outputs
    equal plain decoding (graphs and eager), and drafted tokens are target ids of the reduced
    vocabulary (read from the files, not from the engine); a growing map also drafts the
    requests' own tokens (eager run), written in place into the buffers the graphs read."""
    from safetensors.torch import load_file

    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
    from specserve.speculative.token_map import save_token_map

    algo = kind.split("+")[0]
    extra = {"draft_vocab_size": 100} if algo == "EAGLE3" else {}
    draft = write_random_eagle_checkpoint(
        str(tmp_path / "draft"), PRESETS["tiny"], algo, seed=5, **extra
    )
    spec = dict(speculative_algorithm=algo, speculative_draft_model_path=draft,
                speculative_num_steps=3, speculative_eagle_topk=4,
                speculative_num_draft_tokens=10, page_size=page_size)  # fmt: skip
    if algo == "EAGLE3":
        d2t = load_file(str(tmp_path / "draft" / "model.safetensors"))["d2t"].long()
        allowed = torch.arange(len(d2t)) + d2t
    else:
        allowed = torch.randperm(512, generator=torch.Generator().manual_seed(page_size))[:48]
        save_token_map(str(tmp_path / "map.json"), allowed.tolist())
        spec["speculative_token_map"] = str(tmp_path / "map.json")
        if kind.endswith("+growth"):
            spec["speculative_token_map_growth"] = 64
    prompts = mixed_prompts(5, 512, seed=12, min_len=3, max_len=30)
    with Engine(**GPU, page_size=page_size) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    with Engine(**GPU, **spec) as e:
        vocab = getattr(e.core.worker.drafter.head, "vocab", None)
        buffers = None if vocab is None else (vocab.weight.data_ptr(), vocab.bias is None)
        graphed = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
        if vocab is not None:  # the captured graphs read these buffers: written in place only
            assert (vocab.weight.data_ptr(), vocab.bias is None) == buffers
    with recorded_drafts() as drafted, Engine(**GPU, **spec, disable_cuda_graph=True) as e:
        eager = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert graphed == plain and eager == plain
    tokens = torch.cat([t.reshape(-1) for t in drafted])
    if kind.endswith("+growth"):
        seen = torch.tensor([t for ids in prompts + plain for t in ids])
        assert not torch.isin(tokens, allowed).all()  # the requests' own tokens were drafted
        allowed = torch.cat([allowed, seen])
    assert torch.isin(tokens, allowed).all() and torch.unique(tokens).numel() > 4


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_captured_draft_prefill_writes_the_eager_draft_kv_and_root(tmp_path, kind, chunk):
    """The prefill graphs replay an EAGLE/EAGLE3 draft's prefill too: after every chunk the
    draft's KV and root state equal those of an engine without graphs (float32)."""
    from specserve.model.config import PRESETS
    from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint

    draft = write_random_eagle_checkpoint(str(tmp_path / "d"), PRESETS["tiny"], kind, seed=6)
    prompt = mixed_prompts(1, 512, seed=47, min_len=40, max_len=40)[0]
    kw = dict(GPU, page_size=4, chunked_prefill_size=chunk, speculative_algorithm=kind,
              speculative_draft_model_path=draft, speculative_num_steps=3,
              speculative_eagle_topk=2, speculative_num_draft_tokens=6)  # fmt: skip
    eager = draft_prefill_snapshots(prompt, dict(kw, disable_cuda_graph=True))
    captured = []
    graphed = draft_prefill_snapshots(
        prompt, kw, lambda core: captured.append(core.worker.prefill_graphs)
    )
    assert captured[0] is not None
    assert_same_draft_prefill(graphed, eager, tol=1e-4)
    assert captured[0].num_captures >= 2  # the target's graph and the draft's
