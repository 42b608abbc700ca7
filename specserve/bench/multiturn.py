"""`specserve bench multiturn`: multi-turn chat traffic through the prefix cache.

C conversations share a system prompt; each turn of every conversation is sent together
(concurrency C), its prompt being the whole history so far (system, the earlier user turns
and the engine's own answers) plus a new user turn. Rows: one per engine configuration (plain
or speculative, cache on or off); columns: the prefix cache's hit rate (prompt tokens served
from the cache / prompt tokens), TTFT of the first turn and of the later ones (mean over
requests, as the engine reports it), and output tokens per second over all turns, after
every turn of other conversations untimed (both engines then serve shapes they have met:
specserve captures a decode graph when it first meets a batch size and context width, and
`graph_captures_timed` counts those left in the timed turns). Token ids are random (the
cache keys on ids; no tokenizer needed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from typing import Any

from specserve.bench.args import positive_int
from specserve.bench.one_batch import dump, free_device_memory, wait_for_idle_captures


def add_multiturn_parser(bsub, add_engine_args, engine_kwargs) -> argparse.ArgumentParser:
    p = bsub.add_parser("multiturn", help="multi-turn chat through the prefix cache")
    p.add_argument("--conversations", type=positive_int, default=32)
    p.add_argument("--turns", type=positive_int, default=4)
    p.add_argument("--system-len", type=int, default=512, help="shared system prompt tokens")
    p.add_argument("--user-len", type=positive_int, default=64, help="tokens of each user turn")
    p.add_argument("--answer-len", type=positive_int, default=128, help="tokens of each answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["plain", "plain-nocache", "spec", "spec-nocache"],
        help="plain | spec (the engine's speculative flags, or a packaged model's bundled "
        "draft), each optionally -nocache",
    )
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    p.set_defaults(func=lambda args: cmd_multiturn(args, engine_kwargs(args)))
    return p


def conversations(args, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and every conversation's user turns (random ids, away from
    the special tokens at the start of a vocabulary)."""
    import torch

    g = torch.Generator().manual_seed(args.seed)

    def ids(n: int) -> list[int]:
        return torch.randint(min(100, vocab // 4), vocab, (n,), generator=g).tolist()

    system = ids(args.system_len)
    return system, [
        [ids(args.user_len) for _ in range(args.turns)] for _ in range(args.conversations)
    ]


def warm_up(args, vocab: int, generate) -> None:
    """Every turn of other conversations, untimed: kernels compile, and the graphs of every
    batch size and context width the timed turns reach are captured (specserve captures a
    decode graph once it meets a shape, or when idle; vLLM captures its graphs at start-up).
    generate(prompts) -> each prompt's output ids."""
    system, users = conversations(
        argparse.Namespace(**{**vars(args), "seed": args.seed + 1}), vocab
    )
    histories = [list(system) for _ in users]
    for turn in range(args.turns):
        outs = generate([h + u[turn] for h, u in zip(histories, users)])
        for h, u, out in zip(histories, users, outs):
            h += u[turn] + out


def _output_ids(engine, sp: dict, prompts: list[list[int]]) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]


def plain_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` without speculative decoding: its settings and simulated acceptance (which
    needs it) dropped, and no bundled draft."""
    drop = ("speculative_", "simulate_acc_")
    return {k: v for k, v in kwargs.items() if not k.startswith(drop)} | {"no_default_draft": True}


def check_spec_variants(variants: list[str], kwargs: dict[str, Any]) -> None:
    """A `spec` variant needs a draft (the speculative flags', or a packaged model's bundled
    one): without one it would run plain decoding under the label "spec"."""
    from specserve.config import EngineConfig
    from specserve.errors import InvalidArgument

    spec = [v for v in variants if v.startswith("spec")]
    if spec and EngineConfig.from_kwargs(**kwargs).resolve().speculative_algorithm is None:
        raise InvalidArgument(
            "--variants",
            f"{', '.join(spec)} needs a draft: pass --speculative-algorithm and "
            "--speculative-draft-model-path, or use a packaged model with its bundled draft "
            "(not --load-format dummy or --no-default-draft), or run only plain variants",
        )


def run_variant(variant: str, kwargs: dict[str, Any], args) -> dict[str, Any]:
    from specserve.engine import Engine

    speculative, _, nocache = variant.partition("-")
    kw = dict(kwargs, disable_radix_cache=bool(nocache))
    if speculative == "plain":
        kw = plain_kwargs(kw)
    sp = {"temperature": 0.0, "max_new_tokens": args.answer_len, "ignore_eos": True}
    ttft = {"first": [], "later": []}
    tokens, seconds, accept = 0, 0.0, None
    with Engine(**kw) as engine:
        vocab = engine.core.model_config.vocab_size
        warm_up(args, vocab, partial(_output_ids, engine, sp))
        engine.flush_cache()
        wait_for_idle_captures(engine)
        before = engine.stats()
        system, users = conversations(args, vocab)
        histories = [list(system) for _ in users]
        for turn in range(args.turns):
            prompts = [h + u[turn] for h, u in zip(histories, users)]
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=sp)
            seconds += time.perf_counter() - t0
            for h, u, o in zip(histories, users, outs):
                h += u[turn] + o["output_ids"]
                tokens += len(o["output_ids"])
                ttft["first" if turn == 0 else "later"].append(o["meta_info"]["ttft"])
        stats = engine.stats()
        accept = stats["spec_accept_length"]
    del engine  # its KV cache must be freed before the next engine sizes its own
    free_device_memory()
    query = stats["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
    hits = stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    return {
        "system": f"specserve {variant}",
        "hit_rate": hits / query if query else 0.0,
        "ttft_first_turn_ms": 1e3 * statistics.mean(ttft["first"]),
        "ttft_later_turns_ms": 1e3 * statistics.mean(ttft["later"]) if ttft["later"] else None,
        "output_tok_s": tokens / seconds,
        "accept_length": accept,
        # graphs the timed turns still captured: their capture time is in the TTFTs
        "graph_captures_timed": stats["num_graph_captures"] - before["num_graph_captures"],
        "conversations": args.conversations,
        "turns": args.turns,
    }


def cmd_multiturn(args, kwargs: dict[str, Any]) -> int:
    check_spec_variants(args.variants, kwargs)
    rows = [run_variant(v, kwargs, args) for v in args.variants]
    dump(rows, args.output_json)
    return 0
