"""Bundled draft heads for packaged targets.

`specserve generate` (and so `make run`) uses the bundled draft of the default model when no
speculative flag is given (`--no-default-draft` turns that off). A draft folder may carry a
`serving.json` with the speculative settings to run it with (`speculative_num_steps`,
`speculative_eagle_topk`, `speculative_num_draft_tokens`); otherwise DEFAULT_SETTINGS apply. A
`"cuda"` section in it overrides them on a GPU: the best tree there (the device is bound by
kernel launches, so a wide tree costs little more than a chain) is too costly on a CPU. Its
`speculative_token_map` names a file in the folder (speculative/token_map.py), used on every device,
with `speculative_token_map_growth` if given (speculative/draft_vocab.py).
"""

from __future__ import annotations

import json
import os
from importlib import resources

# target name -> folder under specserve/data/drafts (EAGLE or EAGLE3: its config.json says)
_BUNDLED = {
    "smollm2-135m": "smollm2-135m-eagle",
    "smollm2-135m-instruct": "smollm2-135m-eagle",
}

# a tree of topk 4, 5 steps deep, 16 tokens verified per step
DEFAULT_SETTINGS = {
    "speculative_num_steps": 5,
    "speculative_eagle_topk": 4,
    "speculative_num_draft_tokens": 16,
}
_SETTING_KEYS = tuple(DEFAULT_SETTINGS)


def _drafts_root() -> str:
    return str(resources.files("specserve").joinpath("data", "drafts"))


def default_draft_for(model_path: str | None) -> str | None:
    """Folder of the bundled EAGLE draft for `model_path` (e.g. 'smollm2-135m'), or None when
    there is none (or its files are missing from this installation)."""
    entry = _BUNDLED.get(str(model_path).lower())
    if entry is None:
        return None
    folder = os.path.join(_drafts_root(), entry)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        return None
    return folder


def default_draft_algorithm(model_path: str | None) -> str | None:
    """'EAGLE' or 'EAGLE3' for a target with a bundled draft, else None."""
    from specserve.speculative.eagle_checkpoint import draft_algorithm

    folder = default_draft_for(model_path)
    return draft_algorithm(folder) if folder else None


def _on_cuda(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def default_draft_engine_kwargs(model_path: str | None, device: str = "auto") -> dict | None:
    """Engine arguments that run `model_path` with its bundled draft on `device` (as the engine
    resolves it: 'auto' is CUDA when available), or None without a draft."""
    folder = default_draft_for(model_path)
    if folder is None:
        return None
    settings: dict = dict(DEFAULT_SETTINGS)
    path = os.path.join(folder, "serving.json")
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        for section in (saved, saved.get("cuda", {}) if _on_cuda(device) else {}):
            settings.update({k: int(section[k]) for k in _SETTING_KEYS if k in section})
        if saved.get("speculative_token_map"):
            settings["speculative_token_map"] = os.path.join(folder, saved["speculative_token_map"])
            if saved.get("speculative_token_map_growth"):
                settings["speculative_token_map_growth"] = int(
                    saved["speculative_token_map_growth"]
                )
    return {
        "speculative_algorithm": default_draft_algorithm(model_path),
        "speculative_draft_model_path": folder,
        **settings,
    }
