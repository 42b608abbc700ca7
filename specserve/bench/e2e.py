"""`specserve bench e2e`: batch-1 chat generation on real prompts, this engine with and without
its draft against Hugging Face transformers (static cache; prompt-lookup decoding), in one
run, on the same prompts and token ids.

Each system answers every prompt once untimed (Triton compiles, CUDA graphs, torch.compile
specialisations), then once timed, one request at a time. Throughput is output tokens over
wall time, prefill included, the same for every row. Greedy throughout, so the draft's
rows must reproduce the plain engine's tokens exactly (reported as `same_tokens`).

`--rounds N` runs the engine rows N times round-robin (plain, each spec, plain, ...) and
reports each row's median: on a GPU, rows measured later in a process run a few percent
slower, which one round charges to the speculative rows only (the plain row is first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from specserve.bench.args import positive_int
from specserve.bench.one_batch import dump, free_device_memory
from specserve.config.speculative import ALGORITHMS, chain_sized
from specserve.errors import InvalidArgument
from specserve.model.registry import DEFAULT_MODEL


def add_e2e_parser(bsub) -> argparse.ArgumentParser:
    p = bsub.add_parser("e2e", help="batch-1 chat: engine with/without draft vs HF transformers")
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--draft", default=None, help="EAGLE draft folder (default: the bundled one)")
    p.add_argument(
        "--algorithm",
        default=None,
        choices=ALGORITHMS,
        help="default: EAGLE or EAGLE3, as the draft's config.json says",
    )
    p.add_argument("--prompts", default="heldout", help="'heldout', 'train' or a JSONL path")
    p.add_argument("--num-prompts", type=positive_int, default=16)
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument(
        "--spec",
        nargs="+",
        default=["5,1,6", "6,4,16"],
        help=f"speculative configurations as {SPEC_SYNTAX}",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="engine rows run this many times round-robin; each row reports its median",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--prompt-lookup-tokens",
        type=int,
        default=10,
        help="HF prompt-lookup decoding's n-gram tokens; 0 leaves that row out",
    )
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_e2e)
    return p


def _timed_passes(
    run_one, prompt_ids: list[list[int]], between=None
) -> tuple[float, list[list[int]], Any]:
    """Untimed pass, then a timed one; returns (seconds, outputs of the timed pass, extra).
    The untimed pass goes longest prompt first: HF's static cache then keeps the largest
    cache length for later calls instead of recompiling for each new length. `between` runs
    after it (the engine's flush_cache: the timed pass prefills as new prompts would; and
    its wait for the decode graphs captured when idle)."""
    for ids in sorted(prompt_ids, key=len, reverse=True):
        run_one(ids)
    if between is not None:
        between()
    outs, extra = [], []
    t0 = time.perf_counter()
    for ids in prompt_ids:
        tokens, info = run_one(ids)
        outs.append(tokens)
        extra.append(info)
    return time.perf_counter() - t0, outs, extra


SPEC_SYNTAX = "steps,topk,num_draft_tokens[:token_map_file[+growth]]"


def parse_spec(spec: str, algorithm: str, draft: str | None) -> tuple[str, dict]:
    """(row label, engine arguments) of one --spec value (SPEC_SYNTAX)."""
    shape, _, token_map = spec.partition(":")
    try:
        steps, topk, ndt = (int(x) for x in shape.split(","))
    except ValueError:
        raise InvalidArgument("--spec", f"{spec!r}: expected {SPEC_SYNTAX}, e.g. 8,8,48") from None
    ndt = chain_sized(steps, topk, ndt)  # (the size the engine runs, so the label says)
    label = f"specserve-{algorithm.lower()} steps={steps} topk={topk} n={ndt}"
    kw: dict = dict(
        speculative_algorithm=algorithm,
        speculative_draft_model_path=draft,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=ndt,
    )
    if token_map:
        path, plus, growth = token_map.rpartition("+")
        if not (plus and growth.isdigit()):  # no "+growth" suffix ('+' may be in a file name)
            path, growth = token_map, ""
        label += f" map={os.path.basename(path)}"
        kw["speculative_token_map"] = path
        if growth:
            label += f"+{int(growth)}"
            kw["speculative_token_map_growth"] = int(growth)
    return label, kw


def _engine_rows(args, prompt_texts: list[str]) -> tuple[list[dict], Any, list[list[int]]]:
    base = dict(model_path=args.model_path, device=args.device, dtype=args.dtype)
    plain = ("specserve", {"no_default_draft": True})
    configs = [plain] + [parse_spec(s, args.algorithm, args.draft) for s in args.spec]
    runs: list[list[tuple[float, list[list[int]], Any]]] = [[] for _ in configs]
    prompt_ids = None
    for _ in range(args.rounds):
        for (_label, kw), config_runs in zip(configs, runs):
            seconds, outs, accept, prompt_ids = _run_engine(
                {**base, **kw}, prompt_texts, prompt_ids, args
            )
            free_device_memory()  # the engine's KV cache, before the next engine sizes its own
            config_runs.append((seconds, outs, accept))
    rows = []
    reference = runs[0][0][1]  # plain decoding's first round
    for (label, _), config_runs in zip(configs, runs):
        tok_s = [sum(map(len, outs)) / seconds for seconds, outs, _ in config_runs]
        tokens = sum(len(o) for o in config_runs[0][1])
        accepts = [a for _, _, a in config_runs if a is not None]
        # every round's outputs count, so a round that decodes differently shows
        same = [a == b for _, outs, _ in config_runs for a, b in zip(outs, reference)]
        row = {
            "system": label,
            "tok_s": statistics.median(tok_s),
            "output_tokens": tokens,
            "seconds": tokens / statistics.median(tok_s),
            "accept_length": statistics.mean(accepts) if accepts else None,
        }
        if args.rounds > 1:
            row["tok_s_rounds"] = [round(t, 1) for t in tok_s]
        row["same_tokens"] = sum(same) / len(same)
        rows.append(row)
    return rows, prompt_ids, reference


def _run_engine(kwargs: dict, prompt_texts: list[str], prompt_ids, args):
    from specserve.bench.one_batch import wait_for_idle_captures
    from specserve.engine import Engine

    sp = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    with Engine(**kwargs) as engine:
        if prompt_ids is None:
            prompt_ids = [
                engine.tokenize_chat([{"role": "user", "content": t}]) for t in prompt_texts
            ]

        def run_one(ids):
            o = engine.generate(input_ids=ids, sampling_params=sp)
            return o["output_ids"], o["meta_info"]

        def between():
            engine.flush_cache()
            wait_for_idle_captures(engine)

        seconds, outs, _ = _timed_passes(run_one, prompt_ids, between)
        accept = engine.stats()["spec_accept_length"]
    return seconds, outs, accept, prompt_ids


def _hf_rows(args, prompt_ids: list[list[int]], reference: list[list[int]]) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from specserve.config import EngineConfig
    from specserve.model.loader import locate

    cfg = EngineConfig(model_path=args.model_path, device=args.device, dtype=args.dtype).resolve()
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    src = locate(args.model_path, "auto")
    if src.kind == "gguf":
        from specserve.bench.hf_gguf import load_transformers_gguf

        model = load_transformers_gguf(src.path, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype)
    model = model.to(device).eval()
    eos = model.generation_config.eos_token_id

    def make(label: str, **gen_kwargs):
        def run_one(ids):
            x = torch.tensor([ids], device=device)
            with torch.inference_mode():
                out = model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    **gen_kwargs,
                )
            return out[0, len(ids) :].tolist(), None

        return label, run_one

    systems = [make("hf-transformers static cache", cache_implementation="static")]
    if args.prompt_lookup_tokens > 0:
        systems.append(
            make(
                f"hf-transformers prompt lookup ({args.prompt_lookup_tokens})",
                prompt_lookup_num_tokens=args.prompt_lookup_tokens,
            )
        )
    rows = []
    for label, run_one in systems:
        seconds, outs, _ = _timed_passes(run_one, prompt_ids)
        # HF's generate keeps the EOS token in its output, as the engine does
        tokens = sum(len(o) for o in outs)
        rows.append(
            {
                "system": label,
                "tok_s": tokens / seconds,
                "output_tokens": tokens,
                "seconds": seconds,
                "accept_length": None,
                "same_tokens": sum(a == b for a, b in zip(outs, reference)) / len(outs),
            }
        )
    return rows


def run_e2e(args) -> list[dict[str, Any]]:
    from specserve.model.registry import bundled_draft_folder
    from specserve.train.prompts import load_prompts

    if args.draft is None:
        args.draft = bundled_draft_folder(args.model_path)
        if args.draft is None:
            raise InvalidArgument("--draft", f"no bundled draft for {args.model_path}: pass one")
    if args.algorithm is None:
        from specserve.speculative.eagle_checkpoint import draft_algorithm

        args.algorithm = draft_algorithm(args.draft)
    if args.rounds < 1:
        raise InvalidArgument("--rounds", f"must be >= 1, got {args.rounds}")
    texts = load_prompts(args.prompts)[: args.num_prompts]
    rows, prompt_ids, reference = _engine_rows(args, texts)
    if not args.skip_hf:
        try:
            rows += _hf_rows(args, prompt_ids, reference)
            free_device_memory()
        except ImportError as e:
            print(f"HF transformers not run: {e}")
    plain = rows[0]["tok_s"]
    hf_best = max((r["tok_s"] for r in rows if r["system"].startswith("hf")), default=None)
    for r in rows:
        r["vs_specserve_plain"] = r["tok_s"] / plain
        r["vs_hf_best"] = r["tok_s"] / hf_best if hf_best else None
    return rows


def cmd_e2e(args) -> int:
    rows = run_e2e(args)
    dump(rows, args.output_json)
    return 0
