"""`specserve bench acceptance`: greedy accept lengths of a draft on held-out prompts.

For every configuration (chains of 3, 5 and 7 steps; trees of topk 4 and 8 with 16 to 64
draft tokens, or `--configs`) an Engine with the draft answers the held-out prompts
(`specserve/data/heldout_prompts.jsonl`, never used for training; chat template, greedy)
and we report the mean accept length (tokens emitted per verify step, the bonus token
included; the engine's own counter), the per-request mean, the histogram of accept lengths
and the decode time. JSON on stdout (and `--output`), then a table.

    specserve bench acceptance --target smollm2-135m \
        --draft specserve/data/drafts/smollm2-135m-eagle --num-prompts 50
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from specserve.bench.args import positive_int
from specserve.config.speculative import ALGORITHMS, chain_sized
from specserve.model.registry import DEFAULT_MODEL

# name, num_steps, topk, num_draft_tokens
DEFAULT_CONFIGS: list[tuple[str, int, int, int]] = [
    ("chain-3", 3, 1, 4),
    ("chain-5", 5, 1, 6),
    ("chain-7", 7, 1, 8),
    ("tree-k4-n16", 5, 4, 16),
    ("tree-k4-n32", 8, 4, 32),
    ("tree-k8-n32", 6, 8, 32),
    ("tree-k8-n64", 8, 8, 64),
    ("tree-k8-n64-s5", 5, 8, 64),  # SGLang's usual shape: 64 of the 8 + 4 x 64 candidates
]


def parse_config(text: str) -> tuple[str, int, int, int]:
    """'STEPS,TOPK,TOKENS' (e.g. 5,1,6 or 5,4,16)."""
    try:
        steps, topk, tokens = (int(x) for x in text.split(","))
    except ValueError as e:
        raise ValueError(f"config {text!r}: expected STEPS,TOPK,TOKENS") from e
    tokens = chain_sized(steps, topk, tokens)  # (the size the engine runs, so the row says)
    name = f"chain-{steps}" if topk == 1 else f"tree-k{topk}-n{tokens}-s{steps}"
    return name, steps, topk, tokens


def draft_and_algorithm(target: str, draft: str | None, algorithm: str | None) -> tuple[str, str]:
    """The draft (default: the target's bundled one) and its algorithm (default: what its
    checkpoint is for); an algorithm the draft is not for is refused, naming the flag."""
    from specserve.errors import InvalidArgument
    from specserve.model.registry import bundled_draft_folder
    from specserve.speculative.eagle_checkpoint import draft_algorithm

    if draft is None:
        draft = bundled_draft_folder(target)
        if draft is None:
            raise InvalidArgument("--draft", f"no bundled draft for {target}: pass one")
    detected = draft_algorithm(draft)
    if algorithm is not None and algorithm != detected:
        raise InvalidArgument(
            "--algorithm",
            f"{draft} is a draft for {detected}, not {algorithm}: pass --algorithm {detected} "
            "(or leave it out), or a --draft for it",
        )
    return draft, detected


def config_kwargs(
    target: str,
    draft: str,
    algorithm: str,
    config: tuple[str, int, int, int],
    engine_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Engine arguments of one configuration."""
    from specserve.train.generate import engine_kwargs_known

    _, steps, topk, tokens = config
    return dict(
        model_path=target,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=draft,
        speculative_num_steps=steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=tokens,
        **engine_kwargs_known(engine_overrides or {}),
    )


def run_config(
    target: str,
    draft: str,
    algorithm: str,
    config: tuple[str, int, int, int],
    prompts: list[str],
    max_new_tokens: int,
    engine_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from specserve.engine import Engine

    name, steps, topk, tokens = config
    with Engine(**config_kwargs(target, draft, algorithm, config, engine_overrides)) as engine:
        ids = [engine.tokenize_chat([{"role": "user", "content": p}]) for p in prompts]
        t0 = time.perf_counter()
        outs = engine.generate(
            input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens}
        )
        seconds = time.perf_counter() - t0
        stats = engine.stats()
    hist: list[int] = []
    per_request = []
    completion = 0
    for o in outs:
        meta = o["meta_info"]
        completion += meta["completion_tokens"]
        if "spec_accept_length" in meta:
            per_request.append(meta["spec_accept_length"])
        for i, c in enumerate(meta.get("spec_accept_histogram", [])):
            while len(hist) <= i:
                hist.append(0)
            hist[i] += c
    return {
        "config": name,
        "num_steps": steps,
        "topk": topk,
        "num_draft_tokens": tokens,
        "accept_length": round(stats["spec_accept_length"] or 0.0, 4),
        "accept_length_per_request": round(sum(per_request) / max(1, len(per_request)), 4),
        "verify_steps": stats["spec_verify_ct"],
        "completion_tokens": completion,
        "seconds": round(seconds, 2),
        "histogram": hist,  # histogram[i]: verify steps that emitted i + 1 tokens
    }


