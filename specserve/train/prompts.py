"""The bundled prompt sets (`specserve/data/{train,heldout}_prompts.jsonl`, one
{"prompt": str, "category": str} per line; `tools/make_prompts.py` writes them): 'train' for
self-distillation, 'heldout' (other templates and topics, never trained on) for measuring."""

from __future__ import annotations

import json
from importlib import resources


def load_prompts(name_or_path: str = "train") -> list[str]:
    """Prompts of a bundled set ('train' or 'heldout') or of a JSONL file ({"prompt": ...})."""
    if name_or_path in ("train", "heldout"):
        text = (
            resources.files("specserve")
            .joinpath(f"data/{name_or_path}_prompts.jsonl")
            .read_text(encoding="utf-8")
        )
    else:
        with open(name_or_path, encoding="utf-8") as f:
            text = f.read()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
