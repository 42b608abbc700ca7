"""Bundled draft heads for packaged targets."""

from __future__ import annotations

import os
from importlib import resources

# target name -> (algorithm, folder under specserve/data/drafts)
_BUNDLED = {
    "smollm2-135m": ("EAGLE", "smollm2-135m-eagle"),
    "smollm2-135m-instruct": ("EAGLE", "smollm2-135m-eagle"),
}


def default_draft_for(model_path: str) -> str | None:
    """Folder of the bundled EAGLE draft for `model_path` (e.g. 'smollm2-135m'), or None when
    there is none (or its files are missing from this installation)."""
    entry = _BUNDLED.get(str(model_path).lower())
    if entry is None:
        return None
    folder = str(resources.files("specserve").joinpath("data", "drafts", entry[1]))
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        return None
    return folder


def default_draft_algorithm(model_path: str) -> str | None:
    """'EAGLE' for a target with a bundled draft, else None."""
    entry = _BUNDLED.get(str(model_path).lower())
    return entry[0] if entry else None
