"""`specserve bench profile-step`: where one decode step's time goes, on the device.

Runs one static batch under torch.profiler (after a warm-up that compiles and captures every
graph the run needs) and reports, per decode step:
- wall time (between consecutive graph launches, or steps counted by the engine);
- device time: the sum of kernel durations, and the busy time (union of kernel intervals);
- kernels per step, grouped by name (top N by time), with a coarse class for each
  (matmul, attention, norm, sampling, copy, other);
- host-side CUDA runtime calls per step (graph launches, eager kernel launches, copies,
  synchronisations): work outside the captured graph shows up here.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from typing import Any

from specserve.bench.args import positive_int
from specserve.bench.one_batch import dump, random_batch, warm_up


def add_profile_parser(bsub, add_engine_args, engine_kwargs) -> argparse.ArgumentParser:
    p = bsub.add_parser("profile-step", help="device profile of decode steps (kernels, host)")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--top", type=positive_int, default=15, help="kernel names to list")
    p.add_argument("--output-json", default=None)
    add_engine_args(p)

    def run(args) -> int:
        from specserve.engine import Engine

        with Engine(**engine_kwargs(args)) as engine:
            result = profile_decode(
                engine, args.batch_size, args.input_len, args.output_len, args.top
            )
        print_profile(result)
        dump([result["summary"]])
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(result, f, indent=1)
        return 0

    p.set_defaults(func=run)
    return p


_CLASSES = [
    ("matmul", re.compile(r"gemm|gemv|matmul|cutlass|nvjet|sm\d+_xmma|skinny|linear|splitk", re.I)),
    (
        "attention",
        re.compile(r"attn|attention|flash|extend_kernel|decode_split|merge_splits", re.I),
    ),
    ("norm", re.compile(r"norm", re.I)),
    ("rope/kv", re.compile(r"rope|rotary|kv_write|store_kv|commit_path", re.I)),
    (
        "sampling/topk",
        re.compile(
            r"topk|sort|softmax|argmax|max|sample|radix|bitonic|_chunk_kernel|_merge_kernel", re.I
        ),
    ),
    ("copy/index", re.compile(r"copy|gather|scatter|index|cat|memcpy|memset|fill", re.I)),
]


def kernel_class(name: str) -> str:
    for label, pattern in _CLASSES:
        if pattern.search(name):
            return label
    return "other"


def _busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def profile_decode(engine, batch_size: int, input_len: int, output_len: int, top: int):
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prompts, sp = random_batch(engine, batch_size, input_len, output_len)
    # compile and capture every graph first: a capture under the profiler takes minutes
    warmup_runs = warm_up(engine, prompts, sp)
    before = engine.stats()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        t_start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        total = time.perf_counter() - t_start
    after = engine.stats()
    # The decode phase: what follows the batch's prefill (the last first token).
    wall = 1e6 * max(total - max(o["meta_info"]["ttft"] for o in outs), 1e-9)

    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    launches = sorted(e.time_range.start for e in host if e.name == "cudaGraphLaunch")
    # Device work of the decode phase: from the first graph launch (prefill runs eagerly).
    t0 = launches[0] if launches else float("-inf")
    # every replayed decode step is one graph launch (the step overlap launches ahead counts:
    # it runs on the device); without graphs, the engine's counts
    steps = len(launches) or _decode_steps(before, after, outs)
    in_window = [k for k in kernels if k.time_range.start >= t0]
    per_name: dict[str, list[float]] = defaultdict(list)
    for k in in_window:
        per_name[k.name].append(k.time_range.end - k.time_range.start)
    kernel_time = sum(sum(v) for v in per_name.values())
    busy = _busy_time([(k.time_range.start, k.time_range.end) for k in in_window])
    by_class: dict[str, float] = defaultdict(float)
    for name, durs in per_name.items():
        by_class[kernel_class(name)] += sum(durs)
    runtime_calls: dict[str, int] = defaultdict(int)
    for e in host:
        if e.time_range.start >= t0 and e.name.startswith("cuda"):
            runtime_calls[e.name] += 1
    s = max(steps, 1)
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    kernel_rows = [
        {
            "kernel": name[:90],
            "class": kernel_class(name),
            "per_step": len(d) / s,
            "us_per_step": sum(d) / s,
            "us_each": sum(d) / len(d),
        }
        for name, d in rows[:top]
    ]
    accepts = [o["meta_info"].get("spec_accept_length") for o in outs]
    accept = sum(accepts) / len(accepts) if None not in accepts else None
    summary = {
        "batch_size": batch_size,
        "decode_steps": steps,
        "graph_launches": len(launches),
        "accept_length": accept,
        "wall_us_per_step": wall / s,
        "kernel_us_per_step": kernel_time / s,
        "busy_us_per_step": busy / s,
        "idle_fraction": 1.0 - busy / wall if kernels else None,
        "kernels_per_step": len(in_window) / s,
        "decode_tok_s": sum(o["meta_info"]["completion_tokens"] - 1 for o in outs) / (wall / 1e6),
        "warmup_runs": warmup_runs,
        "graph_captures_profiled": after["num_graph_captures"] - before["num_graph_captures"],
    }
    middle = _middle_step(in_window)
    if middle:
        # one step's device span: its kernels plus the gaps between them inside the replay;
        # the rest of the wall time per step is the device waiting for the host
        span = max(start + dur for _, start, dur in middle) - middle[0][1]
        summary["middle_step_span_us"] = span
        summary["middle_step_gaps_us"] = span - sum(dur for _, _, dur in middle)
    return {
        "summary": summary,
        "middle_step_kernels": middle,
        "classes_us_per_step": {k: v / s for k, v in sorted(by_class.items(), key=lambda x: -x[1])},
        "runtime_calls_per_step": {
            k: v / s for k, v in sorted(runtime_calls.items(), key=lambda x: -x[1])
        },
        "kernels": kernel_rows,
    }


def _middle_step(device_events) -> list[tuple[str, float, float]]:
    """(name, start after the step's first event, duration) in microseconds of the device
    work of one step from the middle of the run, in order. Each replay is
    preceded by the host-to-device copy of its row ids, so those copies mark the steps (host
    times would not: under overlap the next launch precedes this step's kernels)."""
    events = sorted(device_events, key=lambda k: k.time_range.start)
    starts = [k.time_range.start for k in events if k.name.startswith("Memcpy HtoD")]
    if len(starts) < 3:
        return []
    # a step may copy more than once (new sampling rows): keep copies that open a step, i.e.
    # come after the device's longest pauses (waiting for the host's next launch)
    step = (starts[-1] - starts[0]) / max(len(starts) - 1, 1)
    marks = [starts[0]] + [b for a, b in zip(starts, starts[1:]) if b - a > 0.3 * step]
    if len(marks) < 3:
        return []
    i = len(marks) // 2
    lo, hi = marks[i], marks[i + 1]
    return [
        (k.name[:80], k.time_range.start - lo, k.time_range.end - k.time_range.start)
        for k in events
        if lo <= k.time_range.start < hi
    ]


def _decode_steps(before: dict, after: dict, outs) -> int:
    """Decode steps of the profiled static batch: request verifications over the batch size
    (speculative), else one step per generated token after the first."""
    verified = (after.get("spec_verify_ct") or 0) - (before.get("spec_verify_ct") or 0)
    if verified:
        return max(round(verified / len(outs)), 1)
    return max(max(o["meta_info"]["completion_tokens"] for o in outs) - 1, 1)


def print_profile(result: dict[str, Any]) -> None:
    s = result["summary"]
    print(
        f"decode steps {s['decode_steps']}, accept length {s['accept_length']}, "
        f"wall {s['wall_us_per_step']:.1f} us/step, kernels {s['kernel_us_per_step']:.1f} us/step "
        f"(busy {s['busy_us_per_step']:.1f}, idle {100 * (s['idle_fraction'] or 0):.0f}%), "
        f"{s['kernels_per_step']:.0f} kernels/step"
    )
    print("class | us/step")
    print("--- | ---")
    for k, v in result["classes_us_per_step"].items():
        print(f"{k} | {v:.1f}")
    print("host runtime call | per step")
    print("--- | ---")
    for k, v in list(result["runtime_calls_per_step"].items())[:12]:
        print(f"{k} | {v:.2f}")
    print("kernel | class | per step | us/step | us each")
    print("--- | --- | --- | --- | ---")
    for r in result["kernels"]:
        print(
            f"{r['kernel']} | {r['class']} | {r['per_step']:.2f} | {r['us_per_step']:.1f} "
            f"| {r['us_each']:.2f}"
        )
