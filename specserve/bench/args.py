"""Argument types shared by the bench commands."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """An integer >= 1 (counts and lengths: zero would measure nothing)."""
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return v
