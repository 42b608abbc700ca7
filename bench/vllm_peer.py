"""vLLM on the workloads of `specserve bench one-batch` and `specserve bench multiturn`, for
ratios measured in the same device call (see docs/PERFORMANCE.md; how vLLM is brought to the
GPU machine is in the peers' README). Same token ids as specserve's benches, JSON rows and a
table. Weights: random (`load_format="dummy"`) from a config.json of a specserve preset, or a
real model as an HF folder (`--model-folder`, written by `hf-folder`).

  python3 bench/vllm_peer.py one-batch --preset llama3-8b --batch-size 1 16 64
  python3 bench/vllm_peer.py one-batch --preset llama3-8b --eagle3 DRAFT_DIR \
      --num-speculative-tokens 3 --synthetic-acceptance 3
  python3 bench/vllm_peer.py multiturn --preset smollm2-135m --conversations 32 --turns 4
  python3 bench/vllm_peer.py hf-folder /tmp/smollm2-hf               # CPU is enough
  python3 bench/vllm_peer.py eagle-draft specserve/data/drafts/smollm2-135m-eagle /tmp/d
  python3 bench/vllm_peer.py one-batch --model-folder /tmp/smollm2-hf --chat --output-len 128 \
      --eagle /tmp/d --num-speculative-tokens 3 --batch-size 1 16 64 128

Speculation: `--eagle3 DIR` / `--eagle DIR` (a draft folder: `write_random_eagle_checkpoint`'s,
the bundled one; `vllm_folders.vllm_draft_folder` makes it readable by vLLM), a chain of
`--num-speculative-tokens`, and with `--synthetic-acceptance L` vLLM's synthetic rejection
sampler forces acceptance length L (what `--simulate-acc-len` does in specserve).
`--chat`: the packaged chat prompts with the ids `specserve bench one-batch --chat` gives
(`specserve.bench.one_batch.chat_prompt_ids`), EOS ignored as there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.script_checks import check_output_file, require_module  # noqa: E402
from bench.vllm_folders import gguf_path, vllm_draft_folder, write_hf_folder, write_json  # noqa: E402
from specserve.bench.args import positive_int  # noqa: E402
from specserve.bench.one_batch import chat_prompt_ids, dump, same_lengths  # noqa: E402


def hf_config(preset: str) -> dict:
    """The HF config.json of a specserve preset or packaged model's shape."""
    from specserve.model.config import PRESETS

    c = PRESETS[preset]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": "bfloat16",
    }


def vocab_size(args) -> int:
    if args.model_folder:
        with open(os.path.join(args.model_folder, "config.json")) as f:
            return json.load(f)["vocab_size"]
    return hf_config(args.preset)["vocab_size"]


def dummy_folder(path: str, preset: str) -> str:
    write_json(path, "config.json", hf_config(preset))
    return path


def make_llm(args, prefix_caching: bool):
    from vllm import LLM

    if args.model_folder:
        model, load_format = args.model_folder, "auto"
    else:
        model, load_format = dummy_folder(os.path.join(args.work, "target"), args.preset), "dummy"
    kw = dict(
        model=model,
        dtype="bfloat16",
        load_format=load_format,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=prefix_caching,
        disable_log_stats=False,
        seed=0,
    )
    draft = args.eagle3 or args.eagle
    if draft:
        method = "eagle3" if args.eagle3 else "eagle"
        spec = {
            "method": method,
            "model": vllm_draft_folder(draft, os.path.join(args.work, "draft")),
            "num_speculative_tokens": args.num_speculative_tokens,
        }
        if args.synthetic_acceptance is not None:
            spec["rejection_sample_method"] = "synthetic"
            spec["synthetic_acceptance_length"] = args.synthetic_acceptance
        kw["speculative_config"] = spec
    return LLM(**kw)


def greedy(n: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)