def run_acceptance(
    target: str,
    draft: str,
    algorithm: str = "EAGLE",
    configs: list[tuple[str, int, int, int]] | None = None,
    num_prompts: int = 50,
    max_new_tokens: int = 128,
    prompts: str = "heldout",
    engine_overrides: dict[str, Any] | None = None,
    log=None,
    on_row=None,
) -> list[dict[str, Any]]:
    """One row per configuration (an impossible one is skipped with a log line); `on_row(rows)`
    is called after each, e.g. to save partial results."""
    from specserve.errors import InvalidArgument
    from specserve.train.prompts import load_prompts

    texts = load_prompts(prompts)[:num_prompts]
    rows = []
    for cfg in configs or DEFAULT_CONFIGS:
        try:
            row = run_config(target, draft, algorithm, cfg, texts, max_new_tokens, engine_overrides)
        except InvalidArgument as e:  # one impossible configuration does not end the sweep
            if log is not None:
                log(f"{cfg[0]}: skipped ({e})")
            continue
        rows.append(row)
        if log is not None:
            log(f"{row['config']}: accept length {row['accept_length']:.3f}")
        if on_row is not None:
            on_row(rows)
    return rows


def engine_overrides(args) -> dict[str, Any]:
    """--engine-arg values, with --dtype and --device when given."""
    from specserve.train.generate import parse_engine_args

    overrides = parse_engine_args(args.engine_arg)
    overrides.update({k: v for k, v in (("dtype", args.dtype), ("device", args.device)) if v})
    return overrides


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["config", "num_steps", "topk", "num_draft_tokens", "accept_length", "seconds"]
    print(" | ".join(cols + ["histogram"]))
    print(" | ".join("---" for _ in range(len(cols) + 1)))
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print(" | ".join(cells + [" ".join(str(x) for x in r["histogram"])]))


def add_acceptance_parser(bsub) -> None:
    p = bsub.add_parser(
        "acceptance", help="greedy accept length of a draft on held-out prompts (chains, trees)"
    )
    p.add_argument(
        "--target", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})"
    )
    p.add_argument(
        "--draft", default=None, help="draft checkpoint (default: the bundled one for the target)"
    )
    p.add_argument(
        "--algorithm",
        default=None,
        choices=ALGORITHMS,
        help="default: EAGLE or EAGLE3, as the draft's config.json says",
    )
    p.add_argument("--num-prompts", type=positive_int, default=50)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument(
        "--prompts", default="heldout", help="'heldout' (default), 'train' or a JSONL file"
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="STEPS,TOPK,TOKENS each (default: chains of 3/5/7, trees of topk 4 and 8)",
    )
    p.add_argument("--dtype", default=None, help="engine dtype (default: the engine's choice)")
    p.add_argument("--device", default=None)
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other engine argument (repeatable), e.g. max_total_tokens=65536",
    )
    p.add_argument("--output", default=None, help="also write the JSON here")

    def run(args) -> int:
        import sys

        draft, args.algorithm = draft_and_algorithm(args.target, args.draft, args.algorithm)
        configs = [parse_config(c) for c in args.configs] if args.configs else None
        overrides = engine_overrides(args)

        def save(rows) -> None:  # after every configuration: a timeout keeps what was measured
            if args.output:
                result = {"target": args.target, "draft": draft, "algorithm": args.algorithm}
                with open(args.output + ".tmp", "w") as f:
                    json.dump({**result, "rows": rows}, f, indent=2)
                os.replace(args.output + ".tmp", args.output)

        rows = run_acceptance(
            args.target,
            draft,
            args.algorithm,
            configs,
            args.num_prompts,
            args.max_new_tokens,
            args.prompts,
            overrides,
            log=lambda m: print(m, file=sys.stderr, flush=True),
            on_row=save,
        )
        result = {"target": args.target, "draft": draft, "algorithm": args.algorithm, "rows": rows}
        print(json.dumps(result, indent=2))
        save(rows)
        print_table(rows)
        if not rows:  # (each one's reason is logged above)
            print("error: every configuration failed", file=sys.stderr)
            return 1
        return 0

    p.set_defaults(func=run)
