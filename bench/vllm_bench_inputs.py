"""The files `vllm bench serve` needs for SmolLM2, written from what specserve packages (the
GPU machine cannot download anything):

  python3 bench/vllm_bench_inputs.py prompts OUT.jsonl     # for --dataset-name custom
  python3 bench/vllm_bench_inputs.py tokenizer DIR         # for --tokenizer (client, vllm serve)

Prompts: the packaged held-out and bench prompts (never trained on; the ones `specserve bench
one-batch --chat` uses), one `{"prompt": text}` per line, the user's text without any chat
template. vLLM's custom dataset reads this (a .jsonl file with a "prompt" column) and applies
the tokenizer's chat template itself unless told `--skip-chat-template`. So:
- /v1/chat/completions (`--backend openai-chat`): pass `--skip-chat-template`; the client sends
  the text as the user message and the server applies its template.
- /v1/completions (`--backend openai`): leave the template on; the client sends the templated
  text as the prompt, which tokenizes to the ids the chat route would make.

Tokenizer: the GGUF's own tokenizer and chat template as a Hugging Face folder
(tokenizer.json, tokenizer_config.json naming the generic fast tokenizer class, so older
transformers read it too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT_FILES = ("heldout_prompts.jsonl", "bench_prompts.jsonl")


def packaged_prompts() -> list[str]:
    texts = []
    for name in PROMPT_FILES:
        data = resources.files("specserve").joinpath("data", name).read_text()
        texts += [json.loads(line)["prompt"] for line in data.splitlines() if line.strip()]
    return texts


def write_prompt_file(path: str) -> int:
    if not path.endswith(".jsonl"):  # vLLM's custom dataset refuses any other name
        raise ValueError(f"{path}: vLLM's custom dataset reads only files named *.jsonl")
    prompts = packaged_prompts()
    with open(path, "w", encoding="utf-8") as f:
        for text in prompts:
            f.write(json.dumps({"prompt": text}, ensure_ascii=False) + "\n")
    return len(prompts)


def write_tokenizer_folder(dst: str, model: str = "smollm2-135m") -> None:
    from specserve.model.registry import resolve_packaged
    from specserve.model.tokenizer import load_tokenizer

    gguf = resolve_packaged(model) or model
    tok = load_tokenizer(gguf, "gguf")
    os.makedirs(dst, exist_ok=True)
    tok.backend_tokenizer.save(os.path.join(dst, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "unk_token": tok.unk_token,
        "pad_token": tok.pad_token,
        "chat_template": tok.chat_template,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prompts", help="the packaged chat prompts as a .jsonl").add_argument("out")
    tok = sub.add_parser("tokenizer", help="the GGUF's tokenizer as an HF folder")
    tok.add_argument("dst")
    tok.add_argument("--model", default="smollm2-135m", help="a packaged name or a .gguf file")
    args = p.parse_args()
    if args.cmd == "prompts":
        print(f"wrote {write_prompt_file(args.out)} prompts to {args.out}")
    else:
        write_tokenizer_folder(args.dst, args.model)
        print(f"wrote the tokenizer of {args.model} to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
