"""The bundled prompt sets (`specserve/data/{train,heldout}_prompts.jsonl`, one
{"prompt": str, "category": str} per line; `tools/make_prompts.py` writes them): 'train' for
self-distillation, 'heldout' (other templates and topics, never trained on) for measuring."""

from __future__ import annotations

import json
from importlib import resources

BUNDLED_PROMPTS = ("train", "heldout")  # the prompt sets packaged in specserve/data


def parse_prompt_lines(text: str, source: str) -> list[str]:
    """The prompts of a JSONL text, one {"prompt": str, ...} object per non-blank line; a
    line that is not one raises ValueError naming `source` and the line."""
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} line {number} is not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(
                f'{source} line {number} is not an object with a "prompt" string: {line[:80]!r}'
            )
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{source} holds no prompt (one JSON object per line expected)")
    return prompts


def load_prompts(name_or_path: str = "train") -> list[str]:
    """Prompts of a bundled set ('train' or 'heldout') or of a JSONL file ({"prompt": ...})."""
    if name_or_path in BUNDLED_PROMPTS:
        text = (
            resources.files("specserve")
            .joinpath(f"data/{name_or_path}_prompts.jsonl")
            .read_text(encoding="utf-8")
        )
    else:
        with open(name_or_path, encoding="utf-8") as f:
            text = f.read()
    return parse_prompt_lines(text, name_or_path)
