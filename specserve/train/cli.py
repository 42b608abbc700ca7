"""`specserve train-eagle`: self-distillation data, then an EAGLE head, in one command.

    specserve train-eagle --target smollm2-135m --out ./my-draft

Work files (answers, feature shards, the resumable `checkpoint.pt`) go to `--work-dir`
(default `<out>.work`); a rerun reuses finished data and, with `--resume`, continues training
from the last checkpoint. The draft lands in `--out` in the published EAGLE layout
(config.json, model.safetensors in float16, training_args.json).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict

from specserve.model.registry import DEFAULT_MODEL
from specserve.train.progress_log import log

# Off by default: on SmolLM2-135M a map from the training answers cost more acceptance than it
# saved time (held-out answers use tokens the training answers never did; docs/TRAINING.md).
TOKEN_MAP_SIZE = 0
_DATA_FILES = ("manifest.json", "answers.json")  # a dataset, or its finished answers


def add_train_parser(sub, add_engine_args=None, engine_kwargs=None) -> None:
    """Register `train-eagle` (the engine-argument helpers of specserve.cli are accepted for a
    uniform call and unused: the engine generator takes its few knobs from this parser)."""
    from specserve.train.data import DataArgs
    from specserve.train.train_args import TrainArgs

    d, t = DataArgs(), TrainArgs()
    p = sub.add_parser("train-eagle", help="train an EAGLE draft head by self-distillation")
    p.add_argument(
        "--target", default=DEFAULT_MODEL, help=f"target model (default {DEFAULT_MODEL})"
    )
    p.add_argument("--out", required=True, help="folder for the trained draft")
    p.add_argument("--work-dir", default=None, help="data and checkpoints (default <out>.work)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-format", default="auto")

    g = p.add_argument_group("data")
    g.add_argument("--prompts", default=d.prompts, help="'train' (bundled) or a JSONL file")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument(
        "--generator",
        default=d.generator,
        help="'dense', 'engine', or workers of both, e.g. 'engine:4,dense:1' (several run as "
        "processes sharing the device)",
    )
    g.add_argument(
        "--gen-batch-size",
        type=int,
        default=d.batch_size,
        help="dense: rows generated together; engine: max_running_requests",
    )
    g.add_argument("--gen-dtype", default=d.gen_dtype, help="dense generator dtype")
    g.add_argument("--feature-dtype", default=d.feature_dtype)
    g.add_argument(
        "--sampled-pass", action="store_true", help="one sampled pass after the greedy one"
    )
    g.add_argument(
        "--sampled-passes", type=int, default=d.sampled_passes, help="sampled passes (default 0)"
    )
    g.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[d.temperature],
        help="temperatures of the sampled passes, cycled (default 0.8)",
    )
    g.add_argument(
        "--gen-time-budget",
        type=float,
        default=d.time_budget,
        metavar="SECONDS",
        help="seconds generation may take; answers cut then are kept, and a later run with "
        "the same --out reuses them (default: no limit)",
    )
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine argument for engine workers (repeatable; VALUE parsed as JSON when it can be)",
    )
    g.add_argument("--eagle3-features", action="store_true", help="also record EAGLE3 features")
    g.add_argument("--data-dir", default=None, help="use this finished dataset folder")
    g.add_argument(
        "--token-map-size",
        type=int,
        default=TOKEN_MAP_SIZE,
        help="also write <out>/token_map.json: the N most frequent answer tokens, for "
        f"--speculative-token-map (0: none; default {TOKEN_MAP_SIZE})",
    )

    g = p.add_argument_group("training")
    g.add_argument(
        "--head",
        choices=["eagle", "eagle3"],
        default=t.head,
        help="eagle: EAGLE-1 (final hidden state, target's lm_head); eagle3: three target "
        "layers, own lm_head over a reduced vocabulary (implies --eagle3-features)",
    )
    g.add_argument(
        "--draft-vocab",
        type=int,
        default=None,  # (given with --head eagle it would do nothing: refused)
        help=f"eagle3: draft vocabulary size, most frequent tokens (0: all; default {t.draft_vocab})",
    )
    g.add_argument(
        "--draft-layers",
        type=int,
        default=t.draft_layers,
        help="eagle: decoder layers in the head (default 1; eagle3 heads have one)",
    )
    g.add_argument("--epochs", type=float, default=t.epochs, help="0: no limit (use a time budget)")
    g.add_argument(
        "--time-budget",
        type=float,
        default=t.time_budget,
        metavar="SECONDS",
        help="seconds this run may train, then it stops with a resumable checkpoint (a later "
        "--resume run with the same --out continues); with --epochs 0 the learning-rate "
        "schedule follows this clock and ends annealed (default: no limit)",
    )
    g.add_argument("--lr", type=float, default=t.lr)
    g.add_argument("--min-lr-ratio", type=float, default=t.min_lr_ratio)
    g.add_argument("--weight-decay", type=float, default=t.weight_decay)
    g.add_argument("--batch-size", type=int, default=t.batch_size, help="sequences per step")
    g.add_argument(
        "--batch-tokens",
        type=int,
        default=t.batch_tokens,
        help="padded tokens per step (overrides --batch-size)",
    )
    g.add_argument("--ttt-steps", type=int, default=t.ttt_steps, help="extra unrolled steps")
    g.add_argument("--ttt-decay", type=float, default=t.ttt_decay)
    g.add_argument("--feature-weight", type=float, default=t.feature_weight)
    g.add_argument("--token-weight", type=float, default=t.token_weight)
    g.add_argument("--warmup", type=float, default=t.warmup)
    g.add_argument("--grad-clip", type=float, default=t.grad_clip)
    g.add_argument("--max-len", type=int, default=t.max_len)
    g.add_argument("--val-fraction", type=float, default=t.val_fraction)
    g.add_argument(
        "--ce-vocab",
        type=int,
        default=t.ce_vocab,
        help="cross-entropy over this many most frequent candidates (0: the full vocabulary)",
    )
    g.add_argument("--ce-chunk", type=int, default=t.ce_chunk, help="rows per lm_head chunk")
    g.add_argument(
        "--init-layer", type=int, default=t.init_layer, help="start from this target layer"
    )
    g.add_argument("--autocast", default=t.autocast, help="bfloat16 (default) or float32")
    g.add_argument("--save-every", type=int, default=t.save_every, help="steps (0: by time)")
    g.add_argument(
        "--save-every-seconds", type=float, default=t.save_every_seconds, help="(0: by steps)"
    )
    g.add_argument("--log-every", type=int, default=t.log_every, help="steps between log lines")
    g.add_argument(
        "--curve-file", default=None, help="training curves JSON (default <out>/train_curve.json)"
    )
    g.add_argument("--resume", action="store_true", help="continue from <work-dir>/checkpoint.pt")
    p.set_defaults(func=run_train)


def _write_token_map(data_dir: str, out: str, size: int, vocab_size: int) -> None:
    from specserve.train.token_map_cli import write_token_maps

    path = os.path.join(data_dir, "answers.json")
    if not os.path.isfile(path):
        log(f"token map: {path} is missing (a dataset from elsewhere?): not written")
        return
    with open(path) as f:
        saved = json.load(f)
    source = {"answers": len(saved["answers"]), "data": data_dir}
    write_token_maps(
        os.path.join(out, "token_map.json"),
        [size],
        saved["answers"],
        saved.get("prompt_ids", []),
        vocab_size,
        source,
    )


def _hold_work_dir(work: str):
    """The work folder's lock, held for the run: a second run on the same folder would delete
    this one's answer files and overwrite its data and checkpoints."""
    import fcntl

    from specserve.errors import InvalidArgument

    os.makedirs(work, exist_ok=True)
    lock = open(os.path.join(work, "lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise InvalidArgument(
            "--work-dir", f"{work} is in use by another run: give another --work-dir or --out"
        ) from None
    return lock


def run_train(args) -> int:
    from specserve.train.arg_checks import check_target, check_train_args

    check_train_args(args)  # (before generating data: the head is built only when training starts)
    if args.engine_arg:  # the engine workers' arguments, as their engines would check them
        from specserve.train.generate import check_engine_args, parse_engine_args

        check_engine_args(
            parse_engine_args(args.engine_arg),
            model_path=args.target,
            load_format=args.load_format,
            device=args.device,
            skip_tokenizer_init=True,
            no_default_draft=True,
        )
    from specserve.train.checkpoint import write_training_args
    from specserve.train.data import DataArgs, build_dataset, load_target, refuse_other_data
    from specserve.train.generate import parse_engine_args
    from specserve.train.train_args import TrainArgs
    from specserve.train.trainer import train

    t0 = time.perf_counter()
    work = args.work_dir or args.out.rstrip("/") + ".work"
    data_dir = args.data_dir or os.path.join(work, "data")
    data_args = DataArgs(
        target=args.target,
        out_dir=data_dir,
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        generator=args.generator,
        gen_dtype=args.gen_dtype,
        feature_dtype=args.feature_dtype,
        batch_size=args.gen_batch_size,
        sampled_pass=args.sampled_pass,
        sampled_passes=args.sampled_passes,
        temperature=args.temperature[0],
        temperatures=tuple(args.temperature),
        time_budget=args.gen_time_budget,
        eagle3=args.eagle3_features or args.head == "eagle3",
        seed=args.seed,
        device=args.device,
        load_format=args.load_format,
        engine_kwargs=parse_engine_args(args.engine_arg),
    )
    if not args.data_dir:  # (a folder given is used as it is)
        refuse_other_data(data_args)
    answered = any(os.path.isfile(os.path.join(data_dir, n)) for n in _DATA_FILES)
    check_target(args, generates=not answered, data_dir=args.data_dir)
    lock = _hold_work_dir(work)  # noqa: F841 (held until the run returns)
    log(f"train-eagle: target {args.target}, work folder {work}, draft to {args.out}")
    manifest = build_dataset(data_args)
    log(
        f"data: {manifest['num_sequences']} sequences, {manifest['num_answer_tokens']} answer "
        f"tokens (generate {manifest['generate_seconds']}s, features {manifest['feature_seconds']}s)"
    )
    train_args = TrainArgs(
        epochs=args.epochs,
        time_budget=args.time_budget,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        batch_size=args.batch_size,
        batch_tokens=args.batch_tokens,
        ttt_steps=args.ttt_steps,
        ttt_decay=args.ttt_decay,
        feature_weight=args.feature_weight,
        token_weight=args.token_weight,
        warmup=args.warmup,
        grad_clip=args.grad_clip,
        max_len=args.max_len,
        val_fraction=args.val_fraction,
        head=args.head,
        draft_layers=args.draft_layers,
        draft_vocab=TrainArgs.draft_vocab if args.draft_vocab is None else args.draft_vocab,
        ce_vocab=args.ce_vocab,
        ce_chunk=args.ce_chunk,
        init_layer=args.init_layer,
        autocast=args.autocast,
        seed=args.seed,
        device=args.device,
        save_every=args.save_every,
        save_every_seconds=args.save_every_seconds,
        log_every=args.log_every,
        curve_file=args.curve_file,
    )
    target = load_target(args.target, "float32", args.device, args.load_format)
    if args.token_map_size > 0:
        _write_token_map(data_dir, args.out, args.token_map_size, target.config.vocab_size)
    summary = train(
        target.model,
        data_dir,
        args.out,
        train_args,
        resume=args.resume,
        work_dir=work,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    summary = {
        "target": args.target,
        "command": "specserve " + " ".join(sys.argv[1:]) if sys.argv else None,
        "data": {k: v for k, v in manifest.items() if k not in ("shards",)},
        "data_args": asdict(data_args),
        "train": summary,
        "wall_seconds_this_run": round(time.perf_counter() - t0, 1),
    }
    write_training_args(args.out, summary)
    log(f"final held-back metrics {json.dumps(summary['train']['final'])}")
    log(f"draft written to {args.out}")
    return 0
