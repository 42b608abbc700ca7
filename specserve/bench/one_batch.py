"""One static batch: prefill throughput, then decode throughput, as JSON and a table."""

from __future__ import annotations

import json
import random
import time
from typing import Any

from specserve.bench.gc_pauses import gc_pauses

# Warm-up runs at most before timing: enough for adaptive speculation's exploration to have
# met its tiers' graphs at a batch size, bounded so a bench never spins.
MAX_WARMUPS = 3
# The longest a warm-up waits for the idle engine's captures (on an H200: 0.05-0.3 s each).
IDLE_CAPTURE_WAIT_S = 120.0


def random_batch(
    engine, batch_size: int, input_len: int, output_len: int, seed: int = 0
) -> tuple[list[list[int]], dict[str, Any]]:
    """Random prompts and greedy sampling parameters that generate exactly output_len tokens."""
    rng = random.Random(seed)
    vocab = engine.core.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(batch_size)]
    return prompts, {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}


def chat_prompt_ids(tokenizer, batch_size: int, offset: int = 0) -> list[list[int]]:
    """The packaged held-out and bench prompts as one-turn chats, tokenized with the model's
    chat template (repeated as needed; `offset`: where in that list the batch starts). Peers
    (bench/vllm_peer.py) call this too, so both engines get the same token ids."""
    from importlib import resources

    from specserve.model.tokenizer import apply_chat_template

    texts = []
    for name in ("heldout_prompts.jsonl", "bench_prompts.jsonl"):
        data = resources.files("specserve").joinpath("data", name).read_text()
        texts += [json.loads(line)["prompt"] for line in data.splitlines() if line.strip()]
    picked = [texts[(offset + i) % len(texts)] for i in range(batch_size)]
    return [apply_chat_template(tokenizer, [{"role": "user", "content": t}]) for t in picked]


def chat_batch(
    engine, batch_size: int, output_len: int, offset: int = 0
) -> tuple[list[list[int]], dict[str, Any]]:
    """`chat_prompt_ids` with the engine's tokenizer, greedy, output_len tokens each: real
    text, so a real draft's acceptance is what serving would see."""
    prompts = chat_prompt_ids(engine.tokenizer, batch_size, offset)
    return prompts, {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}


