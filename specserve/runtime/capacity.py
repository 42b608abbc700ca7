"""How long a sequence may be and how many tokens the KV cache holds: decided once the model
is loaded, each with the reason `Engine.resolved_args()` reports."""

from __future__ import annotations

from typing import Any

import torch

from specserve.config import EngineConfig
from specserve.errors import InvalidArgument
from specserve.model.config import ModelConfig
from specserve.ops.sampling import SAMPLE_BLOCK_ELEMENTS
from specserve.runtime.graph_capture import release_cached_memory

CPU_DEFAULT_KV_TOKENS = 16384
# Bytes per (verified node, vocabulary entry) that a decode step holds at its peak outside
# its CUDA graph: float32 logits, the float32 copy drawn from under penalties or a grammar,
# the penalties' boolean mask, and a float32 temporary of the sampler or the log-probs. A
# tree verifies every node of every request: SmolLM2's 6/8/64 tree at 200 requests is
# 12,800 rows of 49,152 logits (2.5 GB float32 each). Their peak is not what the
# start-up graphs hold: a top-p or penalized step at that batch ran an H100 out of memory
# with the KV cache sized by mem_fraction_static alone, failing all 200 requests.
STEP_BYTES_PER_LOGIT = 13
# Bytes per entry of the filters' sort at its peak (sorted values, int64 indices, integer
# weights, their sums and ranks; 48 measured on a CPU), which runs a block of rows at a time
# (`SAMPLE_BLOCK_ELEMENTS` entries).
FILTER_BYTES = 48

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


def step_reserve_bytes(max_running_requests: int, verified_nodes: int, vocab_size: int) -> int:
    """Device memory kept out of the KV cache for the largest decode step's logits and what is
    drawn from them (`STEP_BYTES_PER_LOGIT`), beyond mem_fraction_static's share: every
    running request verifying every node of its tree."""
    logits = max_running_requests * verified_nodes * vocab_size
    return logits * STEP_BYTES_PER_LOGIT + min(logits, SAMPLE_BLOCK_ELEMENTS) * FILTER_BYTES


def kv_pages(
    cfg: EngineConfig, device: torch.device, bytes_per_token: int, tp=None, step_reserve: int = 0
) -> tuple[int, Decision]:
    """The KV cache's pages, the scratch page included; tp: every rank holds as many.
    step_reserve: bytes kept for the largest decode step (`step_reserve_bytes`)."""
    if cfg.max_total_tokens:
        tokens, why = cfg.max_total_tokens, f"{cfg.max_total_tokens} requested"
    elif device.type == "cuda":
        tokens = _tokens_in_free_memory(cfg, device, bytes_per_token, step_reserve)
        why = (
            "mem_fraction_static of the device's memory, less the weights and "
            f"{step_reserve / 2**30:.1f} GiB for the largest decode step's logits"
        )
    else:
        tokens, why = CPU_DEFAULT_KV_TOKENS, f"the CPU default of {CPU_DEFAULT_KV_TOKENS}"
    if tp is not None:
        tokens = tp.min_int(tokens)
        why += ", the same on every rank"
    num_pages = 1 + -(-tokens // cfg.page_size)
    usable = (num_pages - 1) * cfg.page_size
    return num_pages, ("max_total_tokens", usable, f"{why}, in whole pages of {cfg.page_size}")


def _tokens_in_free_memory(
    cfg: EngineConfig, device: torch.device, bytes_per_token: int, step_reserve: int
) -> int:
    # (memory this process freed but torch's allocator still caches counts as used: an
    # engine started after others in one process found no room for its KV cache)
    release_cached_memory()
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1.0 - cfg.mem_fraction_static) * total - step_reserve
    if budget <= bytes_per_token * 1024:
        raise InvalidArgument(
            "mem_fraction_static",
            "leaves no memory for the KV cache after the weights and "
            f"{step_reserve / 2**30:.1f} GiB for the largest decode step "
            "(lower max_running_requests or speculative_num_draft_tokens, or set "
            "max_total_tokens)",
        )
    return int(budget // bytes_per_token)
