"""Attention, sampling and the fused GPU kernels (each Triton kernel beside its torch
reference). Two switches every caller of a Triton kernel shares live here."""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def triton_available() -> bool:
    """The triton package is importable (CPU-only installs may lack it)."""
    return importlib.util.find_spec("triton") is not None


def env_flag(name: str) -> bool:
    """An environment switch: set to anything but '', '0', 'false' or 'no'."""
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no")
