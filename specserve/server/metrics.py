"""Prometheus metrics of the server (prometheus-client, one registry per app).

Request-level series are recorded when a request finishes (from the engine's thread:
prometheus-client is thread-safe); engine state (running/queued requests, KV usage,
speculative accept length) is read from `engine.stats()` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "specserve"

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector:
    """Gauges and counters read from the engine (and the server's own in-flight count)."""

    def __init__(self, engine, server_state: Callable[[], dict[str, Any]]):
        self.engine = engine
        self.server_state = server_state

    def collect(self):
        s = self.engine.stats()
        srv = self.server_state()

        def gauge(name: str, doc: str, value: float | None):
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            g.add_metric([], float("nan") if value is None else float(value))
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            c.add_metric([], float(value))
            return c

        yield gauge(
            "num_running_requests", "Requests being prefilled or decoded", s["num_running_requests"]
        )
        yield gauge(
            "num_queued_requests",
            "Requests waiting in the engine's scheduler",
            s["num_waiting_requests"],
        )
        yield gauge(
            "num_inflight_requests",
            "Requests submitted through the server and not finished (what max_queued_requests caps)",
            srv["inflight"],
        )
        if srv.get("max_queued_requests") is not None:
            yield gauge(
                "max_queued_requests",
                "Limit on in-flight requests (503 beyond)",
                srv["max_queued_requests"],
            )
        yield gauge(
            "kv_used_tokens",
            "KV slots live requests hold (cached slots nobody uses excluded)",
            s["kv_used_tokens"],
        )
        yield gauge("kv_total_tokens", "KV cache slots in all", s["kv_total_tokens"])
        yield gauge("kv_usage", "Fraction of the KV cache in use (0..1)", s["kv_usage"])
        yield gauge("kv_cached_tokens", "KV slots the prefix cache keeps", s["kv_cached_tokens"])
        yield counter(
            "prefix_cache_query_tokens",
            "Prompt tokens of admitted requests looked up in the prefix cache",
            s["prefix_cache_query_tokens"],
        )
        yield counter(
            "prefix_cache_hit_tokens",
            "Of those, tokens served from the cache (hit rate = hit / query)",
            s["prefix_cache_hit_tokens"],
        )
        yield counter(
            "retractions",
            "Requests retracted for lack of KV or after a step ran the device out of memory",
            s["num_retractions"],
        )
        yield counter(
            "out_of_memory_retractions",
            "Steps that ran the device out of memory with several requests started: they were "
            "retracted, and max_running_requests set to half of them (it climbs back slowly)",
            s.get("num_out_of_memory_retractions", 0),
        )
        yield counter("engine_steps", "Engine steps (batches) run", s["num_steps"])
        yield counter("prefill_batches", "Prefill batches run", s["num_prefill_batches"])
        yield counter(
            "prefill_batches_beside_decode",
            "Prefill batches queued behind a decode step in flight (overlap kept)",
            s["num_prefill_batches_beside_decode"],
        )
        yield counter(
            "decode_steps_launched_ahead",
            "Decode steps launched before the previous one was applied (overlap kept)",
            s["num_decode_steps_launched_ahead"],
        )
        yield counter(
            "graph_captures",
            "CUDA graphs captured, decode and prefill (each capture stalls its step)",
            s["num_graph_captures"],
        )
        yield counter(
            "graph_captures_idle",
            "Decode CUDA graphs captured while no request was running or waiting (until then "
            "their steps replayed a larger graph)",
            s.get("num_graph_captures_idle", 0),
        )
        yield gauge(
            "graph_shapes_without_memory",
            "CUDA-graph shapes (decode and prefill) whose capture found no device memory: their "
            "steps run eagerly, slower (more than a few: lower mem_fraction_static)",
            s.get("num_graph_shapes_without_memory", 0),
        )
        verify = s.get("spec_verify_ct") or 0
        accept = s.get("spec_accept_length")
        yield counter("spec_verify_steps", "Speculative verify steps, summed over requests", verify)
        yield counter(
            "spec_accepted_tokens",
            "Tokens emitted by speculative verify steps (accepted drafts plus the bonus token)",
            round((accept or 0.0) * verify),
        )
        yield gauge(
            "spec_accept_length",
            "Mean tokens emitted per verify step since start (NaN without speculative decoding)",
            accept,
        )


class ServerMetrics:
    def __init__(self, engine, server_state: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Finished generation requests, by finish reason (stop, length, abort)",
            ["finish_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from arrival to the first output token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Time from arrival to the last output token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean decode time per output token after the first, per request",
            buckets=PER_TOKEN_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            f"{PREFIX}_rejected_requests",
            "Requests answered with an error before reaching the engine, by HTTP status",
            ["status"],
            registry=r,
        )
        r.register(_EngineCollector(engine, server_state))

    def observe_finished(self, out: dict[str, Any]) -> None:
        meta = out.get("meta_info") or {}
        reason = (meta.get("finish_reason") or {}).get("type") or "abort"
        self.requests.labels(reason).inc()
        prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        ttft, e2e = meta.get("ttft"), meta.get("e2e_latency")
        if ttft is not None:
            self.ttft.observe(ttft)
        if e2e is not None and reason != "abort":
            self.e2e.observe(e2e)
            if ttft is not None and completion > 1:
                self.tpot.observe((e2e - ttft) / (completion - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
