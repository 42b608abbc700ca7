"""Hugging Face model folders: config.json + safetensors (single file or sharded)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from specserve.model.config import ModelConfig, token_ids


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no config.json")
    return read_json_object(path)


def read_json_object(path: str) -> dict:
    """A JSON file that must hold an object (a config), refused naming the file otherwise."""
    with open(path) as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _id_list(value) -> list:
    """An HF config's id field (one id, a list of them, or absent) as a list."""
    return [] if value is None else value if isinstance(value, list) else [value]


def _generation_eos_ids(folder: str, vocab_size: Any) -> list[int]:
    """The end-of-sequence ids of the folder's generation_config.json, if any: instruct
    models often list their end-of-turn token there alone (Qwen2.5: 151645 beside
    config.json's 151643), and transformers, vLLM and SGLang stop at those too. Refused
    naming that file, not config.json's key they are merged into."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    eos = read_json_object(path).get("eos_token_id")
    ids = _id_list(eos)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(
            f"{path}: eos_token_id must be an integer or a list of integers, got {eos!r}"
        )
    if isinstance(vocab_size, int) and not all(0 <= i < vocab_size for i in ids):
        raise ValueError(
            f"{path}: eos_token_id must be token ids in [0, vocab_size = {vocab_size}), got {eos!r}"
        )
    return ids


def load_hf_config(folder: str) -> ModelConfig:
    """The model's shape and special ids: config.json's, with generation_config.json's
    end-of-sequence ids added to its own."""
    cfg = read_hf_config(folder)
    extra = _generation_eos_ids(folder, cfg.get("vocab_size"))
    if extra:
        own = list(token_ids(cfg, "eos_token_id"))
        cfg = {**cfg, "eos_token_id": list(dict.fromkeys(own + extra))}
    return ModelConfig.from_hf_dict(cfg)


INDEX = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    """The folder's weight files: those the index's weight_map names when there is one (as
    transformers and vLLM read it: Mistral's folders hold consolidated.safetensors, the same
    weights under other names, beside the indexed shards), else every *.safetensors."""
    index = os.path.join(folder, INDEX)
    if not os.path.isfile(index):
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{folder} has no *.safetensors files")
        return files
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must be an object of tensor name -> file name")
    files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{index} names {os.path.basename(path)}, which is missing")
    return files


def iter_safetensors(folder: str, shard=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's weight files (`safetensors_files`); with a
    `CheckpointShard` (tensor parallelism) only this rank's part of each is read. A tensor
    in two files is refused: which copy would win is an accident of file names."""
    seen: dict[str, str] = {}
    for path in safetensors_files(folder):
        try:
            yield from _read_file(path, folder, seen, shard)
        except SafetensorError as e:  # (its message names no file: which shard of many?)
            raise ValueError(f"{path} cannot be read as safetensors ({_why(path, e)})") from e


def _read_file(path: str, folder: str, seen: dict[str, str], shard):
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            if name in seen:
                raise ValueError(
                    f"tensor {name!r} is in both {os.path.basename(seen[name])} and "
                    f"{os.path.basename(path)} (of {folder}): remove the stale file"
                )
            seen[name] = path
            if shard is None:
                yield name, f.get_tensor(name)
            else:
                yield name, shard.read(name, f.get_slice(name))


def _why(path: str, e: Exception) -> str:
    """safetensors' reason, or that the file is a Git LFS pointer (a clone made without LFS
    holds those in place of the weights)."""
    with open(path, "rb") as f:
        if f.read(24) == b"version https://git-lfs.":
            return "it is a Git LFS pointer, not the weights: fetch them with git lfs pull"
    return str(e)
