"""Argument types shared by the bench commands."""

from __future__ import annotations

import argparse
import math
import os


def positive_int(value: str) -> int:
    """An integer >= 1 (counts and lengths: zero would measure nothing)."""
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return v


# ---------------------------------------------------------------------------------------
# Checks run before a bench command loads anything (bench/cli.py wires them): a bad value
# is an InvalidArgument naming the flag (the CLI's one-line error, exit 2), not a traceback
# after minutes of measuring or a run that silently measures something else.

MULTITURN_VARIANTS = ("plain", "plain-nocache", "spec", "spec-nocache")
BUNDLED_PROMPTS = ("train", "heldout")


def _fail(flag: str, message: str):
    from specserve.errors import InvalidArgument

    raise InvalidArgument(flag, message)


def check_output_files(args, names=("output_json", "output", "plot")) -> None:
    """Result files are written after the run: their folder must exist before it."""
    for name in names:
        path = getattr(args, name, None)
        if not path:
            continue
        flag = "--" + name.replace("_", "-")
        if os.path.isdir(path):
            _fail(flag, f"{path} is a folder; a file path is needed")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            _fail(flag, f"its folder {parent} does not exist")


def _prompt_set(flag: str, value: str, allowed=BUNDLED_PROMPTS) -> None:
    if value not in allowed and not os.path.isfile(value):
        _fail(flag, f"{value!r} is neither one of {', '.join(allowed)} nor a JSONL file")


def _existing(flag: str, path: str | None) -> None:
    if path is not None and not os.path.exists(path):
        _fail(flag, f"{path} does not exist")


def _engine_args(items: list[str]) -> None:
    from specserve.train.generate import parse_engine_args

    try:
        parse_engine_args(items)
    except ValueError as e:
        _fail("--engine-arg", str(e))


def check_acceptance(args) -> None:
    from specserve.bench.acceptance import parse_config

    check_output_files(args)
    _existing("--draft", args.draft)
    _prompt_set("--prompts", args.prompts)
    _engine_args(args.engine_arg)
    for text in args.configs or ():
        try:
            _, steps, topk, tokens = parse_config(text)
        except ValueError as e:
            _fail("--configs", f"{e}, e.g. 5,1,6 or 6,8,64")
        if min(steps, topk, tokens) < 1:
            _fail("--configs", f"{text!r}: STEPS, TOPK and TOKENS must be >= 1")


def check_compare(args) -> None:
    check_output_files(args)
    _existing("--draft", args.draft)
    if args.draft_vocab_size < 1:
        _fail("--draft-vocab-size", f"must be >= 1, got {args.draft_vocab_size}")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        _fail("--num-draft-tokens", f"must be >= 1, got {args.num_draft_tokens}")


def check_e2e(args) -> None:
    check_output_files(args)
    _existing("--draft", args.draft)
    _prompt_set("--prompts", args.prompts)
    if args.rounds < 1:
        _fail("--rounds", f"must be >= 1, got {args.rounds}")
    if args.prompt_lookup_tokens < 0:
        _fail(
            "--prompt-lookup-tokens",
            f"must be >= 0 (0: no such row), got {args.prompt_lookup_tokens}",
        )


def check_multiturn(args) -> None:
    check_output_files(args)
    if args.system_len < 0:
        _fail("--system-len", f"must be >= 0 (0: no system prompt), got {args.system_len}")
    for v in args.variants:
        if v not in MULTITURN_VARIANTS:
            _fail("--variants", f"{v!r} is not one of {', '.join(MULTITURN_VARIANTS)}")


def check_serving(args) -> None:
    check_output_files(args)
    _prompt_set("--dataset", args.dataset, ("bundled", "random"))
    if args.warmup < 0:
        _fail("--warmup", f"must be >= 0, got {args.warmup}")
    if not 0 < args.timeout < math.inf:
        _fail("--timeout", f"must be a finite number of seconds > 0, got {args.timeout}")
    if not 0 <= args.temperature < math.inf:
        _fail("--temperature", f"must be a finite number >= 0, got {args.temperature}")
    if args.vocab_size is not None and args.vocab_size < 1:
        _fail("--vocab-size", f"must be >= 1, got {args.vocab_size}")


CHECKS = {
    "acceptance": check_acceptance,
    "compare": check_compare,
    "e2e": check_e2e,
    "multiturn": check_multiturn,
    "serving": check_serving,
    "one-batch": check_output_files,
    "profile-step": check_output_files,
}
