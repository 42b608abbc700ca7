"""The train-eagle and token-map flags, checked before any model loads or data is generated:
a bad value is an InvalidArgument naming the flag and what it may be (the CLI's one-line
error), not a traceback minutes later or a Python slice taken from a negative count."""

from __future__ import annotations

import json
import math
import os
import tempfile

from specserve.config.engine_config import SEED_MAX
from specserve.errors import InvalidArgument
from specserve.model.loader import LOAD_FORMATS
from specserve.train.data import DTYPES
from specserve.train.generate import parse_engine_args, parse_workers
from specserve.train.prompts import BUNDLED_PROMPTS, load_prompts

AUTOCAST = ("bfloat16", "float16", "float32")


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
        raise InvalidArgument(_flag(name), f"must be one of {', '.join(allowed)}, got {value!r}")


def _folder_flag(flag: str, path: str | None) -> None:
    """A folder the run will create or write into: not a file, and creatable where it does not
    exist yet (checked by making and removing a folder beside it), so that a path no one can
    write is refused now, not after hours of data generation."""
    if not path:
        return
    if os.path.isfile(path):
        raise InvalidArgument(flag, f"{path} is a file; a folder is needed")
    if os.path.islink(path) and not os.path.exists(path):
        raise InvalidArgument(flag, f"{path} is a link to nothing; give a folder")
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise InvalidArgument(flag, f"{path} cannot be created: {existing} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".specserve-write-check-", dir=existing))
    except OSError as e:
        raise InvalidArgument(
            flag, f"{path} cannot be written: {e.strerror} in {existing}"
        ) from None


def _draft_out(args) -> None:
    """--out receives config.json and model.safetensors: never the target's own folder or
    another model's (they would be overwritten), only a new, empty or draft folder."""
    out = os.path.realpath(args.out)
    if os.path.isdir(args.target) and out == os.path.realpath(args.target):
        raise InvalidArgument("--out", f"{args.out} is the target's folder; give a new folder")
    config = os.path.join(out, "config.json")
    if not os.path.isfile(config):
        return
    from specserve.train.checkpoint import ARCHITECTURE, ARCHITECTURE_EAGLE3

    try:
        with open(config, encoding="utf-8") as f:
            architectures = json.load(f).get("architectures")
    except (OSError, ValueError, AttributeError):
        architectures = None
    if architectures not in ([ARCHITECTURE], [ARCHITECTURE_EAGLE3]):
        raise InvalidArgument(
            "--out",
            f"{args.out} holds a model that is not a draft this command wrote (config.json "
            f"architectures {architectures!r}); give a new folder or an earlier draft's",
        )


def _prompt_file(args) -> None:
    """A JSONL prompt file is read now: a malformed line fails the run before anything loads."""
    if args.prompts in BUNDLED_PROMPTS:
        return
    if not os.path.isfile(args.prompts):
        raise InvalidArgument(
            "--prompts",
            f"{args.prompts!r} is neither a bundled set ({', '.join(BUNDLED_PROMPTS)}) nor a "
            "JSONL file",
        )
    try:
        load_prompts(args.prompts)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidArgument("--prompts", str(e)) from None


def _generation(args) -> None:
    """The flags of the data generation train-eagle and token-map share."""
    if not args.out:
        raise InvalidArgument("--out", "must be a path, got ''")
    _device(args)
    _one_of(args, "load_format", LOAD_FORMATS)
    _prompt_file(args)
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
    tp_size = parse_engine_args(args.engine_arg).get("tp_size", 1)
    if tp_size != 1 and len(workers) > 1:
        # (the workers are daemon processes, which cannot start a tensor-parallel engine's
        # ranks; one engine spans the devices)
        raise InvalidArgument(
            "--generator",
            f"with --engine-arg tp_size={tp_size} takes one engine worker and no other, got "
            f"{args.generator!r}",
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
    if args.token_weight == 0 and (args.feature_weight == 0 or args.head == "eagle3"):
        raise InvalidArgument(
            "--token-weight",
            "must be > 0: an EAGLE3 head has no other loss"
            if args.head == "eagle3"
            else "must be > 0, or --feature-weight > 0: with no loss nothing is trained",
        )
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
    work_dir = args.work_dir or args.out.rstrip("/") + ".work"  # (train-eagle's default)
    for flag, path in (("--out", args.out), ("--work-dir", work_dir)):
        _folder_flag(flag, path)
    _draft_out(args)
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


def check_target(args, generates: bool, data_dir: str | None = None) -> None:
    """The target's config and, when answers are generated, its tokenizer (the prompts are
    chats): read, not loaded, before anything is generated. A finished `data_dir` given must
    have been made by a model of the target's shape."""
    from specserve.model.loader import locate, read_model_config

    config = read_model_config(args.target, args.load_format, field="--target")
    if generates and args.max_new_tokens >= config.max_position_embeddings:
        raise InvalidArgument(
            "--max-new-tokens",
            f"must be < {config.max_position_embeddings} (the target's context, which also "
            f"holds the prompt), got {args.max_new_tokens}",
        )
    if data_dir:
        manifest_path = os.path.join(data_dir, "manifest.json")
        try:
            with open(manifest_path, encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise InvalidArgument("--data-dir", f"{manifest_path} cannot be read: {e}") from None
        if not isinstance(manifest, dict):
            raise InvalidArgument(
                "--data-dir", f"{manifest_path} is not a dataset manifest (a JSON object)"
            )
        for key, value in (
            ("hidden_size", config.hidden_size),
            ("vocab_size", config.vocab_size),
        ):
            if manifest.get(key, value) != value:
                raise InvalidArgument(
                    "--data-dir",
                    f"{data_dir} was made by a target with {key} {manifest[key]}; --target "
                    f"{args.target} has {value}",
                )
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
