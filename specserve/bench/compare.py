"""`specserve bench compare`: this engine against HF transformers, in one run on one device.

Cases (each a fresh engine, same prompts): no speculation; speculative decoding with
simulated acceptance at each requested accept length (EAGLE3 head: a given checkpoint, or
a random one of the target's shape with a reduced vocabulary); overlap on and off; and HF
transformers `generate` with its static cache on a model of the same shape (the same
weights when the target is a real checkpoint folder). Prints JSON and a table; `--plot`
draws decode throughput against accept length as a PNG.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from specserve.bench.args import HelpWithDefaults, positive_int
from specserve.bench.one_batch import dump, free_device_memory, run_one_batch


def add_compare_parser(bsub) -> argparse.ArgumentParser:
    p = bsub.add_parser(
        "compare",
        help="this engine (plain, speculative, overlap on/off) vs HF",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpWithDefaults,
    )
    p.add_argument(
        "--model-path", default="llama3-8b", help="target model: preset, packaged or path"
    )
    p.add_argument("--load-format", default="dummy", help="dummy: random weights; auto: real ones")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    p.add_argument("--batch-size", type=positive_int, default=1, help="requests per batch")
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens each")
    p.add_argument("--output-len", type=positive_int, default=256, help="new tokens each")
    p.add_argument("--draft", default=None, help="EAGLE3 checkpoint; unset: a random head")
    p.add_argument(
        "--draft-vocab-size", type=int, default=32000, help="the random head's draft vocabulary"
    )
    p.add_argument(
        "--accept-lengths",
        type=float,
        nargs="+",
        default=[1.0, 2.0, 3.0, 4.0],
        help="simulated accept lengths, one speculative row pair each; each in "
        "[1, 1 + min(num-steps, num-draft-tokens - 1)]",
    )
    p.add_argument("--num-steps", type=positive_int, default=3, help="draft steps, 1 to 16")
    p.add_argument("--topk", type=positive_int, default=1, help="draft tree branching, 1 to 16")
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="tokens verified per step; unset: 1 + num-steps x topk",
    )
    p.add_argument("--skip-hf", action="store_true", help="do not run HF transformers")
    p.add_argument("--output-json", default=None, help="also write the rows to this file")
    p.add_argument("--plot", default=None, help="PNG path: decode tok/s against accept length")
    p.set_defaults(func=cmd_compare)
    return p


def _engine_row(label: str, overlap: bool, accept: float | None, args, **engine_kwargs) -> dict:
    from specserve.engine import Engine

    kwargs = dict(
        model_path=args.model_path,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        disable_overlap_schedule=not overlap,
        **engine_kwargs,
    )
    with Engine(**kwargs) as engine:
        r = run_one_batch(engine, args.batch_size, args.input_len, args.output_len)
    del engine  # its KV cache must be freed before the next engine sizes its own
    free_device_memory()
    return {
        "engine": label,
        "overlap": overlap,
        "accept_length_target": accept,
        "accept_length": r.get("spec_accept_length", 1.0 if accept is None else None),
        "decode_tok_s": r["decode_throughput_tok_s"],
        "ms_per_step_token": r["per_token_latency_ms"],
        "prefill_s": r["prefill_latency_s"],
    }


def hf_static_cache_row(args) -> dict[str, Any]:
    """HF transformers generate() with the static cache, greedy, same shapes."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specserve.config import EngineConfig
    from specserve.model.loader import locate, read_config

    cfg = EngineConfig(model_path=args.model_path, device=args.device, dtype=args.dtype).resolve()
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    src = locate(args.model_path, args.load_format)
    if src.kind == "hf" and args.load_format != "dummy":
        model = AutoModelForCausalLM.from_pretrained(src.path, torch_dtype=dtype)
    else:
        mc = read_config(src)
        hf_cfg = LlamaConfig(
            vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size,
            num_hidden_layers=mc.num_layers,
            num_attention_heads=mc.num_heads,
            num_key_value_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            max_position_embeddings=mc.max_position_embeddings,
            rope_theta=mc.rope_theta,
            tie_word_embeddings=mc.tie_word_embeddings,
        )
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=dtype)
    model = model.to(device).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.batch_size, args.input_len), generator=g)
    ids = ids.to(device)

    def timed(new_tokens: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                cache_implementation="static",
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    # Warm-up at the longest length first: generate() then keeps that static cache length
    # for the shorter calls instead of recompiling for each new length (a first H200 run
    # that warmed up on 8 tokens timed recompilation: 5.7 tok/s for the 8B shape).
    timed(args.output_len)
    timed(1)
    prefill = timed(1)
    total = timed(args.output_len)
    decode = max(total - prefill, 1e-9)
    return {
        "engine": "hf-transformers-static",
        "overlap": None,
        "accept_length_target": None,
        "accept_length": 1.0,
        "decode_tok_s": args.batch_size * (args.output_len - 1) / decode,
        "ms_per_step_token": 1000 * decode / max(1, args.output_len - 1),
        "prefill_s": prefill,
    }


def run_compare(args) -> list[dict[str, Any]]:
    rows = [_engine_row("specserve", ov, None, args, no_default_draft=True) for ov in (True, False)]
    draft = args.draft
    if draft is None:
        from specserve.model.loader import locate, read_config
        from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint

        target_cfg = read_config(locate(args.model_path, args.load_format))
        draft = os.path.join(tempfile.mkdtemp(prefix="specserve-eagle3-"), "draft")
        vocab = min(args.draft_vocab_size, target_cfg.vocab_size)
        write_random_eagle_checkpoint(draft, target_cfg, "EAGLE3", draft_vocab_size=vocab)
    ndt = args.num_draft_tokens or 1 + args.num_steps * args.topk
    spec = dict(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        speculative_num_steps=args.num_steps,
        speculative_eagle_topk=args.topk,
        speculative_num_draft_tokens=ndt,
        simulate_acc_method="match-expected",
    )
    for acc in args.accept_lengths:
        for ov in (True, False):
            rows.append(
                _engine_row("specserve-eagle3", ov, acc, args, simulate_acc_len=acc, **spec)
            )
    if not args.skip_hf:
        try:
            rows.append(hf_static_cache_row(args))
        except ImportError as e:
            print(f"HF transformers not run: {e}")
        free_device_memory()
    base = rows[0]["decode_tok_s"]
    hf = next((r["decode_tok_s"] for r in rows if r["engine"].startswith("hf")), None)
    for r in rows:
        r["vs_specserve_plain"] = r["decode_tok_s"] / base
        r["vs_hf"] = r["decode_tok_s"] / hf if hf else None
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for ov in (True, False):
        pts = sorted(
            (r["accept_length"], r["decode_tok_s"])
            for r in rows
            if r["engine"] == "specserve-eagle3" and r["overlap"] == ov
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"EAGLE3, overlap {'on' if ov else 'off'}")
    baselines = [r for r in rows if r["accept_length_target"] is None]
    for i, r in enumerate(baselines):
        overlap = "" if r["overlap"] is None else f" (overlap {'on' if r['overlap'] else 'off'})"
        ax.axhline(
            r["decode_tok_s"],
            color=f"C{i + 2}",
            linestyle="--",
            linewidth=1,
            label=r["engine"] + overlap,
        )
    ax.set_xlabel("accept length (tokens per verify, bonus included)")
    ax.set_ylabel("decode tok/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_compare(args) -> int:
    rows = run_compare(args)
    dump(rows, args.output_json)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0
