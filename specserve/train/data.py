"""Self-distillation data for a draft head: the target answers the prompts itself, then a
plain forward of prompt + answer records the features the draft learns from.

    build_dataset(DataArgs(target="smollm2-135m", out_dir="runs/x/data", num_prompts=3000))

1. Prompts (a bundled set, or a JSONL file) go through the target's chat template
   (`engine.tokenize_chat` / `apply_chat_template`; `prompt_ids=` skips this).
2. Answers (`generate.py`): one greedy pass, then `sampled_passes` temperature-sampled
   ones, optionally cut by a wall-clock `time_budget`; generated through `specserve.Engine`
   (`generator="engine"`, the serving path itself), through `features.generate_dense`
   (`generator="dense"`: the same model and arithmetic with a dense cache, several times
   faster on a CPU) or by several workers of both kinds at once (`"engine:4,dense:1"`).
3. Features: one causal forward of every prompt + answer (`features.forward_features`):
   the final normed hidden state per position (float16), the target's top-k next tokens with
   their probabilities, optionally the EAGLE3 capture layers' inputs.
4. Shards `shard_NNNNN.pt` (torch.save of flat tensors, see `save_shard`) and a
   `manifest.json`; a finished step is not redone when the folder is reused.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from specserve.errors import InvalidArgument
from specserve.train.progress_log import log

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DataArgs:
    target: str = "smollm2-135m"
    out_dir: str = "eagle-data"
    prompts: str = "train"  # 'train', 'heldout' or a JSONL path
    num_prompts: int = 12000  # at most this many prompts of the set (the first N)
    max_new_tokens: int = 192
    # generator workers: 'dense', 'engine', or a mix such as 'engine:4,dense:1' (one worker
    # runs in this process, several run as processes sharing the device)
    generator: str = "dense"
    gen_dtype: str = "bfloat16"  # dense generator's dtype (the engine uses `engine_kwargs`)
    feature_dtype: str = "bfloat16"
    batch_size: int = 128  # dense: rows generated together; engine: max_running_requests
    sampled_pass: bool = False  # --sampled-pass: at least one sampled pass (as sampled_passes 1)
    sampled_passes: int = 0  # temperature-sampled passes after the greedy one
    temperature: float = 0.8
    temperatures: tuple[float, ...] = ()  # cycled by the sampled passes (default: temperature)
    time_budget: float = 0.0  # seconds generation may take in this run (0: every pass to the end)
    topk: int = 4  # target next-token candidates kept per position (soft labels)
    eagle3: bool = False  # also record the EAGLE3 capture layers' inputs
    shard_size: int = 1000  # sequences per shard
    feature_max_tokens: int = 0  # padded tokens per feature forward (0: 8192 CPU, 32768 GPU)
    seed: int = 0
    device: str = "cpu"
    load_format: str = "auto"
    engine_kwargs: dict = field(default_factory=dict)
    log_every: float = 10.0  # seconds between progress lines of parallel generation


def load_target(path: str, dtype: str, device: str, load_format: str = "auto"):
    from specserve.model.loader import load_model

    return load_model(path, load_format, DTYPES[dtype], torch.device(device))


def eos_ids_of(loaded) -> set[int]:
    eos = set(loaded.config.eos_token_ids)
    tok = loaded.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        eos.add(tok.eos_token_id)
    return eos


def select_prompts(args: DataArgs) -> list[str]:
    from specserve.train.prompts import load_prompts

    prompts = load_prompts(args.prompts)
    rng = random.Random(args.seed)
    rng.shuffle(prompts)
    return prompts[: args.num_prompts]


def chat_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    from specserve.model.tokenizer import apply_chat_template

    return [apply_chat_template(tokenizer, [{"role": "user", "content": p}]) for p in prompts]


def save_shard(path: str, records: list[dict]) -> None:
    """Flat tensors: input_ids [N] int32, offsets [S+1] int64, prompt_lens / ended [S],
    hidden [N, H] float16, top_ids [N, k] int32, top_probs [N, k] float16, aux [N, 3H]."""
    lens = [len(r["ids"]) for r in records]
    out = {
        "input_ids": torch.tensor([t for r in records for t in r["ids"]], dtype=torch.int32),
        "offsets": torch.tensor([0] + lens, dtype=torch.int64).cumsum(0),
        "prompt_lens": torch.tensor([r["prompt_len"] for r in records], dtype=torch.int32),
        "ended": torch.tensor([r["ended"] for r in records], dtype=torch.bool),
        "hidden": torch.cat([r["hidden"] for r in records]).to(torch.float16),
        "top_ids": torch.cat([r["top_ids"] for r in records]).to(torch.int32),
        "top_probs": torch.cat([r["top_probs"] for r in records]).to(torch.float16),
    }
    if records and records[0].get("aux") is not None:
        out["aux"] = torch.cat([r["aux"] for r in records]).to(torch.float16)
    tmp = path + ".tmp"
    torch.save(out, tmp)
    os.replace(tmp, path)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


# What a dataset's answers depend on: a work folder reused by a run asking for other values
# would train on data that is not what the run says (another target's hidden states).
DEFINING = (
    "target",
    "load_format",
    "prompts",
    "num_prompts",
    "max_new_tokens",
    "sampled_pass",
    "sampled_passes",
    "temperatures",
    "seed",
)


def defining_args(args: DataArgs) -> dict:
    return json.loads(json.dumps({k: getattr(args, k) for k in DEFINING}))


def refuse_other_data(args: DataArgs) -> None:
    """InvalidArgument naming the first flag whose value differs from the one the data already
    in args.out_dir (finished answers or dataset) was made with."""
    for name in ("manifest.json", "answers.json"):
        path = os.path.join(args.out_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            saved = json.load(f).get("args")
        if saved is None:
            continue
        for key, value in defining_args(args).items():
            if key in saved and saved[key] != value:
                raise InvalidArgument(
                    "--" + key.replace("_", "-"),
                    f"the data in {args.out_dir} was made with {saved[key]!r}, this run asks "
                    f"for {value!r}: give the same value, or another --work-dir",
                )


def build_dataset(args: DataArgs, prompt_ids: list[list[int]] | None = None) -> dict:
    """Generate answers and features into args.out_dir; returns the manifest. `prompt_ids`
    (token ids, no chat template) replaces the prompt set, e.g. for tokenizer-less targets."""
    os.makedirs(args.out_dir, exist_ok=True)
    manifest_path = os.path.join(args.out_dir, "manifest.json")
    if os.path.isfile(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("complete") and (manifest.get("capture_layers") or not args.eagle3):
            return manifest
        if manifest.get("complete"):  # EAGLE3 features wanted: redo the features only
            log(f"features: {args.out_dir} has no EAGLE3 features; recomputing them")
    t0 = time.perf_counter()
    answers_path = os.path.join(args.out_dir, "answers.json")
    if os.path.isfile(answers_path):  # generation finished in an earlier run
        with open(answers_path) as f:
            saved = json.load(f)
        prompt_ids, answers = saved["prompt_ids"], saved["answers"]
        gen_seconds = saved["seconds"]
        log(f"generate: reusing {len(answers)} answers of {answers_path}")
    else:
        answers, prompt_ids, _ = generate_answer_set(args, prompt_ids)
        gen_seconds = time.perf_counter() - t0
        with open(answers_path + ".tmp", "w") as f:
            saved = {"prompt_ids": prompt_ids, "answers": answers, "seconds": gen_seconds}
            json.dump({**saved, "args": defining_args(args)}, f)
        os.replace(answers_path + ".tmp", answers_path)
    t1 = time.perf_counter()
    loaded = load_target(args.target, args.feature_dtype, args.device, args.load_format)
    eos = eos_ids_of(loaded)
    seqs = [p + a for p, a in zip(prompt_ids, answers)]
    capture: tuple[int, ...] = ()
    if args.eagle3:
        from specserve.speculative.eagle_checkpoint import eagle3_capture_layers

        capture = tuple(eagle3_capture_layers({}, loaded.config.num_layers))
    log(f"features: {len(seqs)} sequences, {sum(map(len, seqs))} tokens")
    shards = _write_features(args, loaded.model, seqs, prompt_ids, answers, eos, capture)
    manifest = {
        "complete": True,
        "args": asdict(args),
        "num_sequences": len(seqs),
        "num_tokens": sum(len(s) for s in seqs),
        "num_answer_tokens": sum(len(a) for a in answers),
        "num_ended": sum(bool(a) and a[-1] in eos for a in answers),
        "hidden_size": loaded.config.hidden_size,
        "vocab_size": loaded.config.vocab_size,
        "capture_layers": list(capture),
        "shards": shards,
        "generate_seconds": round(gen_seconds, 1),
        "feature_seconds": round(time.perf_counter() - t1, 1),
    }
    log(
        f"features done in {manifest['feature_seconds']}s: {len(shards)} shards, "
        f"{manifest['num_answer_tokens']} answer tokens"
    )
    _write_json(manifest_path, manifest)
    return manifest


def generate_answer_set(args: DataArgs, prompt_ids):
    """(answers, prompt ids of each answer, None). Jobs: one greedy pass over the prompts,
    then `sampled_passes` sampled ones, all cut by `time_budget` if set."""
    from specserve.train.generate import GenConfig, generate_answers, make_jobs, parse_workers

    workers = parse_workers(args.generator)
    loaded = load_target(args.target, args.gen_dtype, "cpu", args.load_format)  # tokenizer, eos
    if prompt_ids is None:
        if loaded.tokenizer is None:
            raise ValueError(f"{args.target}: no tokenizer; pass prompt_ids")
        prompt_ids = chat_ids(loaded.tokenizer, select_prompts(args))
    prompt_ids = fitting_prompts([list(p) for p in prompt_ids], loaded.config, args)
    eos = sorted(eos_ids_of(loaded))
    del loaded
    passes = 1 + max(args.sampled_passes, 1 if args.sampled_pass else 0)
    temps = tuple(args.temperatures) or (args.temperature,)
    jobs = make_jobs(len(prompt_ids), passes, temps, args.seed)
    cfg = GenConfig(
        target=args.target,
        load_format=args.load_format,
        device=args.device,
        dense_dtype=args.gen_dtype,
        engine_dtype=args.engine_kwargs.get("dtype"),
        max_new_tokens=args.max_new_tokens,
        eos=eos,
        max_running_requests=args.batch_size,
        dense_batch_size=args.batch_size,
        engine_kwargs={k: v for k, v in args.engine_kwargs.items() if k != "dtype"},
    )
    deadline = time.time() + args.time_budget if args.time_budget > 0 else None
    log(
        f"generate: {len(prompt_ids)} prompts x {passes} passes (temperatures 0, {temps}), "
        f"workers {workers}, budget {f'{args.time_budget}s' if args.time_budget else 'none'}"
    )
    results = generate_answers(
        cfg,
        prompt_ids,
        jobs,
        workers,
        os.path.join(args.out_dir, "gen"),
        deadline=deadline,
        log=log,
        poll_seconds=args.log_every,
    )
    results = [r for r in results if r["ids"]]
    answers = [r["ids"] for r in results]
    seq_prompts = [prompt_ids[jobs[r["job"]][0]] for r in results]
    return answers, seq_prompts, None


def fitting_prompts(prompt_ids: list[list[int]], config, args: DataArgs) -> list[list[int]]:
    """The prompts whose answer of max_new_tokens fits the target's context. The others are
    left out, and said so, whichever worker would answer them: the engine would cut their
    answers at the context, and the dense generator would run past the positions the model
    was trained for."""
    room = config.max_position_embeddings - args.max_new_tokens
    kept = [p for p in prompt_ids if len(p) <= room]
    if not kept:
        raise InvalidArgument(
            "--prompts",
            f"no prompt fits the target's context of {config.max_position_embeddings} tokens "
            f"with --max-new-tokens {args.max_new_tokens} (the shortest has "
            f"{min(map(len, prompt_ids), default=0)} tokens)",
        )
    if len(kept) < len(prompt_ids):
        log(
            f"generate: {len(prompt_ids) - len(kept)} of {len(prompt_ids)} prompts left out: "
            f"longer than {room} tokens, the context less --max-new-tokens"
        )
    return kept


def _write_features(args, model, seqs, prompt_ids, answers, eos, capture) -> list[str]:
    from specserve.train.features import forward_features

    shards: list[str] = []
    pending: dict[int, dict] = {}
    order: list[int] = []
    bar = tqdm(total=sum(len(s) for s in seqs), desc="features", unit="tok", unit_scale=True)
    next_shard = 0

    def flush(force: bool) -> None:
        nonlocal next_shard, order
        while len(order) >= args.shard_size or (force and order):
            take, order = order[: args.shard_size], order[args.shard_size :]
            name = f"shard_{next_shard:05d}.pt"
            save_shard(os.path.join(args.out_dir, name), [pending.pop(i) for i in take])
            shards.append(name)
            next_shard += 1

    max_tokens = args.feature_max_tokens or (
        32768 if next(model.parameters()).device.type == "cuda" else 8192
    )
    for i, f in forward_features(model, seqs, capture, args.topk, max_tokens, progress=bar):
        pending[i] = {
            "ids": seqs[i],
            "prompt_len": len(prompt_ids[i]),
            "ended": bool(answers[i]) and answers[i][-1] in eos,
            "hidden": f.hidden.to(torch.float16).cpu(),
            "top_ids": f.top_ids.cpu(),
            "top_probs": f.top_probs.to(torch.float16).cpu(),
            "aux": None if f.aux is None else f.aux.to(torch.float16).cpu(),
        }
        order.append(i)
        flush(False)
    flush(True)
    bar.close()
    return shards


def load_shards(data_dir: str, device="cpu", drop: tuple[str, ...] = ()) -> list[dict]:
    """All shards of a dataset folder (in manifest order); tensors on `device`, except the
    small per-sequence ones (offsets, prompt_lens, ended), which stay on the host, and the
    keys in `drop`, which are not kept (e.g. the features a head does not read)."""
    with open(os.path.join(data_dir, "manifest.json")) as f:
        manifest = json.load(f)
    host = ("offsets", "prompt_lens", "ended")
    out = []
    for s in manifest["shards"]:
        sh = torch.load(os.path.join(data_dir, s), weights_only=True, map_location="cpu")
        out.append({k: v if k in host else v.to(device) for k, v in sh.items() if k not in drop})
    return out
