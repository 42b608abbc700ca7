"""What `Engine.stats()` reports: counters and gauges of an engine core, read from the
loop's state without stopping it (the server's /metrics and the benches read them)."""

from __future__ import annotations

from typing import Any

from specserve.runtime.engine_core import EngineCore
from specserve.runtime.request import ReqState


def engine_stats(core: EngineCore) -> dict[str, Any]:
    """A consistent-enough snapshot (copies what the loop's thread may change meanwhile)."""
    alloc = core.table.allocator
    # in use: pages live requests hold (cached pages nobody uses can be reclaimed at once)
    used_pages = alloc.num_usable_pages - core.table.available_pages
    cache = core.scheduler.cache
    verify_ct = core.spec_totals["verify_ct"]
    # a request between the chunks of its prompt is running, though it is still in the
    # waiting queue (copied: the loop's thread may change the queue meanwhile)
    waiting = list(core.scheduler.waiting)
    prefilling = sum(1 for r in waiting if r.state is ReqState.PREFILLING)
    return {
        "num_running_requests": len(core.scheduler.running) + prefilling,
        "num_waiting_requests": len(waiting) - prefilling,
        "kv_total_tokens": core.max_total_tokens,
        "kv_used_tokens": used_pages * alloc.page_size,
        "kv_usage": used_pages / max(1, alloc.num_usable_pages),
        "kv_cached_tokens": cache.num_pages * alloc.page_size if cache else 0,
        "prefix_cache_query_tokens": core.scheduler.prefix_query_tokens,
        "prefix_cache_hit_tokens": core.scheduler.prefix_hit_tokens,
        "num_retractions": core.scheduler.num_retractions,
        # requests that went on plainly as the only one left, the KV cache holding its next
        # position but not its speculative step's window
        "num_decoded_plainly_to_fit": core.scheduler.num_plain_to_fit,
        # (times a step ran the device out of memory and the started requests were retracted
        # to run at most max_running_requests at once: halved, then climbing back slowly)
        "num_out_of_memory_retractions": core.num_out_of_memory_retractions,
        "max_running_requests": core.scheduler.limits.max_running_requests,
        "num_steps": core.num_steps,
        "num_prefill_batches": core.num_prefill_batches,
        # prefills queued behind a decode step in flight, and decode steps launched before
        # the previous one was applied: the rest waited for the host
        "num_prefill_batches_beside_decode": core.num_prefills_beside,
        "num_decode_steps_launched_ahead": core.num_launched_ahead,
        # CUDA graphs captured so far, decode and prefill (each capture stalls its step)
        "num_graph_captures": sum(
            g.num_captures
            for g in (core.worker.graphs, core.worker.prefill_graphs)
            if g is not None
        ),
        # decode graphs captured while the engine was idle (no request waited for them),
        # and those it will capture when next idle
        "num_graph_captures_idle": (
            core.worker.graphs.num_idle_captures if core.worker.graphs is not None else 0
        ),
        "num_graph_captures_wanted": (
            len(core.worker.graphs.wanted) if core.worker.graphs is not None else 0
        ),
        # shapes, decode and prefill, whose capture found no device memory: they run eagerly
        "num_graph_shapes_without_memory": sum(
            len(g._no_memory)
            for g in (core.worker.graphs, core.worker.prefill_graphs)
            if g is not None
        ),
        "spec_verify_ct": verify_ct,
        "speculative_adaptive": core.describe_adaptive(),
        "spec_accept_length": core.spec_totals["accepted"] / verify_ct if verify_ct else None,
    }
