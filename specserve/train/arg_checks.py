"""The train-eagle and token-map flags, checked before any model loads or data is generated:
a bad value is an InvalidArgument naming the flag and what it may be (the CLI's one-line
error), not a traceback minutes later or a Python slice taken from a negative count."""

from __future__ import annotations

import math
import os

from specserve.errors import InvalidArgument
from specserve.model.loader import LOAD_FORMATS
from specserve.train.data import DTYPES
from specserve.train.generate import parse_engine_args, parse_workers

AUTOCAST = ("bfloat16", "float16", "float32")
SEED_MAX = 2**63 - 1  # torch generators take a signed 64-bit seed
BUNDLED_PROMPTS = ("train", "heldout")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(args, name: str, low: int | float, why: str = "") -> None:
    value = getattr(args, name)
    # (NaN compares false with everything: it would pass a plain `value < low`)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(_flag(name), f"must be a finite number >= {low}{why}, got {value}")
    if value < low:
        raise InvalidArgument(_flag(name), f"must be >= {low}{why}, got {value}")


def _in_range(args, name: str, low: float, high: float) -> None:
    value = getattr(args, name)
    if not low <= value <= high:
        raise InvalidArgument(_flag(name), f"must be in [{low}, {high}], got {value}")


def _device(args) -> None:
    import torch

    device = args.device
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise InvalidArgument("--device", f"must be cpu, cuda or cuda:N, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("--device", f"{device!r} requested but CUDA is not available")


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
    if not args.out:
        raise InvalidArgument("--out", "must be a path, got ''")
    _device(args)
    _one_of(args, "load_format", LOAD_FORMATS)
    if args.prompts not in BUNDLED_PROMPTS and not os.path.isfile(args.prompts):
        raise InvalidArgument(
            "--prompts",
            f"{args.prompts!r} is neither a bundled set ({', '.join(BUNDLED_PROMPTS)}) nor a "
            "JSONL file",
        )
    _at_least(args, "num_prompts", 1)
    _at_least(args, "max_new_tokens", 1)
    _at_least(args, "gen_batch_size", 1)
    _at_least(args, "gen_time_budget", 0, " (0: no limit)")
    try:
        parse_engine_args(args.engine_arg)
    except ValueError as e:
        raise InvalidArgument("--engine-arg", str(e)) from None
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
    if not 0 <= args.seed <= SEED_MAX:
        raise InvalidArgument("--seed", f"must be in [0, {SEED_MAX}], got {args.seed}")
    _at_least(args, "sampled_passes", 0)
    if args.sampled_passes or args.sampled_pass:
        if not all(0 < t < math.inf for t in args.temperature):
            raise InvalidArgument(
                "--temperature", f"must be finite numbers > 0, got {args.temperature}"
            )
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
    _at_least(args, "ce_vocab", 0, " (0: the full vocabulary)")
    _at_least(args, "save_every_seconds", 0, " (0: by steps)")
    if not 0 < args.lr < math.inf:
        raise InvalidArgument("--lr", f"must be a finite number > 0, got {args.lr}")
    if not 0 < args.grad_clip < math.inf:  # (the largest gradient norm: 0 stops every update)
        raise InvalidArgument("--grad-clip", f"must be a finite number > 0, got {args.grad_clip}")
    _in_range(args, "min_lr_ratio", 0, 1)
    _in_range(args, "warmup", 0, 1)
    for name in ("weight_decay", "ttt_decay", "feature_weight", "token_weight"):
        _at_least(args, name, 0)
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
        if args.head == "eagle3":
            raise InvalidArgument(
                "--init-layer", "applies to --head eagle (an EAGLE3 layer reads 2 x hidden)"
            )
        _at_least(args, "init_layer", 0)
    if args.data_dir and not os.path.isfile(os.path.join(args.data_dir, "manifest.json")):
        raise InvalidArgument(
            "--data-dir", f"{args.data_dir} is not a finished dataset (no manifest.json in it)"
        )
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


def _has_tokenizer(src) -> bool:
    """Whether the loader finds a tokenizer for `src` (as model/loader.py looks for one)."""
    from specserve.model.gguf_loader import gguf_has_tokenizer
    from specserve.model.registry import resolve_packaged
    from specserve.model.tokenizer import has_tokenizer_files

    if src.kind == "gguf":
        return gguf_has_tokenizer(src.path)
    if src.kind == "hf":
        return has_tokenizer_files(src.path)
    try:  # (a preset named as a packaged model uses its tokenizer)
        return resolve_packaged(src.path) is not None
    except FileNotFoundError:  # (its package is not installed)
        return False


def check_target(args, generates: bool) -> None:
    """The target's config and, when answers are generated, its tokenizer (the prompts are
    chats): read, not loaded, before anything is generated."""
    from specserve.model.loader import locate, read_model_config

    config = read_model_config(args.target, args.load_format, field="--target")
    if getattr(args, "init_layer", None) is not None and args.init_layer >= config.num_layers:
        raise InvalidArgument(
            "--init-layer",
            f"must be < {config.num_layers} (the target's layers), got {args.init_layer}",
        )
    if generates and not _has_tokenizer(locate(args.target, args.load_format, "--target")):
        hint = " (or give a finished --data-dir)" if hasattr(args, "data_dir") else ""
        raise InvalidArgument(
            "--target",
            f"{args.target!r} has no tokenizer: generating answers to the chat prompts needs "
            f"one{hint}",
        )
