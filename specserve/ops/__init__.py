"""Kernels and their torch references: attention and its metadata, sampling, the fused GPU
kernels (each Triton kernel beside its reference). Which of them runs is decided by the
configuration (`specserve.config.Kernels`) and passed in by the caller."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_available() -> bool:
    """The triton package is importable (CPU-only installs may lack it)."""
    return importlib.util.find_spec("triton") is not None
