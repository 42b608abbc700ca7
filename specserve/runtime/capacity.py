"""How long a sequence may be and how many tokens the KV cache holds: decided once the model
is loaded, each with the reason `Engine.resolved_args()` reports."""

from __future__ import annotations

from typing import Any

import torch

from specserve.config import EngineConfig
from specserve.errors import InvalidArgument
from specserve.model.config import ModelConfig

CPU_DEFAULT_KV_TOKENS = 16384

Decision = tuple[str, Any, str]


def context_length(cfg: EngineConfig, model: ModelConfig) -> tuple[int, Decision]:
    positions = model.max_position_embeddings
    if cfg.context_length is None:
        return positions, ("context_length", positions, "the model's max_position_embeddings")
    if cfg.context_length > positions:
        # past the positions it was trained on a model's output is garbage (SGLang and vLLM
        # refuse this too)
        raise InvalidArgument(
            "context_length",
            f"must be <= {positions} (the model's max_position_embeddings), "
            f"got {cfg.context_length}",
        )
    return cfg.context_length, ("context_length", cfg.context_length, "requested")


def kv_pages(
    cfg: EngineConfig, device: torch.device, bytes_per_token: int, tp=None
) -> tuple[int, Decision]:
    """The KV cache's pages, the scratch page included; tp: every rank holds as many."""
    if cfg.max_total_tokens:
        tokens, why = cfg.max_total_tokens, f"{cfg.max_total_tokens} requested"
    elif device.type == "cuda":
        tokens = _tokens_in_free_memory(cfg, device, bytes_per_token)
        why = "mem_fraction_static of the device's memory, less the weights"
    else:
        tokens, why = CPU_DEFAULT_KV_TOKENS, f"the CPU default of {CPU_DEFAULT_KV_TOKENS}"
    if tp is not None:
        tokens = tp.min_int(tokens)
        why += ", the same on every rank"
    num_pages = 1 + -(-tokens // cfg.page_size)
    usable = (num_pages - 1) * cfg.page_size
    return num_pages, ("max_total_tokens", usable, f"{why}, in whole pages of {cfg.page_size}")


def _tokens_in_free_memory(cfg: EngineConfig, device: torch.device, bytes_per_token: int) -> int:
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1.0 - cfg.mem_fraction_static) * total
    if budget <= bytes_per_token * 1024:
        raise InvalidArgument(
            "mem_fraction_static", "leaves no memory for the KV cache after the weights"
        )
    return int(budget // bytes_per_token)
