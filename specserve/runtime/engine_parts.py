"""An engine's parts, built once from its configuration: the loaded model, the KV cache and
its tables, the worker (model runner, drafter, CUDA graphs), the scheduler, the adaptive
policy, and what checks requests' output. EngineCore (engine_core.py) runs the loop on them."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specserve.config import REFERENCE, EngineConfig, Kernels
from specserve.errors import InvalidArgument
from specserve.kv.allocator import PageAllocator
from specserve.kv.pool import KVCache
from specserve.kv.prefix_cache import PrefixCache
from specserve.kv.request_rows import RequestRows
from specserve.kv.table import KVTable
from specserve.model.config import ModelConfig
from specserve.model.loader import load_model
from specserve.model.runner import ModelRunner
from specserve.model.sharding import draft_target, local_kv_heads
from specserve.ops.attention import TorchAttentionBackend
from specserve.runtime.capacity import context_length, kv_pages, step_reserve_bytes
from specserve.runtime.draft_lag import DraftLag
from specserve.runtime.grammar import GrammarCompiler
from specserve.runtime.scheduler import Scheduler, SchedulerLimits
from specserve.runtime.stop import StopChecker
from specserve.runtime.worker import Worker
from specserve.speculative.adaptive import AdaptiveSpeculation, batch_bucket, speculation_tiers
from specserve.speculative.factory import build_drafter
from specserve.speculative.simulate import build_simulator

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineParts:
    model_config: ModelConfig
    tokenizer: object | None
    context_len: int
    max_total_tokens: int
    load_decisions: list  # what the loaded model and the device decided (resolved_args)
    kv_cache: KVCache
    table: KVTable
    rows: RequestRows
    runner: ModelRunner
    worker: Worker
    scheduler: Scheduler
    adaptive: AdaptiveSpeculation | None
    draft_lag: DraftLag | None
    eos_token_ids: frozenset[int]
    stop_checker: StopChecker
    grammars: GrammarCompiler | None


def make_attention_backend(name: str, kernels: Kernels = REFERENCE):
    if name == "triton":
        from specserve.ops.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(batch_invariant=kernels.batch_invariant_attention)
    return TorchAttentionBackend()


def step_seconds(graphs, batch_size: int, tier: int) -> float | None:
    """The device seconds of one decode step of `tier` at `batch_size`, replayed from its
    graph (None without graphs: launched steps are timed instead)."""
    if graphs is None:
        return None
    largest = graphs.buckets[-1]
    if batch_size > largest and batch_bucket(batch_size) == batch_bucket(largest):
        # the bucket holding the largest graph (a cuda_graph_max_bs that is not a power
        # of two): served by that graph up to its size; past it, steps run eagerly and
        # are timed as served
        batch_size = largest
    return graphs.step_seconds(batch_size, tier)


def build_engine_parts(cfg: EngineConfig, tp=None) -> EngineParts:
    """tp: this rank's TensorParallel handle when tp_size > 1: the model and KV cache hold
    this rank's shard."""
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    loaded = load_model(
        cfg.model_path,
        cfg.load_format,
        dtype,
        device,
        skip_tokenizer_init=cfg.skip_tokenizer_init,
        tokenizer_path=cfg.tokenizer_path,
        seed=cfg.random_seed,
        tp=tp,
    )
    mc, tokenizer = loaded.config, loaded.tokenizer
    context_len, context_decision = context_length(cfg, mc)

    draft = build_drafter(cfg, draft_target(loaded), device, dtype)
    kv_heads = mc.num_kv_heads if tp is None else local_kv_heads(mc, tp.size)
    per_slot = KVCache.bytes_per_slot(mc.num_layers, kv_heads, mc.head_dim, dtype)
    per_slot += draft.kv_bytes_per_slot
    reserve = step_reserve_bytes(cfg.max_running_requests, draft.shape.tokens, mc.vocab_size)
    num_pages, kv_decision = kv_pages(cfg, device, per_slot, tp, reserve)
    num_slots = num_pages * cfg.page_size
    max_total_tokens = kv_decision[1]
    with _kv_allocation(cfg, device, num_slots * per_slot, max_total_tokens):
        kv_cache = KVCache(mc.num_layers, num_slots, kv_heads, mc.head_dim, dtype, device)
    table = KVTable(PageAllocator(num_pages, cfg.page_size))
    window = draft.window + draft.lookahead
    rows = RequestRows(
        device,
        cfg.page_size,
        max_pages=-(-(context_len + 2 * window) // cfg.page_size),
        rows=cfg.max_running_requests + 8,
    )
    table.mirror = rows
    backend = make_attention_backend(cfg.attention_backend, cfg.kernels)
    runner = ModelRunner(loaded.model, kv_cache, backend, cfg.kernels)
    with _kv_allocation(cfg, device, num_slots * per_slot, max_total_tokens):
        draft.attach(table, num_slots, backend, rows)
    # load-adaptive speculation: each step drafts the tier that pays most (or none); a
    # plain step skips the draft, which catches up when speculation resumes
    tiers = speculation_tiers(draft.shape) if cfg.speculative_adaptive else None
    if tiers and any(t.ragged for t in tiers):  # each request's share of a budget
        rows.add_calibration(draft.shape.max_depth)
    draft_lag = None
    if tiers and cfg.speculative_adaptive_lag_tokens > 0:
        draft_lag = DraftLag(cfg.speculative_adaptive_lag_tokens)
        rows.add_lag_ring(
            cfg.speculative_adaptive_lag_tokens, draft.feature_dim(mc.hidden_size), dtype
        )
    eos = set(mc.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    eos_token_ids = frozenset(eos)
    worker = Worker(
        runner,
        table,
        rows,
        draft,
        cfg.kernels,
        build_simulator(cfg, tokenizer, mc.vocab_size, device),
        tiers,
        eos_token_ids,
    )
    if not cfg.disable_cuda_graph:
        _attach_graphs(cfg, worker, context_len, window, alone=tp is None or tp.size == 1)
    scheduler = _scheduler(cfg, table, worker, draft, max_total_tokens)
    adaptive = _adaptive_policy(cfg, tiers, worker, tp)
    if adaptive is not None:
        # a request that will decode plainly may reuse cached KV whose draft part is not
        # exact (plain steps skip the draft): one that asked for no drafts, or any while
        # speculation does not pay at this load
        scheduler.will_decode_plainly = lambda req: (
            not req.params.speculative
            or not (adaptive.speculation_pays(len(scheduler.running) + 1))
        )
    if tp is None or tp.size == 1:
        # (a capture on rank 0 alone would wait forever in its collectives: tensor-parallel
        # ranks capture together as steps meet their shapes)
        _capture_at_start(cfg, worker, adaptive is None)
    unsupported = None
    if tp is not None and tp.size > 1:
        unsupported = "is not supported with tp_size > 1"
    elif worker.step.simulator is not None:
        unsupported = "is not supported under simulated acceptance (it forces what is accepted)"
    return EngineParts(
        model_config=mc,
        tokenizer=tokenizer,
        context_len=context_len,
        max_total_tokens=max_total_tokens,
        load_decisions=[context_decision, kv_decision],
        kv_cache=kv_cache,
        table=table,
        rows=rows,
        runner=runner,
        worker=worker,
        scheduler=scheduler,
        adaptive=adaptive,
        draft_lag=draft_lag,
        eos_token_ids=eos_token_ids,
        stop_checker=StopChecker(tokenizer, eos_token_ids, context_len),
        grammars=None
        if tokenizer is None
        else GrammarCompiler(tokenizer, mc.vocab_size, unsupported),
    )


def _attach_graphs(
    cfg: EngineConfig, worker: Worker, context_len: int, window: int, alone: bool
) -> None:
    """Whole decode steps, and single prefill chunks, captured and replayed. alone: no other
    rank runs this step; only then may a capture without device memory fall back to an
    eager step (a rank that did so alone would run collectives of other shapes than its
    peers' graphs)."""
    from specserve.runtime.cuda_graphs import DecodeGraphs

    worker.graphs = DecodeGraphs(
        worker,
        cfg.cuda_graph_max_bs,
        max_width=context_len + window + max(window, worker.slot_width),
        eager_without_memory=alone,
    )
    if cfg.cuda_graph_max_prefill_tokens > 0:
        from specserve.runtime.prefill_graphs import PrefillGraphs

        worker.prefill_graphs = PrefillGraphs(
            worker,
            cfg.cuda_graph_max_prefill_tokens,
            max_width=context_len,
            eager_without_memory=alone,
        )


def _capture_at_start(cfg: EngineConfig, worker: Worker, decode: bool) -> None:
    """Graphs captured before the first request, so that their kernels compile now and not
    in a request's time, each at the shortest width (cuda_graphs.py, prefill_graphs.py): the
    decode step at every batch bucket a batch can meet (decode: else adaptive speculation
    captured every tier at the power-of-two buckets, timing them; a graph there covers the
    buckets between) and a prefill chunk of every length bucket a chunk can have."""
    start = time.perf_counter()
    steps = 0
    if decode and worker.graphs is not None:
        steps = worker.graphs.capture_at_start(1, cfg.max_running_requests)
    chunks = 0
    if worker.prefill_graphs is not None:
        most = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None  # (-1: whole)
        chunks = worker.prefill_graphs.capture_at_start(worker.drafter.capture_layers, most)
    if steps or chunks:
        log.info(
            "captured %d decode-step and %d prefill graph shapes at start in %.1f s",
            steps,
            chunks,
            time.perf_counter() - start,
        )


@contextmanager
def _kv_allocation(cfg: EngineConfig, device: torch.device, nbytes: int, tokens: int):
    """A KV cache the device cannot allocate is the configuration's fault: refused naming
    what sized it (tokens: the cache's, in whole pages; a page larger than the tokens asked
    for is one page)."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:  # (torch.OutOfMemoryError is a RuntimeError)
        if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and "allocate" not in str(e):
            raise
        if 2 * cfg.page_size > tokens:  # (a page or two: the page's size made it this large)
            field = "page_size"
        else:
            field = "max_total_tokens" if cfg.max_total_tokens else "mem_fraction_static"
        raise InvalidArgument(
            field,
            f"the KV cache it sizes takes {nbytes / 2**30:.1f} GiB, which {device} cannot "
            f"allocate ({type(e).__name__}); lower it",
        ) from None


def _scheduler(
    cfg: EngineConfig, table: KVTable, worker: Worker, draft, max_total_tokens: int
) -> Scheduler:
    scheduler = Scheduler(
        table,
        SchedulerLimits(
            max_running_requests=cfg.max_running_requests,
            chunked_prefill_size=cfg.chunked_prefill_size,
            decode_window=worker.decode_window,
            kv_lookahead=worker.kv_lookahead,
            max_accept=worker.max_accept,
        ),
        None
        if cfg.disable_radix_cache
        else PrefixCache(table.allocator, draft.draft_kv_reads_next_token),
    )
    if scheduler.max_prompt_tokens() < 1:
        # one request needs its prompt, the position its next step writes and, with a
        # standalone draft, the draft's root
        need = max_total_tokens + 1 - scheduler.max_prompt_tokens()
        raise InvalidArgument(
            "max_total_tokens",
            f"holds {max_total_tokens} tokens, too few for one request of one token: "
            f"it must be at least {need}",
        )
    return scheduler


def _adaptive_policy(cfg: EngineConfig, tiers, worker: Worker, tp) -> AdaptiveSpeculation | None:
    if not tiers:
        return None
    # (a graph replayed on rank 0 alone would wait forever in its collectives)
    measurable = tp is None or tp.size == 1
    adaptive = AdaptiveSpeculation(
        tiers, (lambda b, t: step_seconds(worker.graphs, b, t)) if measurable else None
    )
    if measurable and worker.graphs is not None:
        # every tier timed at every batch bucket before the first request, not when serving
        # first meets a bucket (capturing compiles kernels: seconds at a large model)
        start = time.perf_counter()
        largest = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
        timed = adaptive.prime(largest)
        log.info(
            "adaptive speculation: %d tier steps timed up to batch %d in %.1f s",
            timed,
            largest,
            time.perf_counter() - start,
        )
    return adaptive
