"""`specserve bench serving`: a load generator against a running server.

Requests arrive as a Poisson process (`--request-rate`, requests per second; `inf` sends
them all at once) and/or under a fixed concurrency cap (`--max-concurrency`). Every request
is streamed (SSE) with httpx/asyncio; the client times the first token (TTFT), the gaps
between streamed chunks (ITL), the time per output token after the first (TPOT) and the
end-to-end latency. Token counts come from the server's `usage` (or /generate's meta_info),
the mean speculative accept length from the server's /metrics counters (or, failing that,
from the responses). Results are printed as JSON and a table; `--plot PATH` draws a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from specserve.bench.args import HelpWithDefaults, positive_int

ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
}


@dataclass
class RequestSpec:
    prompt: str | list[int]
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    spec_verify_ct: int = 0


# ---- workload ---------------------------------------------------------------------------------
def load_prompt_file(path: str | None) -> list[str]:
    """Prompts from a JSONL file ({"prompt": ...} per line); None: the bundled set."""
    if path is None:
        text = resources.files("specserve").joinpath("data/bench_prompts.jsonl").read_text()
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    prompts = []
    where = f"--dataset {path}" if path else "bench_prompts.jsonl"
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}, line {n}: not JSON ({e.msg}); expected JSONL") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{where}, line {n}: expected {{"prompt": str}} per line')
        prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"{where}: no prompts")
    return prompts


def sample_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """Uniform in [length * range_ratio, length] (range_ratio 1: always `length`)."""
    low = max(1, int(round(length * range_ratio)))
    return rng.randint(low, max(low, length))


def build_requests(args, vocab_size: int | None) -> list[RequestSpec]:
    rng = random.Random(args.seed)
    specs = []
    if args.dataset == "random":
        if not vocab_size:
            raise ValueError("--dataset random needs the vocabulary size: pass --vocab-size")
        low = min(10, vocab_size - 1)
        for _ in range(args.num_prompts):
            n_in = sample_len(rng, args.input_len or 128, args.range_ratio)
            ids = [rng.randrange(low, vocab_size) for _ in range(n_in)]
            specs.append(RequestSpec(ids, sample_len(rng, args.output_len, args.range_ratio)))
        return specs
    pool = load_prompt_file(None if args.dataset == "bundled" else args.dataset)
    order = list(range(len(pool)))
    rng.shuffle(order)
    for i in range(args.num_prompts):
        prompt = pool[order[i % len(pool)]]
        if args.input_len:
            # Longer prompts: several instructions in one, to about input_len tokens
            # (estimated at 4 characters per token).
            target = 4 * sample_len(rng, args.input_len, args.range_ratio)
            parts = [prompt]
            while sum(len(p) + 4 for p in parts) < target:
                parts.append(pool[rng.randrange(len(pool))])
            if len(parts) > 1:
                prompt = "Answer each of the following.\n" + "\n".join(
                    f"{k}. {p}" for k, p in enumerate(parts, 1)
                )
        specs.append(RequestSpec(prompt, sample_len(rng, args.output_len, args.range_ratio)))
    return specs


def request_body(args, spec: RequestSpec, model: str | None) -> dict[str, Any]:
    if args.endpoint == "generate":
        key = "text" if isinstance(spec.prompt, str) else "input_ids"
        sp = {
            "temperature": args.temperature,
            "max_new_tokens": spec.output_len,
            "ignore_eos": args.ignore_eos,
        }
        return {key: spec.prompt, "sampling_params": sp, "stream": True}
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # specserve extension: exact tokens per chunk
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


# ---- one request ------------------------------------------------------------------------------
def _chunk_has_output(endpoint: str, obj: dict[str, Any], state: dict[str, Any]) -> bool:
    if endpoint == "generate":
        n = len(obj.get("output_ids") or [])
        text = obj.get("text") or ""
        new = n > state.get("ids", 0) or len(text) > state.get("chars", 0)
        state["ids"], state["chars"] = n, len(text)
        meta = obj.get("meta_info") or {}
        state["prompt_tokens"] = meta.get("prompt_tokens", 0)
        state["completion_tokens"] = meta.get("completion_tokens", n)
        state["spec_verify_ct"] = meta.get("spec_verify_ct", 0)
        return new
    if obj.get("usage"):
        u = obj["usage"]
        state["prompt_tokens"] = u.get("prompt_tokens", 0)
        state["completion_tokens"] = u.get("completion_tokens", 0)
        state["spec_verify_ct"] = u.get("spec_verify_ct", 0)
    for c in obj.get("choices") or []:
        content = (
            c.get("text") if endpoint == "completions" else (c.get("delta") or {}).get("content")
        )
        if content or c.get("token_ids"):
            state["chunks_tokens"] = state.get("chunks_tokens", 0) + len(c.get("token_ids") or [])
            return True
    return False


def auth_headers(api_key: str | None) -> dict[str, str]:
    """What a server started with --api-key wants on every request."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_request(client, args, spec: RequestSpec, model: str | None, t0: float):
    res = RequestResult()
    url = ENDPOINTS[args.endpoint]
    state: dict[str, Any] = {}
    start = time.perf_counter()
    res.start = start - t0
    last = None
    try:
        async with client.stream("POST", url, json=request_body(args, spec, model)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))[:300]
                    return res
                now = time.perf_counter()
                if _chunk_has_output(args.endpoint, obj, state):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except Exception as e:  # connection errors, timeouts, bad JSON
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e = time.perf_counter() - start
    res.prompt_tokens = state.get("prompt_tokens", 0)
    res.output_tokens = state.get("completion_tokens") or state.get("chunks_tokens", 0)
    res.spec_verify_ct = state.get("spec_verify_ct", 0) or 0
    if last is None:
        res.ttft = res.e2e
    res.ok = True
    return res


