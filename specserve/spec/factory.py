"""Builds the drafter named by the configuration."""

from __future__ import annotations


def build_drafter(cfg, target, device, dtype):
    raise NotImplementedError("speculative decoding is not available yet")
