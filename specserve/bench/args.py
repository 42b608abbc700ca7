"""Argument types shared by the bench commands."""

from __future__ import annotations

import argparse
import math
import os

from specserve.train.prompts import BUNDLED_PROMPTS


class HelpWithDefaults(
    argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter
):
    """The description as written, an option's default after its help where it has one to
    tell (an unset option's help says what it falls back to)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


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
    if value in allowed:
        return
    if not os.path.isfile(value):
        _fail(flag, f"{value!r} is neither one of {', '.join(allowed)} nor a JSONL file")
    from specserve.train.prompts import load_prompts

    try:  # (read as the run will read it: a line it cannot take is refused now)
        load_prompts(value)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        _fail(flag, str(e))


def _existing(flag: str, path: str | None) -> None:
    if path is not None and not os.path.exists(path):
        _fail(flag, f"{path} does not exist")


def _model(flag: str, path: str) -> None:
    """A packaged model, a preset (random weights) or an existing file or folder."""
    from specserve.model.config import PRESETS
    from specserve.model.registry import packaged_model_names

    names = sorted({*PRESETS, *packaged_model_names()})
    if path.lower() not in names and not os.path.exists(path):
        _fail(flag, f"{path} does not exist (and is not one of {', '.join(names)})")


def _engine_args(items: list[str]) -> dict:
    from specserve.train.generate import parse_engine_args

    try:
        return parse_engine_args(items)
    except ValueError as e:
        _fail("--engine-arg", str(e))


def _resolves(kwargs: dict, flags: dict[str, str], what: str = "") -> object:
    """EngineConfig's own checks (no model is read) of `kwargs`, a refusal naming the flag
    that set the field (`flags`; any other field came from --engine-arg). `what` prefixes a
    refusal of --configs. Returns the resolved config."""
    from specserve.config import EngineConfig
    from specserve.errors import InvalidArgument

    try:
        return EngineConfig.from_kwargs(**kwargs).resolve()
    except InvalidArgument as e:
        message = str(e).removeprefix(f"{e.field}: ")
        if e.field in flags:  # (`what`: which of the --configs)
            prefix = what if flags[e.field] in ("--configs", "--spec") else ""
            _fail(flags[e.field], f"{prefix}{message} ({e.field})")
        _fail("--engine-arg", f"{e.field}: {message}")


# the engine fields `bench acceptance` sets from its own flags
ACCEPTANCE_FLAGS = {
    "model_path": "--target",
    "speculative_draft_model_path": "--draft",
    "speculative_algorithm": "--algorithm",
    "speculative_num_steps": "--configs",
    "speculative_eagle_topk": "--configs",
    "speculative_num_draft_tokens": "--configs",
}


def check_acceptance(args) -> None:
    from specserve.bench.acceptance import (
        DEFAULT_CONFIGS,
        config_kwargs,
        draft_and_algorithm,
        engine_overrides,
        parse_config,
    )

    check_output_files(args)
    _model("--target", args.target)
    _existing("--draft", args.draft)
    _prompt_set("--prompts", args.prompts)
    _engine_args(args.engine_arg)
    configs = []
    for text in args.configs or ():
        try:
            configs.append(parse_config(text))
        except ValueError as e:
            _fail("--configs", f"{e}, e.g. 5,1,6 or 6,8,64")
        if min(configs[-1][1:]) < 1:
            _fail("--configs", f"{text!r}: STEPS, TOPK and TOKENS must be >= 1")
    draft, algorithm = draft_and_algorithm(args.target, args.draft, args.algorithm)
    flags = {**ACCEPTANCE_FLAGS, "dtype": "--dtype", "device": "--device"}
    for config in configs or DEFAULT_CONFIGS:
        kwargs = config_kwargs(args.target, draft, algorithm, config, engine_overrides(args))
        what = f"{config[0]} ({','.join(map(str, config[1:]))}): " if args.configs else ""
        _resolves(kwargs, flags, what)


def check_compare(args) -> None:
    from specserve.config.speculative import MAX_STEPS, MAX_TOPK

    check_output_files(args)
    _model("--model-path", args.model_path)
    _existing("--draft", args.draft)
    if args.draft_vocab_size < 1:
        _fail("--draft-vocab-size", f"must be >= 1, got {args.draft_vocab_size}")
    if not 1 <= args.num_steps <= MAX_STEPS:
        _fail("--num-steps", f"must be in [1, {MAX_STEPS}], got {args.num_steps}")
    if not 1 <= args.topk <= MAX_TOPK:
        _fail("--topk", f"must be in [1, {MAX_TOPK}], got {args.topk}")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        _fail("--num-draft-tokens", f"must be >= 1, got {args.num_draft_tokens}")
    # the speculative rows' configuration, checked as their engines will check it
    flags = {
        "model_path": "--model-path",
        "load_format": "--load-format",
        "device": "--device",
        "dtype": "--dtype",
        "speculative_draft_model_path": "--draft",
        "speculative_num_steps": "--num-steps",
        "speculative_eagle_topk": "--topk",
        "speculative_num_draft_tokens": "--num-draft-tokens",
    }
    cfg = _resolves(
        dict(
            model_path=args.model_path,
            load_format=args.load_format,
            device=args.device,
            dtype=args.dtype,
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=args.draft or "random",  # (written later)
            speculative_num_steps=args.num_steps,
            speculative_eagle_topk=args.topk,
            speculative_num_draft_tokens=args.num_draft_tokens or 1 + args.num_steps * args.topk,
        ),
        flags,
    )
    # the engine clips a longer accept length, which would mislabel its row
    longest = min(cfg.speculative_num_steps, cfg.speculative_num_draft_tokens - 1) + 1
    for length in args.accept_lengths:
        if not 1 <= length <= longest:
            _fail(
                "--accept-lengths",
                f"each must be in [1, {longest}] (1 + min(--num-steps, --num-draft-tokens - 1)),"
                f" got {length}",
            )


def check_e2e(args) -> None:
    check_output_files(args)
    _model("--model-path", args.model_path)
    _existing("--draft", args.draft)
    _prompt_set("--prompts", args.prompts)
    if args.rounds < 1:
        _fail("--rounds", f"must be >= 1, got {args.rounds}")
    from specserve.bench.e2e import parse_spec
    from specserve.errors import InvalidArgument

    flags = {"model_path": "--model-path", "device": "--device", "dtype": "--dtype"}
    model = {"model_path": args.model_path, "device": args.device, "dtype": args.dtype}
    for spec in args.spec:  # (each row's engine, checked before the first row runs)
        try:  # (the draft's algorithm is read from it later; the tree's checks do not need it)
            _, kwargs = parse_spec(spec, args.algorithm or "EAGLE", args.draft or "random")
        except InvalidArgument as e:
            _fail("--spec", str(e).removeprefix("--spec: "))
        spec_flags = {**flags, **dict.fromkeys(kwargs, "--spec")}
        spec_flags["speculative_draft_model_path"] = "--draft"
        _resolves({**model, **kwargs}, spec_flags, f"{spec!r}: ")
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
    if not 0 < args.port < 65536:
        _fail("--port", f"must be in [1, 65535], got {args.port}")
    if args.base_url is not None:
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(args.base_url)
            port = parts.port  # (raises ValueError when out of range)
        except ValueError as e:
            _fail("--base-url", f"{args.base_url!r}: {e}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            _fail("--base-url", f"{args.base_url!r}: expected http(s)://HOST[:PORT]")
        del port


def check_profile(args) -> None:
    import torch

    check_output_files(args)
    # it profiles CUDA kernels: on a CPU its profile would be empty
    if not torch.cuda.is_available():
        _fail(
            "--device",
            "bench profile-step profiles CUDA kernels and needs a CUDA device; none is available",
        )
    if args.device is not None and not args.device.startswith(("cuda", "auto")):
        _fail(
            "--device",
            f"bench profile-step profiles CUDA kernels: use cuda or cuda:N, not {args.device!r}",
        )


CHECKS = {
    "acceptance": check_acceptance,
    "compare": check_compare,
    "e2e": check_e2e,
    "multiturn": check_multiturn,
    "serving": check_serving,
    "one-batch": check_output_files,
    "profile-step": check_profile,
}
