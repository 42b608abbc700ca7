"""Where a batch-1 request's wall time goes, host side: prefill, decode launches, waits for the
device, stop checks, and the gap between the caller's submit and the first scheduled step.

Runs the engine the way `bench e2e` does (one request at a time, greedy, after an untimed pass)
and wraps the step loop's phases with wall-clock timers (no added synchronisation). Prints JSON
and a table per configuration.

Usage: python bench/request_phases.py MODEL [--spec 8,8,64 ...] [--num-prompts 6]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from specserve.bench.one_batch import free_device_memory
from specserve.engine import Engine
from specserve.model.registry import bundled_draft_folder
from specserve.runtime import engine_core, scheduler, stop, worker
from specserve.train.prompts import load_prompts

TOTALS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def _timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TOTALS[label] += time.perf_counter() - t
            COUNTS[label] += 1

    static = isinstance(owner.__dict__[name], staticmethod)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


_timed(engine_core.EngineCore, "step", "step (all)")
_timed(engine_core.EngineCore, "_run_prefill", "prefill")
_timed(engine_core.EngineCore, "_launch_decode", "decode launch")
_timed(worker.PendingDecode, "result", "wait for device")
_timed(stop.StopChecker, "append_tokens", "stop checks + detok")
_timed(scheduler.Scheduler, "schedule", "schedule")
_timed(scheduler.Scheduler, "schedule_decode_ahead", "schedule ahead")
_timed(Engine, "_deliver", "deliver")


def run(model: str, spec: str | None, prompts: list[str], max_new: int) -> dict:
    kw = dict(model_path=model)
    if spec:
        s, k, n = (int(x) for x in spec.split(","))
        kw.update(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=bundled_draft_folder("smollm2-135m"),
            speculative_num_steps=s,
            speculative_eagle_topk=k,
            speculative_num_draft_tokens=n,
        )
    sp = {"temperature": 0, "max_new_tokens": max_new}
    with Engine(**kw) as eng:
        ids = [eng.tokenize_chat([{"role": "user", "content": t}]) for t in prompts]
        for x in ids:
            eng.generate(input_ids=x, sampling_params=sp)
        TOTALS.clear()
        COUNTS.clear()
        tokens, latencies = 0, []
        t0 = time.perf_counter()
        for x in ids:
            t = time.perf_counter()
            out = eng.generate(input_ids=x, sampling_params=sp)
            latencies.append(time.perf_counter() - t)
            tokens += len(out["output_ids"])
        wall = time.perf_counter() - t0
    n = len(ids)
    phases = {k: {"ms_per_request": 1e3 * v / n, "calls": COUNTS[k]} for k, v in TOTALS.items()}
    return {
        "config": spec or "plain",
        "tok_s": tokens / wall,
        "ms_per_request": 1e3 * wall / n,
        "tokens_per_request": tokens / n,
        "steps_per_request": COUNTS["step (all)"] / n,
        "phases": phases,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--spec", nargs="*", default=["8,8,64"])
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=160)
    a = p.parse_args()
    prompts = load_prompts("heldout")[: a.num_prompts]
    results = []
    for spec in [None, *a.spec]:
        results.append(run(a.model, spec, prompts, a.max_new_tokens))
        free_device_memory()  # the engine's KV cache, before the next engine sizes its own
    print(json.dumps(results, indent=1))
    for r in results:
        print(
            f"\n{r['config']}: {r['tok_s']:.0f} tok/s, {r['ms_per_request']:.1f} ms/request, "
            f"{r['tokens_per_request']:.0f} tokens, {r['steps_per_request']:.1f} loop steps"
        )
        for k, v in sorted(r["phases"].items(), key=lambda kv: -kv[1]["ms_per_request"]):
            print(f"  {k:22s} {v['ms_per_request']:8.2f} ms/request  {v['calls']:6d} calls")


if __name__ == "__main__":
    main()