# ---- server introspection ---------------------------------------------------------------------
_SPEC_RE = re.compile(
    r"^specserve_spec_(verify_steps|accepted_tokens)_total\s+([0-9.eE+-]+|NaN)\s*$", re.M
)


async def scrape_spec_counters(client) -> dict[str, float] | None:
    try:
        r = await client.get("/metrics", timeout=10)
        if r.status_code != 200:
            return None
    except Exception:
        return None
    found = {k: float(v) for k, v in _SPEC_RE.findall(r.text)}
    return found if len(found) == 2 else None


async def server_info(client, base_url: str) -> dict[str, Any]:
    """The served model's name and shape. An unreachable server or a refused key is an error
    here, before any request: later it would surface as a misleading one (a missing
    vocabulary size) or as every request failing."""
    import httpx

    info: dict[str, Any] = {}
    try:
        r = await client.get("/v1/models", timeout=10)
    except httpx.HTTPError as e:
        raise RuntimeError(
            f"could not reach the server at {base_url} ({type(e).__name__}: {e}); "
            "is it running? (--base-url, or --host and --port)"
        ) from None
    if r.status_code in (401, 403):
        raise RuntimeError(
            f"the server at {base_url} refused the API key (HTTP {r.status_code}): pass the "
            "key it was started with as --api-key (or in OPENAI_API_KEY)"
        )
    try:
        if r.status_code == 200 and r.json().get("data"):
            info["model"] = r.json()["data"][0]["id"]
    except Exception:
        pass  # another server's /v1/models: the model name is optional
    try:
        r = await client.get("/get_model_info", timeout=10)
        if r.status_code == 200:
            info.update({k: v for k, v in r.json().items() if k != "model"})
    except Exception:
        pass
    return info


