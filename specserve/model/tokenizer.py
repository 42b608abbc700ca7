"""Tokenizers and chat templates, through transformers."""

from __future__ import annotations

import os

from specserve.model.gguf_loader import gguf_chat_template


def load_tokenizer(source: str, kind: str):
    """kind: 'gguf' (a .gguf file) or 'hf' (a folder with tokenizer files)."""
    from transformers import AutoTokenizer

    if kind == "gguf":
        tok = AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(source)), gguf_file=os.path.basename(source)
        )
        if not getattr(tok, "chat_template", None):
            tok.chat_template = gguf_chat_template(source)
        return tok
    return AutoTokenizer.from_pretrained(source)


def has_tokenizer_files(folder: str) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    return any(os.path.isfile(os.path.join(folder, n)) for n in names)


def apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (the engine was started with skip_tokenizer_init)")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