def same_lengths(prompts: list[list[int]], like: list[list[int]]) -> list[list[int]]:
    """Each of `prompts` cut, or repeated, to the length of the same place in `like`: other
    text with the timed batch's prompt lengths, so a warm-up on it meets the prefill shapes
    and context widths of the timed run (and captures their graphs) without running, and
    calibrating speculation on, the timed prompts themselves."""
    return [
        (p * -(-n // len(p)))[:n] if n else [] for p, n in zip(prompts, map(len, like), strict=True)
    ]


def wait_for_idle_captures(engine) -> None:
    """Until the idle engine has captured the decode graphs its steps wanted (shapes it ran
    eagerly or on a larger shape's graph), at most IDLE_CAPTURE_WAIT_S: a timed run that
    starts sooner waits for one of them, or meets its shapes eagerly."""
    deadline = time.perf_counter() + IDLE_CAPTURE_WAIT_S
    while engine.stats().get("num_graph_captures_wanted") and time.perf_counter() < deadline:
        time.sleep(0.05)


def warm_up(engine, prompts: list[list[int]], sp: dict) -> int:
    """Run the batch untimed until a run leaves no new CUDA graph to capture (at most
    MAX_WARMUPS runs), so Triton has compiled and every graph a timed run needs (batch
    bucket x context-width bucket) is captured. Each run is followed by the idle time the
    engine's captures of shapes it ran eagerly or on larger graphs take (as a server between
    waves of requests would have). Under adaptive speculation a later run may meet a (tier,
    draft catch-up) graph the first did not (exploration rotates through the tiers). The
    prefix cache is flushed after each, so a timed prefill computes its prompts as a first
    request would. Returns the runs made."""
    runs = 0
    while True:
        before = _graph_captures(engine)
        engine.generate(input_ids=prompts, sampling_params=sp)
        engine.flush_cache()
        wait_for_idle_captures(engine)
        runs += 1
        if _graph_captures(engine) == before or runs == MAX_WARMUPS:
            return runs


def _graph_captures(engine) -> int:
    """Graphs captured so far, while steps waited or while the engine idled."""
    stats = engine.stats()
    return stats["num_graph_captures"] + stats.get("num_graph_captures_idle", 0)


def timed_batch(
    engine, batch_size: int, input_len: int | None, output_len: int, seed: int = 0
) -> tuple[list[list[int]], dict[str, Any], list[list[int]]]:
    """(prompts, sampling parameters, warm-up prompts) of a timed batch: random prompts of
    input_len tokens (the warm-up runs the same), or with input_len None the packaged chat
    prompts (the warm-up runs other prompts of the list at the timed prompts' lengths: the
    timed run meets shapes the warm-up met, and acceptance is not learned from the timed
    texts)."""
    if input_len is None:
        prompts, sp = chat_batch(engine, batch_size, output_len)
        others, _ = chat_batch(engine, batch_size, output_len, offset=batch_size)
        return prompts, sp, same_lengths(others, prompts)
    prompts, sp = random_batch(engine, batch_size, input_len, output_len, seed)
    return prompts, sp, prompts


def timed_run(engine, prompts: list[list[int]], sp: dict) -> dict[str, Any]:
    """One generate call over the batch: its outputs, total and first-token time, decode
    time and tok/s (tokens after each request's first over the time after the last first
    token), and the garbage collections during it."""
    with gc_pauses() as pauses:
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        total = time.perf_counter() - t0
    ttft = max(o["meta_info"]["ttft"] for o in outs)
    gen_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    decode_time = max(total - ttft, 1e-9)
    return {
        "outs": outs,
        "total": total,
        "ttft": ttft,
        "gen_tokens": gen_tokens,
        "decode_time": decode_time,
        "decode_tok_s": (gen_tokens - len(prompts)) / decode_time,
        "pauses": pauses.row(),
    }


def check_static_batch(engine, batch_size: int, prompt_len: int, output_len: int) -> None:
    """Refuse a batch the engine cannot run as one static batch, before anything is timed:
    with more requests than max_running_requests, or more KV than max_total_tokens holds,
    the rest would queue (or be retracted) and their decode would be timed as prefill.
    prompt_len: the batch's longest prompt."""
    from specserve.errors import InvalidArgument

    resolved = engine.resolved_args()
    context = resolved["context_length"]
    if prompt_len + output_len > context:  # (the output would stop short: mislabelled rows)
        raise InvalidArgument(
            "--output-len",
            f"a prompt of {prompt_len} tokens and {output_len} more exceed the context of "
            f"{context} tokens (lower --input-len or --output-len, or raise --context-length)",
        )
    running = resolved["max_running_requests"]
    if batch_size > running:
        raise InvalidArgument(
            "--batch-size",
            f"{batch_size} requests cannot run as one batch: max_running_requests is "
            f"{running} (raise --max-running-requests to at least {batch_size})",
        )
    # each request holds its prompt and output, plus what a decode step writes past its KV
    # and the step launched ahead reserves (the speculative window), in whole pages
    limits = engine.core.scheduler.limits
    window = limits.decode_window + limits.kv_lookahead + limits.max_accept
    page = resolved["page_size"]
    per_request = -(-(prompt_len + output_len + window) // page) * page
    kv = resolved["max_total_tokens"]
    if batch_size * per_request > kv:
        raise InvalidArgument(
            "--batch-size",
            f"{batch_size} requests of {prompt_len} + {output_len} tokens (+ {window} for "
            f"the decode window, in pages of {page}) need {batch_size * per_request} KV "
            f"tokens; max_total_tokens is {kv} (raise --max-total-tokens, or lower "
            "--batch-size, --input-len or --output-len)",
        )


def check_static_batches(
    engine, batch_sizes: list[int], input_len: int, output_len: int, chat: bool = False
) -> None:
    """`check_static_batch` for every batch size, before the first one runs."""
    for bs in batch_sizes:
        prompts, _, _ = timed_batch(engine, bs, None if chat else input_len, output_len)
        check_static_batch(engine, bs, max(map(len, prompts)), output_len)


def run_one_batch(
    engine,
    batch_size: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    chat: bool = False,
    repeats: int = 1,
) -> dict[str, Any]:
    """Time the prefill (first token of every request) and the decode of the rest.

    Measured through the public API: TTFT of the batch = prefill; the remaining
    (output_len - 1) tokens per request over the remaining time = decode. chat: the packaged
    chat prompts instead of random ids (input_len is then theirs; see `timed_batch`).
    repeats: timed runs
    (the prefix cache flushed between them); the row is the median run by decode
    throughput (the lower middle one for an even count), `decode_throughput_runs` lists them all: steps bound by the host move with
    the machine's load from one run to the next. (Under adaptive speculation a later run
    starts from the acceptance the earlier ones observed on the same texts.)"""
    prompts, sp, warm = timed_batch(
        engine, batch_size, None if chat else input_len, output_len, seed
    )
    if chat:
        input_len = round(sum(map(len, prompts)) / batch_size)
    warmups = warm_up(engine, warm, sp)
    captures = engine.stats()["num_graph_captures"]
    device_before = (engine.stats().get("speculative_adaptive") or {}).get("device_seconds")
    runs = []
    for i in range(max(1, repeats)):
        if i:
            engine.flush_cache()  # each timed prefill computes its prompts afresh
        runs.append(timed_run(engine, prompts, sp))
    # (the lower middle for an even count: never the best of two)
    run = sorted(runs, key=lambda r: r["decode_tok_s"])[(len(runs) - 1) // 2]
    outs, total, ttft = run["outs"], run["total"], run["ttft"]
    gen_tokens, decode_time = run["gen_tokens"], run["decode_time"]
    result = {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency_s": ttft,
        "prefill_throughput_tok_s": batch_size * input_len / ttft,
        "decode_latency_s": decode_time,
        "decode_throughput_tok_s": run["decode_tok_s"],
        "per_token_latency_ms": 1000 * decode_time / max(1, output_len - 1),
        "total_latency_s": total,
        "output_throughput_tok_s": gen_tokens / total,
        "warmup_runs": warmups,
        # graphs the timed runs still captured: their capture time is in their decode time
        "graph_captures_timed": engine.stats()["num_graph_captures"] - captures,
        **run["pauses"],
    }
    if len(runs) > 1:
        result["decode_throughput_runs"] = [round(r["decode_tok_s"], 1) for r in runs]
    accept = [
        o["meta_info"].get("spec_accept_length")
        for o in outs
        if "spec_accept_length" in o["meta_info"]
    ]
    if accept:
        result["spec_accept_length"] = sum(accept) / len(accept)
    adaptive = engine.stats().get("speculative_adaptive")
    if adaptive:  # what the tier policy saw (steps per tier, their times)
        result["adaptive_steps"] = adaptive["steps"]
        result["adaptive_step_ms"] = adaptive["step_ms"]
        result["adaptive_host_ms"] = adaptive.get("host_ms")
        result["adaptive_catch_ups"] = adaptive.get("catch_ups")
        result["adaptive_stopped"] = adaptive.get("stopped_speculating")
        # the timed runs' decode steps' own device time (CUDA events around each launch), per
        # run: well below decode_latency_s where the device waited on the host
        spent = adaptive["device_seconds"] - (device_before or 0.0)
        result["adaptive_step_device_s"] = spent / len(runs)
    return result


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    print(" | ".join(keys))
    print(" | ".join("---" for _ in keys))
    for r in rows:  # rows may lack a key of the first (e.g. HF rows: no per-round speeds)
        cells = (r.get(k) for k in keys)
        print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in cells))


def dump(rows: list[dict[str, Any]], output_json: str | None = None) -> None:
    """Print rows as JSON and a table; also write the JSON to `output_json` if given."""
    print(json.dumps(rows, indent=2))
    print_table(rows)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(rows, f, indent=2)


def free_device_memory() -> None:
    """Collect dropped engines and return their cached GPU memory, so the next engine
    sizes its KV cache from what is really free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