# ---- the run ----------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    ms = [1000.0 * x for x in values_s]
    return {
        f"mean_{name}_ms": (sum(ms) / len(ms)) if ms else None,
        f"p50_{name}_ms": percentile(ms, 50),
        f"p90_{name}_ms": percentile(ms, 90),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def summarize(
    args, results: list[RequestResult], duration: float, info: dict[str, Any], accept
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": info.get("model"),
        "dataset": args.dataset,
        "num_prompts": len(results),
        # JSON has no Infinity: vLLM's result files write the default rate as "inf" too
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput_req_s": len(ok) / duration if duration > 0 else None,
        "input_token_throughput_tok_s": inp / duration if duration > 0 else None,
        "output_token_throughput_tok_s": out / duration if duration > 0 else None,
        "total_token_throughput_tok_s": (inp + out) / duration if duration > 0 else None,
    }
    summary.update(_stats("ttft", [r.ttft for r in ok]))
    summary.update(_stats("itl", [x for r in ok for x in r.itl]))
    summary.update(_stats("tpot", tpot))
    summary.update(_stats("e2e_latency", [r.e2e for r in ok]))
    summary["spec_accept_length"], summary["spec_accept_length_source"] = accept
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


async def run_benchmark(args) -> tuple[dict[str, Any], list[RequestResult]]:
    import httpx

    limits = httpx.Limits(
        max_connections=(args.max_concurrency or args.num_prompts) + 4,
        max_keepalive_connections=(args.max_concurrency or args.num_prompts) + 4,
    )
    timeout = httpx.Timeout(args.timeout, connect=30)
    async with httpx.AsyncClient(
        base_url=args.base_url,
        limits=limits,
        timeout=timeout,
        headers=auth_headers(args.api_key),
    ) as client:
        info = await server_info(client, args.base_url)
        model = args.model or info.get("model")
        specs = build_requests(args, args.vocab_size or info.get("vocab_size"))
        t0 = time.perf_counter()
        for i in range(args.warmup):
            w = await send_request(
                client, args, RequestSpec(specs[i % len(specs)].prompt, 4), model, t0
            )
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        before = await scrape_spec_counters(client)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)
        progress = _Progress(len(specs), enabled=not args.quiet)

        async def one(spec: RequestSpec) -> RequestResult:
            if sem is None:
                res = await send_request(client, args, spec, model, t0)
            else:
                async with sem:
                    res = await send_request(client, args, spec, model, t0)
            progress.tick()
            return res

        t0 = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(one(spec)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        progress.done()
        after = await scrape_spec_counters(client)
    accept: tuple[float | None, str | None] = (None, None)
    if before and after:
        dv = after["verify_steps"] - before["verify_steps"]
        if dv > 0:
            accept = ((after["accepted_tokens"] - before["accepted_tokens"]) / dv, "metrics")
    if accept[0] is None:
        verify = sum(r.spec_verify_ct for r in results if r.ok)
        if verify:
            out = sum(r.output_tokens for r in results if r.ok and r.spec_verify_ct)
            accept = (out / verify, "responses")
    return summarize(args, list(results), duration, info, accept), list(results)


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled = total, 0, enabled and sys.stderr.isatty()

    def tick(self) -> None:
        self.n += 1
        if self.enabled:
            print(f"\r{self.n}/{self.total} requests", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


# ---- output -----------------------------------------------------------------------------------
def format_table(summary: dict[str, Any]) -> str:
    rows = [(k, v) for k, v in summary.items() if k != "errors"]
    width = max(len(k) for k, _ in rows)
    lines = [f"{'metric'.ljust(width)} | value", f"{'-' * width} | -----"]
    for k, v in rows:
        if isinstance(v, float):
            v = f"{v:.4g}" if math.isfinite(v) else str(v)
        lines.append(f"{k.ljust(width)} | {v}")
    for e in summary.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


# ---- CLI --------------------------------------------------------------------------------------
def _rate(value: str) -> float:
    v = float(value)
    if not v > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return v


def add_serving_parser(bsub) -> argparse.ArgumentParser:
    p = bsub.add_parser(
        "serving",
        help="load-test a running server (Poisson arrivals or fixed concurrency)",
        description=__doc__,
        formatter_class=HelpWithDefaults,
    )
    p.add_argument(
        "--base-url", default=None, help="server URL; unset: http://HOST:PORT from the next two"
    )
    p.add_argument("--host", default="127.0.0.1", help="server host (without --base-url)")
    p.add_argument("--port", type=int, default=30000, help="server port (without --base-url)")
    p.add_argument(
        "--api-key",
        default=None,  # (read in cmd_serving: --help must not print a key from the environment)
        help="the key of a server started with --api-key, sent as 'Authorization: Bearer "
        "KEY'; unset: the OPENAI_API_KEY environment variable, as `vllm bench serve` reads it",
    )
    p.add_argument(
        "--endpoint", choices=sorted(ENDPOINTS), default="chat", help="API the requests go to"
    )
    p.add_argument("--model", default=None, help="model name to send; unset: from /v1/models")
    p.add_argument(
        "--dataset",
        default="bundled",
        help="bundled (~100 short instructions), random (random token ids; completions or "
        "generate), or a JSONL file with {'prompt': ...} per line",
    )
    p.add_argument("--num-prompts", type=positive_int, default=100, help="requests to send")
    p.add_argument(
        "--request-rate",
        type=_rate,
        default=float("inf"),
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="most requests in flight at once (unset: no cap)",
    )
    p.add_argument(
        "--input-len",
        type=positive_int,
        default=None,
        help="prompt tokens: random dataset (unset: 128); text datasets join instructions "
        "up to about this many tokens (unset: the instructions as they are)",
    )
    p.add_argument("--output-len", type=positive_int, default=128, help="max tokens per request")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=1.0,
        help="lengths are uniform in [len * ratio, len], ratio in (0, 1] (1.0: fixed lengths)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate exactly the sampled output lengths"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        help="random dataset: ids are drawn below this (unset: the server's /get_model_info)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths, arrivals")
    p.add_argument(
        "--warmup", type=int, default=1, help="warm-up requests before the run (not measured)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument(
        "--output-json", default=None, help="also write the summary and every request here"
    )
    p.add_argument("--plot", default=None, help="draw a PNG with latency distributions here")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=cmd_serving)
    return p


def cmd_serving(args) -> int:
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    args.base_url = args.base_url.rstrip("/")
    if not 0.0 < args.range_ratio <= 1.0:
        print("error: --range-ratio must be in (0, 1]", file=sys.stderr)
        return 2
    # (the file's existence, like the result files' folders, is checked before this runs:
    # bench/args.py's check_serving)
    if args.dataset not in ("bundled", "random"):
        try:  # a broken file is named before the server is asked anything
            load_prompt_file(args.dataset)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.api_key is None:
        from specserve.config.environment import openai_api_key

        args.api_key = openai_api_key()
    if args.api_key is not None and not args.api_key.strip():
        print("error: --api-key must not be empty", file=sys.stderr)
        return 2
    if args.dataset == "random" and args.endpoint == "chat":
        print(
            "error: --dataset random sends token ids: use --endpoint completions or generate",
            file=sys.stderr,
        )
        return 2
    try:
        summary, results = asyncio.run(run_benchmark(args))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    print(format_table(summary))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"summary": summary, "requests": [r.__dict__ for r in results]}, f, indent=1)
    if args.plot:
        from specserve.bench.serving_plot import plot

        plot(results, summary, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0 if summary["completed"] else 1