def metric_values(llm) -> dict[str, float]:
    """Counters (value) and histograms (sum, count) by name."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if hasattr(m, "value") and isinstance(m.value, (int, float)):
            out[m.name] = out.get(m.name, 0.0) + m.value
        if hasattr(m, "sum") and hasattr(m, "count"):
            out[m.name + ":sum"] = out.get(m.name + ":sum", 0.0) + m.sum
            out[m.name + ":count"] = out.get(m.name + ":count", 0.0) + m.count
    return out


def acceptance(before: dict, after: dict) -> float | None:
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0
    )
    accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0
    )
    return 1 + accepted / drafts if drafts else None


def chat_prompts(model: str, batch_size: int, offset: int = 0) -> list[list[int]]:
    """The token ids `specserve bench one-batch --chat` runs at this batch size (`offset`
    as there: the warm-up's prompts start at offset batch_size)."""
    return chat_prompt_ids(model_tokenizer(model), batch_size, offset)


_TOKENIZERS: dict[str, object] = {}


def model_tokenizer(model: str):
    """The tokenizer specserve's engine loads for `model` (from its GGUF), kept per model."""
    if model not in _TOKENIZERS:
        from bench.vllm_folders import gguf_path
        from specserve.model.tokenizer import load_tokenizer

        _TOKENIZERS[model] = load_tokenizer(gguf_path(model), "gguf")
    return _TOKENIZERS[model]


def batch_prompts(args, bs: int) -> tuple[list[list[int]], list[list[int]]]:
    """(timed prompts, warm-up prompts) as specserve's one-batch builds them: chat prompts warm
    up on other prompts of the list cut or repeated to the timed prompts' lengths, random ones
    on themselves."""
    if args.chat:
        timed = chat_prompts(args.model, bs)
        return timed, same_lengths(chat_prompts(args.model, bs, offset=bs), timed)
    rng = random.Random(args.seed)
    vocab = vocab_size(args)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(bs)]
    return prompts, prompts


