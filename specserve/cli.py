"""`specserve generate | serve | bench ...`: every Engine argument is a flag."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any

from specserve.config import ATTENTION_BACKENDS, DTYPES, EngineConfig
from specserve.errors import InvalidArgument

ENGINE_HELP = {
    "model_path": "Model: a packaged name (smollm2-135m, the default), a .gguf file, an HF folder, "
    "or a preset with --load-format dummy (llama3-8b, smollm2-135m, tiny).",
    "tokenizer_path": "Tokenizer folder or .gguf file, if not the model's own.",
    "load_format": "auto | gguf | safetensors | dummy (random weights of the model's shape).",
    "dtype": f"Weight and KV dtype: {' | '.join(DTYPES)} (auto: bfloat16 on GPU, float32 on CPU; half and float: SGLang's names).",
    "device": "auto | cpu | cuda | cuda:N.",
    "page_size": "KV slots per page (any integer >= 1).",
    "tp_size": "Tensor parallelism: shard the model over this many processes (one per GPU on "
    "CUDA, gloo on CPU); attention heads and MLP split Megatron-style, the draft replicated.",
    "max_total_tokens": "KV cache size in tokens (default: from free memory on GPU, 16384 on CPU).",
    "max_running_requests": "Most requests decoding at once.",
    "chunked_prefill_size": "Most prompt tokens per prefill batch (-1: no chunking).",
    "context_length": "Longest prompt + output (default: the model's).",
    "skip_tokenizer_init": "Do not load a tokenizer; requests carry token ids.",
    "attention_backend": f"{' | '.join(ATTENTION_BACKENDS)}.",
    "random_seed": "Seed for random weights and for requests without their own seed.",
    "mem_fraction_static": "CUDA: share of GPU memory for weights and KV cache (the KV cache also leaves room for the largest decode step's logits).",
    "debug_check_invariants": "Check KV ownership after every step (slow; for tests).",
    "disable_overlap_schedule": "Apply each decode step before launching the next (overlap is on by default).",
    "enable_deterministic_inference": "CUDA: batch-invariant kernels, so an answer is the same bits alone, in any batch and with or without speculation (off by default: it decodes at 0.68-0.98x the default speed on an H200).",
    "disable_cuda_graph": "Run decode steps eagerly instead of replaying captured CUDA graphs (CUDA only).",
    "cuda_graph_max_bs": "Largest batch replayed from a CUDA graph; larger batches run eagerly (default: max_running_requests, at most 256).",
    "speculative_adaptive": "Load-adaptive speculation: each decode step drafts plain, a chain of 1 to 3 steps or the configured tree, whichever emits the most tokens per second at this batch size given the acceptance observed (step times measured on this device).",
    "speculative_adaptive_lag_tokens": "Adaptive speculation: plain steps skip the draft for up to this many tokens per request, caught up in one pass when speculation resumes (0: the draft runs every step; default 32).",
    "disable_radix_cache": "Turn the prefix cache off (on by default: requests reuse the KV of their longest cached prefix).",
    "disable_fused_kernels": "Run the plain torch reference of every fused kernel (debugging numerics).",
    "no_default_draft": "Do not run a packaged model (smollm2-135m) with its bundled draft, which it uses unless another draft is given.",
    "cuda_graph_max_prefill_tokens": "A prefill of one request's chunk up to this many tokens replays a captured forward; 0: always eager (default 512 on CUDA).",
    "speculative_algorithm": "EAGLE | EAGLE3 | STANDALONE (off when not given).",
    "speculative_draft_model_path": "Draft checkpoint folder (EAGLE/EAGLE3) or draft model (STANDALONE).",
    "speculative_num_steps": "Draft depth: forward passes of the draft per step.",
    "speculative_eagle_topk": "Children kept per expanded draft node (1 = chain).",
    "speculative_num_draft_tokens": "Tree size verified per step, root included (<= 1 + topk + (steps - 1) * topk^2; topk 1: steps + 1).",
    "speculative_token_map": "EAGLE: draft only among these token ids (JSON list or .pt; the most frequent tokens of the target's answers): a smaller draft lm_head and top-k, output unchanged.",
    "speculative_token_map_growth": "With --speculative-token-map: room for this many more tokens; prompt and output tokens of running requests that the map lacks join the draft vocabulary while a request holding them runs, first come first served (default 0).",
    "simulate_acc_len": "Benchmarking: force this mean accept length (bonus token included; 1 = all rejected).",
    "simulate_acc_method": "multinomial | match-expected | per-position (default multinomial).",
    "simulate_acc_token_mode": "real-draft-token (default; tokens and KV consistent) | fixed.",
    "simulate_acc_fixed_token": "Token id emitted in fixed mode (default: one that decodes to a plain word).",
    "simulate_acc_rates": "per-position: acceptance rate per draft depth, comma-separated (e.g. 0.8,0.6,0.4).",
    "log_level": "debug | info | warning | error | critical.",
}


_NOT_FLAGS = ("decisions", "kernels")  # filled by resolve(); `kernels` is a Python object


# SGLang's other spellings of a field's flag
FLAG_ALIASES = {"tp_size": ("--tensor-parallel-size",)}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name in _NOT_FLAGS:
            continue
        flags = ("--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ()))
        default = f.default
        help_text = ENGINE_HELP.get(f.name, "") + (
            # (`0 in (None, False)` is true: a default of 0 is shown too)
            f" (default: {default})" if default is not None and default is not False else ""
        )
        if isinstance(default, bool):
            g.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
        else:
            # the field's own annotation ("int | None", "float", ...) types the flag
            base = str(f.type).replace(" | None", "").strip()
            kind = {"int": int, "float": float}.get(base)
            g.add_argument(*flags, dest=f.name, type=kind or str, default=None, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for f in fields(EngineConfig):
        if f.name in _NOT_FLAGS:
            continue
        v = getattr(args, f.name, None)
        if v is not None and v is not False:
            out[f.name] = v
    return out


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-new-tokens", type=int, default=0, help="no stop before this many")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="(0, 2]; 1: none")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2]")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2]")


def sampling_dict(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "stop": args.stop or [],
        "ignore_eos": args.ignore_eos,
        "min_new_tokens": args.min_new_tokens,
        "repetition_penalty": args.repetition_penalty,
        "frequency_penalty": args.frequency_penalty,
        "presence_penalty": args.presence_penalty,
    }


def check_sampling_flags(sp: dict[str, Any]) -> None:
    """Each sampling flag checked as the engine checks its field, before the model loads,
    a refusal naming the flag."""
    from specserve.sampling_params import check_field

    for name, value in sp.items():
        try:
            check_field(name, value)
        except InvalidArgument as e:
            flag = "--" + name.replace("_", "-")
            raise InvalidArgument(flag, str(e).removeprefix(f"{e.field}: ")) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.engine import Engine

    sp = sampling_dict(args)
    check_sampling_flags(sp)
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    with Engine(**engine_kwargs(args)) as engine:
        print(f"specserve: {engine.config.draft_summary()}", file=sys.stderr)
        if args.chat:
            ids = engine.tokenize_chat([{"role": "user", "content": args.prompt}])
            result = engine.generate(input_ids=ids, sampling_params=sp, stream=not args.json)
        else:
            result = engine.generate(prompt=args.prompt, sampling_params=sp, stream=not args.json)
        if args.json:
            print(json.dumps(result, indent=2))
            return 0
        final = None
        for chunk in result:
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
            final = chunk
        meta = final["meta_info"] if final else {}
        summary = (
            f"\n\n[{meta.get('completion_tokens')} tokens, {meta.get('e2e_latency', 0):.2f}s, "
            f"finish: {describe_finish(meta.get('finish_reason'))}"
        )
        if "spec_accept_length" in meta:
            summary += f", accept length {meta['spec_accept_length']:.2f}"
        print(summary + "]")
    return 0


def describe_finish(reason: dict | None) -> str:
    """'stop (token 2)', 'stop ("\\n\\n")', 'length (128)', 'abort: <message>'."""
    if not reason:
        return "none"
    kind = reason.get("type", "?")
    if "message" in reason:
        return f"{kind}: {reason['message']}"
    if "matched" in reason:
        matched = reason["matched"]
        what = f"token {matched}" if isinstance(matched, int) else json.dumps(matched)
        return f"{kind} ({what})"
    if "length" in reason:
        return f"{kind} ({reason['length']})"
    return kind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", help="the prompt; '-' reads it from standard input")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    gen.add_argument(
        "--json", action="store_true", help="print the full output as JSON instead of streaming"
    )
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    from specserve.bench.cli import add_bench_parser
    from specserve.server.cli import add_serve_parser

    add_serve_parser(sub, add_engine_args, engine_kwargs)
    add_bench_parser(sub, add_engine_args, engine_kwargs)
    from specserve.train.cli import add_train_parser
    from specserve.train.token_map_cli import add_token_map_parser

    add_train_parser(sub, add_engine_args, engine_kwargs)
    add_token_map_parser(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except InvalidArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (the engine has shut down on the way out)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
