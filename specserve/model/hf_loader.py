"""Hugging Face model folders: config.json + safetensors (single file or sharded)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from specserve.model.config import ModelConfig


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no config.json")
    with open(path) as f:
        return json.load(f)


def load_hf_config(folder: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(read_hf_config(folder))


def iter_safetensors(folder: str, shard=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in the folder (shards included); with a
    `CheckpointShard` (tensor parallelism) only this rank's part of each is read."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if shard is None:
                    yield name, f.get_tensor(name)
                else:
                    yield name, shard.read(name, f.get_slice(name))
