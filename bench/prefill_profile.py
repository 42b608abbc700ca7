"""Where a batch-1 prefill's host time goes: torch.profiler over single-request prefills
(max_new_tokens=1) after a warm-up, with the prefill's parts labelled. Prints the labelled
parts (CPU ms per prefill) and the top ops by self CPU time.

Usage: python bench/prefill_profile.py [--model smollm2-135m] [--prompt-len 64] [--spec 8,8,64]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import uuid

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from specserve.config import EngineConfig
from specserve.runtime import worker as worker_module
from specserve.runtime.engine_core import EngineCore
from specserve.runtime.prefill_graphs import PrefillGraphs
from specserve.runtime.request import Request
from specserve.sampling_params import SamplingParams
from specserve.speculative import drafter as drafter_module


def label(owner, name: str, tag: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        with record_function(tag):
            return fn(*a, **k)

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--spec", default="8,8,64")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    kw = dict(model_path=a.model, load_format="dummy", skip_tokenizer_init=True)
    if a.spec:
        from specserve.model.config import PRESETS
        from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint

        folder = write_random_eagle_checkpoint(tempfile.mkdtemp(), PRESETS[a.model], "EAGLE")
        s, k, n = (int(x) for x in a.spec.split(","))
        kw.update(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=folder,
            speculative_num_steps=s,
            speculative_eagle_topk=k,
            speculative_num_draft_tokens=n,
        )
    label(worker_module.Worker, "prefill", "prefill")
    label(worker_module.ModelRunner, "forward", "target/draft forward")
    label(worker_module, "sample", "sample")
    label(worker_module, "build_metadata", "build_metadata (target)")
    label(drafter_module.TreeDrafter, "extend_after_prefill", "draft extend_after_prefill")
    label(PrefillGraphs, "draft", "draft prefill (graph)")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(a.prompt_len)] for _ in range(a.repeats)]
    sp = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    # The step loop on this thread (the profiler records the thread that starts it).
    core = EngineCore(EngineConfig.from_kwargs(**kw).resolve())

    def generate(ids: list[int]) -> None:
        core.add_request(Request(uuid.uuid4().hex, ids, SamplingParams(**sp), seed=0))
        while core.has_work():
            core.step()

    for x in prompts[:2]:
        generate(x)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for x in prompts:
            generate(x)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ka = prof.key_averages()
    print(f"\nlabelled parts, CPU ms per prefill ({a.repeats} prefills of {a.prompt_len} tokens):")
    for e in ka:
        if e.key in (
            "prefill",
            "target/draft forward",
            "sample",
            "build_metadata (target)",
            "draft extend_after_prefill",
            "draft prefill (graph)",
        ):
            print(f"  {e.key:30s} {e.cpu_time_total / 1e3 / a.repeats:8.2f} ms  {e.count} calls")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=35))


if __name__ == "__main__":
    main()
