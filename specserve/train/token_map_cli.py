"""`specserve token-map`: a reduced draft vocabulary (speculative/token_map.py) from the target's own
answers to the bundled training prompts, generated greedily by this engine.

    specserve token-map --target smollm2-135m --out ./maps --sizes 4096 8192 --device cuda

writes `token_map_<size>.json` per size into `--out` (most frequent first, with the share of
answer tokens each covers); serve with `--speculative-token-map ./maps/token_map_8192.json`.
`train-eagle --token-map-size N` writes one beside the draft it trains. Check the accept
length with and without it (`bench acceptance --engine-arg speculative_token_map=...`): a map
pays only where it covers what the target emits on the prompts served (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import os
import sys
import time

from specserve.model.registry import DEFAULT_MODEL


def add_token_map_parser(sub) -> None:
    from specserve.train.data import DataArgs

    d = DataArgs()
    p = sub.add_parser(
        "token-map", help="a draft's reduced vocabulary: the target's most frequent answer tokens"
    )
    p.add_argument(
        "--target", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})"
    )
    p.add_argument("--out", required=True, help="folder for token_map_<size>.json")
    p.add_argument(
        "--sizes", type=int, nargs="+", default=[8192], help="tokens kept (default 8192)"
    )
    p.add_argument("--prompts", default="train", help="'train' (bundled) or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=4000)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--generator", default="engine", help="'engine' or 'dense' (as train-eagle)")
    p.add_argument("--gen-batch-size", type=int, default=d.batch_size)
    p.add_argument("--gen-time-budget", type=float, default=0.0, help="seconds (0: no limit)")
    p.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="as train-eagle"
    )
    p.set_defaults(func=run_token_map)


def write_token_maps(
    out: str, sizes: list[int], answers, prompts, vocab_size: int, source: dict
) -> list[str]:
    """`out` a folder: one `token_map_<size>.json` per size; `out` a .json path: that file
    (one size). Returns the paths written."""
    from specserve.speculative.token_map import rank_tokens, save_token_map

    paths = []
    for size in sizes:
        ids, coverage = rank_tokens(answers, vocab_size, size, prompts)
        path = out if out.endswith(".json") else os.path.join(out, f"token_map_{size}.json")
        save_token_map(path, ids, coverage=round(coverage, 5), source=source)
        print(
            f"token-map: {path}: {len(ids)} tokens cover {100 * coverage:.2f}% of "
            f"{sum(map(len, answers))} answer tokens",
            file=sys.stderr,
        )
        paths.append(path)
    return paths


def run_token_map(args) -> int:
    from specserve.errors import InvalidArgument
    from specserve.model.loader import locate, read_config
    from specserve.train.arg_checks import check_target, check_token_map_args
    from specserve.train.data import DataArgs, generate_answer_set
    from specserve.train.generate import parse_engine_args

    check_token_map_args(args)
    check_target(args, generates=True)
    vocab = read_config(locate(args.target, args.load_format)).vocab_size
    for size in args.sizes:
        if size > vocab:  # (the map would hold the whole vocabulary, yet be named for more)
            raise InvalidArgument(
                "--sizes",
                f"each size must be at most the target's vocabulary of {vocab}, got {size}",
            )
    one_file = args.out.endswith(".json")
    t0 = time.perf_counter()
    data_args = DataArgs(
        target=args.target,
        # the answers' work folder sits beside a one-file output, inside an output folder
        out_dir=os.path.splitext(args.out)[0] + ".gen"
        if one_file
        else os.path.join(args.out, ".gen"),
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        generator=args.generator,
        batch_size=args.gen_batch_size,
        time_budget=args.gen_time_budget,
        device=args.device,
        load_format=args.load_format,
        engine_kwargs=parse_engine_args(args.engine_arg),
    )
    os.makedirs(data_args.out_dir, exist_ok=True)
    answers, prompt_ids, _ = generate_answer_set(data_args, None)
    source = {
        "target": args.target,
        "prompts": f"{args.prompts} (first {len(prompt_ids)} after the seed-0 shuffle)",
        "answers": len(answers),
        "answer_tokens": sum(map(len, answers)),
        "max_new_tokens": args.max_new_tokens,
        "decoding": "greedy",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_token_maps(args.out, args.sizes, answers, prompt_ids, vocab, source)
    return 0
