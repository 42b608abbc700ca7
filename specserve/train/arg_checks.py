"""The train-eagle and token-map flags, checked before any model loads or data is generated:
a bad value is an InvalidArgument naming the flag and what it may be (the CLI's one-line
error), not a traceback minutes later or a Python slice taken from a negative count."""

from __future__ import annotations

import os

from specserve.errors import InvalidArgument
from specserve.train.data import DTYPES
from specserve.train.generate import parse_workers

AUTOCAST = ("bfloat16", "float16", "float32")


def _at_least(args, name: str, low: int | float, why: str = "") -> None:
    value = getattr(args, name)
    if value < low:
        flag = "--" + name.replace("_", "-")
        raise InvalidArgument(flag, f"must be >= {low}{why}, got {value}")


def _one_of(args, name: str, allowed) -> None:
    value = getattr(args, name)
    if value not in allowed:
        flag = "--" + name.replace("_", "-")
        raise InvalidArgument(flag, f"must be one of {', '.join(allowed)}, got {value!r}")


def _folder_flag(flag: str, path: str | None) -> None:
    if path and os.path.isfile(path):
        raise InvalidArgument(flag, f"{path} is a file; a folder is needed")


def _generation(args) -> None:
    """The flags of the data generation train-eagle and token-map share."""
    _at_least(args, "num_prompts", 1)
    _at_least(args, "max_new_tokens", 1)
    _at_least(args, "gen_batch_size", 1)
    _at_least(args, "gen_time_budget", 0, " (0: no limit)")
    try:
        workers = parse_workers(args.generator)
    except ValueError as e:
        raise InvalidArgument(
            "--generator", f"{e}; e.g. 'engine', 'dense', 'engine:4,dense:1'"
        ) from None
    if args.engine_arg and "engine" not in workers:
        raise InvalidArgument(
            "--engine-arg", f"configures engine workers; --generator {args.generator} has none"
        )


def check_train_args(args) -> None:
    _generation(args)
    _at_least(args, "seed", 0)
    _at_least(args, "sampled_passes", 0)
    if args.sampled_passes or args.sampled_pass:
        if any(t <= 0 for t in args.temperature):
            raise InvalidArgument("--temperature", f"must be > 0, got {args.temperature}")
    _one_of(args, "gen_dtype", tuple(DTYPES))
    _one_of(args, "feature_dtype", tuple(DTYPES))
    _one_of(args, "autocast", AUTOCAST)
    _at_least(args, "epochs", 0, " (0: no limit, with --time-budget)")
    _at_least(args, "time_budget", 0, " (0: no limit)")
    if args.epochs <= 0 and args.time_budget <= 0:
        raise InvalidArgument("--epochs", "give --epochs > 0, or a --time-budget, or both")
    _at_least(args, "batch_size", 1)
    _at_least(args, "batch_tokens", 0, " (0: by --batch-size)")
    _at_least(args, "ttt_steps", 0)
    _at_least(args, "max_len", 2)
    _at_least(args, "log_every", 1)
    _at_least(args, "save_every", 0, " (0: by time)")
    _at_least(args, "ce_chunk", 0)
    if not 0 <= args.val_fraction < 1:
        raise InvalidArgument("--val-fraction", f"must be in [0, 1), got {args.val_fraction}")
    if args.token_map_size < 0:
        raise InvalidArgument(
            "--token-map-size", f"must be >= 0 (0: none), got {args.token_map_size}"
        )
    if args.draft_layers < 1 or (args.head == "eagle3" and args.draft_layers != 1):
        raise InvalidArgument(
            "--draft-layers",
            f"must be >= 1 for --head eagle and 1 for --head eagle3, got {args.draft_layers}",
        )
    if args.draft_vocab is not None:
        if args.head != "eagle3":
            raise InvalidArgument(
                "--draft-vocab",
                "applies to --head eagle3 (an EAGLE head drafts over the target's vocabulary; "
                "--token-map-size writes a reduced one for it)",
            )
        _at_least(args, "draft_vocab", 0, " (0: the whole vocabulary)")
    if args.token_map_size and args.head == "eagle3":
        raise InvalidArgument(
            "--token-map-size", "applies to --head eagle (an EAGLE3 head drafts its own vocabulary)"
        )
    if args.init_layer is not None:
        _at_least(args, "init_layer", 0)
    for flag, path in (("--out", args.out), ("--work-dir", args.work_dir)):
        _folder_flag(flag, path)
    if args.curve_file:
        parent = os.path.dirname(os.path.abspath(args.curve_file))
        if not os.path.isdir(parent):
            raise InvalidArgument("--curve-file", f"its folder {parent} does not exist")


def check_token_map_args(args) -> None:
    _generation(args)
    for size in args.sizes:
        if size < 1:
            raise InvalidArgument("--sizes", f"each size must be >= 1, got {size}")
    if args.out.endswith(".json") and len(args.sizes) > 1:
        raise InvalidArgument(
            "--sizes",
            f"--out {args.out} is one file, so --sizes takes one value (got {args.sizes}); "
            "give a folder for several maps",
        )
    if not args.out.endswith(".json"):
        _folder_flag("--out", args.out)
    elif os.path.isdir(args.out):
        raise InvalidArgument("--out", f"{args.out} is a folder; a .json file path is needed")
