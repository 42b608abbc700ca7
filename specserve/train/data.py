"""Self-distillation data for a draft head: the target answers the prompts itself, then a
plain forward of prompt + answer records the features the draft learns from.

    build_dataset(DataArgs(target="smollm2-135m", out_dir="runs/x/data", num_prompts=3000))

1. Prompts (a bundled set, or a JSONL file) go through the target's chat template
   (`engine.tokenize_chat` / `apply_chat_template`; `prompt_ids=` skips this).
2. Answers: greedy (and optionally one sampled pass) either through `specserve.Engine`
   (`generator="engine"`, the serving path itself) or through `features.generate_dense`
   (`generator="dense"`: the same model and arithmetic with a dense cache, several times
   faster on a CPU).
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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DataArgs:
    target: str = "smollm2-135m"
    out_dir: str = "eagle-data"
    prompts: str = "train"  # 'train', 'heldout' or a JSONL path
    num_prompts: int = 2000
    max_new_tokens: int = 192
    generator: str = "dense"  # 'dense' | 'engine'
    gen_dtype: str = "bfloat16"  # dense generator's dtype (the engine uses `engine_kwargs`)
    feature_dtype: str = "bfloat16"
    batch_size: int = 64  # sequences generated together
    sampled_pass: bool = False  # also one temperature-sampled answer per prompt
    temperature: float = 0.8
    topk: int = 4  # target next-token candidates kept per position (soft labels)
    eagle3: bool = False  # also record the EAGLE3 capture layers' inputs
    shard_size: int = 1000  # sequences per shard
    feature_max_tokens: int = 8192  # padded tokens per feature forward
    seed: int = 0
    device: str = "cpu"
    load_format: str = "auto"
    engine_kwargs: dict = field(default_factory=dict)


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


def generate_with_engine(
    engine, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, seed: int
) -> list[list[int]]:
    """Answers through `Engine.generate`, submitted in chunks (for the progress bar)."""
    outs: list[list[int]] = []
    chunk = max(1, engine.config.max_running_requests or 64) * 2
    bar = tqdm(total=len(prompt_ids), desc="generate (engine)", unit="answer")
    for i in range(0, len(prompt_ids), chunk):
        part = prompt_ids[i : i + chunk]
        params = [
            {"temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed + i + j}
            for j in range(len(part))
        ]
        for o in engine.generate(input_ids=part, sampling_params=params):
            outs.append(list(o["output_ids"]))
        bar.update(len(part))
    bar.close()
    return outs


def generate_with_dense(
    model,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    eos: set[int],
    temperature: float,
    seed: int,
    batch_size: int,
) -> list[list[int]]:
    from specserve.train.features import generate_dense

    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    outs: list[list[int]] = [[] for _ in prompt_ids]
    bar = tqdm(total=len(prompt_ids), desc="generate (dense)", unit="answer")
    for b, i in enumerate(range(0, len(order), batch_size)):
        idx = order[i : i + batch_size]
        got = generate_dense(
            model, [prompt_ids[j] for j in idx], max_new_tokens, eos, temperature, seed + b
        )
        for j, o in zip(idx, got):
            outs[j] = o
        bar.update(len(idx))
        bar.set_postfix(tokens=sum(len(o) for o in outs))
    bar.close()
    return outs


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


def build_dataset(args: DataArgs, prompt_ids: list[list[int]] | None = None) -> dict:
    """Generate answers and features into args.out_dir; returns the manifest. `prompt_ids`
    (token ids, no chat template) replaces the prompt set, e.g. for tokenizer-less targets."""
    os.makedirs(args.out_dir, exist_ok=True)
    manifest_path = os.path.join(args.out_dir, "manifest.json")
    if os.path.isfile(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("complete"):
            return manifest
    t0 = time.perf_counter()
    answers_path = os.path.join(args.out_dir, "answers.json")
    loaded = None
    if os.path.isfile(answers_path):  # generation finished in an earlier run
        with open(answers_path) as f:
            saved = json.load(f)
        prompt_ids, answers = saved["prompt_ids"], saved["answers"]
        gen_seconds = saved["seconds"]
    else:
        answers, prompt_ids, loaded = _generate(args, prompt_ids)
        gen_seconds = time.perf_counter() - t0
        _write_json(
            answers_path, {"prompt_ids": prompt_ids, "answers": answers, "seconds": gen_seconds}
        )
    t1 = time.perf_counter()
    if loaded is None or args.feature_dtype != args.gen_dtype or args.generator != "dense":
        loaded = load_target(args.target, args.feature_dtype, args.device, args.load_format)
    eos = eos_ids_of(loaded)
    seqs = [p + a for p, a in zip(prompt_ids, answers)]
    capture: tuple[int, ...] = ()
    if args.eagle3:
        n_layers = loaded.config.num_layers
        capture = (2, n_layers // 2, n_layers - 3)
    shards = _write_features(args, loaded.model, seqs, prompt_ids, answers, eos, capture)
    manifest = {
        "complete": True,
        "args": asdict(args),
        "num_sequences": len(seqs),
        "num_tokens": sum(len(s) for s in seqs),
        "num_answer_tokens": sum(len(a) for a in answers),
        "hidden_size": loaded.config.hidden_size,
        "capture_layers": list(capture),
        "shards": shards,
        "generate_seconds": round(gen_seconds, 1),
        "feature_seconds": round(time.perf_counter() - t1, 1),
    }
    _write_json(manifest_path, manifest)
    return manifest


def _generate(args: DataArgs, prompt_ids):
    """(answers, prompt ids, the loaded dense target or None). A sampled pass repeats every
    prompt once more."""
    loaded = None
    if args.generator == "engine":
        from specserve.engine import Engine

        kw = dict(model_path=args.target, device=args.device, load_format=args.load_format)
        kw.update(args.engine_kwargs)
        kw.setdefault("max_running_requests", args.batch_size)
        with Engine(**kw) as engine:
            if prompt_ids is None:
                prompts = select_prompts(args)
                prompt_ids = [
                    engine.tokenize_chat([{"role": "user", "content": p}]) for p in prompts
                ]
            answers = generate_with_engine(engine, prompt_ids, args.max_new_tokens, 0.0, args.seed)
            if args.sampled_pass:
                answers += generate_with_engine(
                    engine, prompt_ids, args.max_new_tokens, args.temperature, args.seed
                )
    elif args.generator == "dense":
        loaded = load_target(args.target, args.gen_dtype, args.device, args.load_format)
        if prompt_ids is None:
            prompt_ids = chat_ids(loaded.tokenizer, select_prompts(args))
        eos = eos_ids_of(loaded)
        gen = (loaded.model, prompt_ids, args.max_new_tokens, eos)
        answers = generate_with_dense(*gen, 0.0, args.seed, args.batch_size)
        if args.sampled_pass:
            answers += generate_with_dense(*gen, args.temperature, args.seed, args.batch_size)
    else:
        raise ValueError(f"generator must be 'dense' or 'engine', got {args.generator!r}")
    if args.sampled_pass:
        prompt_ids = prompt_ids + prompt_ids
    return answers, [list(p) for p in prompt_ids], loaded


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

    for i, f in forward_features(
        model, seqs, capture, args.topk, args.feature_max_tokens, progress=bar
    ):
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


def load_shards(data_dir: str) -> list[dict]:
    """All shards of a dataset folder (in manifest order)."""
    with open(os.path.join(data_dir, "manifest.json")) as f:
        manifest = json.load(f)
    return [
        torch.load(os.path.join(data_dir, s), weights_only=True, map_location="cpu")
        for s in manifest["shards"]
    ]