def cmd_one_batch(args) -> list[dict]:
    """specserve's one-batch method: TTFT of the batch (a max_tokens=1 run of the same
    prompts, caching off) is the prefill; the rest of a full run is the decode."""
    llm = make_llm(args, prefix_caching=False)
    rows = []
    for bs in args.batch_size:
        ids, warm_ids = batch_prompts(args, bs)
        prompts = [{"prompt_token_ids": p} for p in ids]
        warm = [{"prompt_token_ids": p} for p in warm_ids]
        llm.generate(warm, greedy(args.output_len), use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(prompts, greedy(1), use_tqdm=False)
        ttft = time.perf_counter() - t0
        before = metric_values(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy(args.output_len), use_tqdm=False)
        total = time.perf_counter() - t0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        decode = max(total - ttft, 1e-9)
        rows.append(
            {
                "system": "vllm",
                "batch_size": bs,
                "input_len": round(sum(map(len, ids)) / bs),
                "output_len": args.output_len,
                "prefill_latency_s": ttft,
                "decode_throughput_tok_s": (gen - bs) / decode,
                "total_latency_s": total,
                "output_throughput_tok_s": gen / total,
                "spec_accept_length": acceptance(before, metric_values(llm)),
            }
        )
    return rows


def cmd_multiturn(args) -> list[dict]:
    """specserve bench multiturn's conversations (same ids), prefix caching on."""
    from specserve.bench.multiturn import conversations, warm_up

    llm = make_llm(args, prefix_caching=True)
    vocab = vocab_size(args)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy(args.answer_len), use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    warm_up(args, vocab, generate)  # the same untimed turns as specserve's
    llm.reset_prefix_cache()
    system, users = conversations(args, vocab)
    histories = [list(system) for _ in users]
    start = metric_values(llm)
    ttft = {"first": (0.0, 0.0), "later": (0.0, 0.0)}  # (sum, count)
    tokens, seconds = 0, 0.0
    for turn in range(args.turns):
        before = metric_values(llm)
        prompts = [{"prompt_token_ids": h + u[turn]} for h, u in zip(histories, users)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy(args.answer_len), use_tqdm=False)
        seconds += time.perf_counter() - t0
        after = metric_values(llm)
        name = "vllm:time_to_first_token_seconds"
        s = after.get(name + ":sum", 0) - before.get(name + ":sum", 0)
        c = after.get(name + ":count", 0) - before.get(name + ":count", 0)
        key = "first" if turn == 0 else "later"
        ttft[key] = (ttft[key][0] + s, ttft[key][1] + c)
        for h, u, o in zip(histories, users, outs):
            h += u[turn] + list(o.outputs[0].token_ids)
            tokens += len(o.outputs[0].token_ids)
    end = metric_values(llm)
    queries = end.get("vllm:prefix_cache_queries", 0) - start.get("vllm:prefix_cache_queries", 0)
    hits = end.get("vllm:prefix_cache_hits", 0) - start.get("vllm:prefix_cache_hits", 0)

    def mean_ms(key):
        s, c = ttft[key]
        return 1e3 * s / c if c else None

    return [
        {
            "system": "vllm " + ("spec" if (args.eagle or args.eagle3) else "plain"),
            "hit_rate": hits / queries if queries else None,
            "ttft_first_turn_ms": mean_ms("first"),
            "ttft_later_turns_ms": mean_ms("later"),
            "output_tok_s": tokens / seconds,
            "accept_length": acceptance(start, end),
            "conversations": args.conversations,
            "turns": args.turns,
        }
    ]


def cmd_hf_folder(args) -> None:
    import torch

    write_hf_folder(args.model, args.dst, getattr(torch, args.dtype))
    print(f"wrote {args.dst} from {args.model}")


def cmd_eagle_draft(args) -> None:
    vllm_draft_folder(args.src, args.dst)
    print(f"wrote {args.dst} from {args.src}")


def parser() -> argparse.ArgumentParser:
    from specserve.model.config import PRESETS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("one-batch", "multiturn"):
        s = sub.add_parser(name)
        s.add_argument(
            "--preset",
            default="llama3-8b",
            choices=sorted(PRESETS),
            help="a specserve model shape (default: llama3-8b)",
        )
        s.add_argument(
            "--model-folder", default=None, help="real weights: an HF folder (see hf-folder)"
        )
        s.add_argument("--eagle3", default=None, help="EAGLE3 draft folder")
        s.add_argument("--eagle", default=None, help="EAGLE draft folder")
        s.add_argument("--num-speculative-tokens", type=positive_int, default=3)
        s.add_argument("--synthetic-acceptance", type=float, default=None)
        s.add_argument("--max-model-len", type=positive_int, default=4096)
        s.add_argument("--gpu-memory-utilization", type=float, default=0.8)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--work", default="/tmp/vllm-peer")
        s.add_argument("--output-json", default=None)
    one = sub.choices["one-batch"]
    one.add_argument("--batch-size", type=positive_int, nargs="+", default=[1, 16, 64])
    one.add_argument("--input-len", type=positive_int, default=512)
    one.add_argument("--output-len", type=positive_int, default=256)
    one.add_argument("--chat", action="store_true", help="specserve's packaged chat prompts")
    one.add_argument(
        "--model", default="smollm2-135m", help="--chat: the GGUF whose tokenizer makes the ids"
    )
    multi = sub.choices["multiturn"]  # the defaults of `specserve bench multiturn`
    multi.add_argument("--conversations", type=positive_int, default=32)
    multi.add_argument("--turns", type=positive_int, default=4)
    multi.add_argument("--system-len", type=positive_int, default=512)
    multi.add_argument("--user-len", type=positive_int, default=64)
    multi.add_argument("--answer-len", type=positive_int, default=128)
    hf = sub.add_parser("hf-folder", help="a GGUF as an HF Llama folder (no vLLM needed)")
    hf.add_argument("dst")
    hf.add_argument("--model", default="smollm2-135m", help="a packaged name or a .gguf file")
    hf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    draft = sub.add_parser("eagle-draft", help="a draft folder vLLM loads (no vLLM needed)")
    draft.add_argument("src")
    draft.add_argument("dst")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every path and value checked before anything is written or vLLM is imported, so a
    mistake costs one line, not a traceback after a model load."""
    model = getattr(args, "model", None)
    if model is not None and (args.cmd == "hf-folder" or getattr(args, "chat", False)):
        try:
            gguf_path(model)
        except FileNotFoundError as e:
            p.error(f"argument --model: {e}")
    if args.cmd == "eagle-draft":
        if not os.path.isdir(args.src):
            p.error(f"argument src: {args.src} is not a draft folder")
        return
    if args.cmd == "hf-folder":
        return
    if args.model_folder and not os.path.isfile(os.path.join(args.model_folder, "config.json")):
        p.error(f"argument --model-folder: {args.model_folder} has no config.json")
    for flag in ("eagle", "eagle3"):
        folder = getattr(args, flag)
        if folder and not os.path.isdir(folder):
            p.error(f"argument --{flag}: {folder} is not a draft folder")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        p.error("argument --gpu-memory-utilization: must be in (0, 1]")
    check_output_file(p, "--output-json", args.output_json)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    if args.cmd == "hf-folder":
        cmd_hf_folder(args)
        return 0
    if args.cmd == "eagle-draft":
        cmd_eagle_draft(args)
        return 0
    require_module(
        __file__, "vllm", "vLLM installed (see ../shared/peers/README.md or docs/PERFORMANCE.md)"
    )
    rows = cmd_one_batch(args) if args.cmd == "one-batch" else cmd_multiturn(args)
    dump(rows, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
