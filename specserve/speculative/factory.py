"""Builds the drafter named by the configuration (plain decoding: the root-only drafter)."""

from __future__ import annotations

import torch

from specserve.errors import InvalidArgument
from specserve.model.loader import load_model, read_model_config
from specserve.speculative.draft_heads import StandaloneHead
from specserve.speculative.drafter import TreeDrafter
from specserve.speculative.eagle_checkpoint import (
    check_hidden_size,
    eagle3_capture_layers,
    load_eagle_head,
    read_draft_config,
)
from specserve.speculative.root_only import RootOnlyDrafter
from specserve.speculative.token_map import load_token_map

# what reading an EAGLE checkpoint raises on a missing or malformed folder (OSError:
# FileNotFoundError and kin); refused as InvalidArgument naming the draft's path
_UNREADABLE_HEAD = (OSError, ValueError, KeyError)


def _draft_load_format(cfg) -> str:
    """A dummy target pairs with a dummy draft of the same seed (the target as its own draft)."""
    return "dummy" if cfg.load_format == "dummy" else "auto"


def check_draft_readable(cfg, target) -> None:
    """Reads the draft's config alone (`target`: the target's ModelConfig), refusing what
    `build_drafter` would refuse from it, as it would (tensor parallelism checks it before
    any rank starts)."""
    path = cfg.speculative_draft_model_path
    if cfg.speculative_algorithm is None or path is None:
        return
    if cfg.speculative_algorithm == "STANDALONE":
        draft = read_model_config(path, _draft_load_format(cfg), "speculative_draft_model_path")
        _check_same_vocabulary(draft.vocab_size, target.vocab_size)
        return
    try:
        _, draft = read_draft_config(path)
        check_hidden_size(draft.hidden_size, target.hidden_size)
    except _UNREADABLE_HEAD as e:
        raise InvalidArgument("speculative_draft_model_path", str(e)) from e


def _check_same_vocabulary(draft: int, target: int) -> None:
    if draft != target:
        raise InvalidArgument(
            "speculative_draft_model_path",
            f"draft vocabulary {draft} != target vocabulary {target}",
        )


def build_drafter(
    cfg, target, device: torch.device, dtype: torch.dtype
) -> TreeDrafter | RootOnlyDrafter:
    algo = cfg.speculative_algorithm
    if algo is None:
        return RootOnlyDrafter()
    path = cfg.speculative_draft_model_path
    capture: tuple[int, ...] = ()
    if algo == "STANDALONE":
        draft = load_model(
            path,
            _draft_load_format(cfg),
            dtype,
            device,
            skip_tokenizer_init=True,
            seed=cfg.random_seed,
            field="speculative_draft_model_path",
        )
        _check_same_vocabulary(draft.config.vocab_size, target.config.vocab_size)
        head = StandaloneHead(draft.model)
    else:
        try:
            head, raw = load_eagle_head(path, algo, target.model)
            if algo == "EAGLE3":
                capture = tuple(eagle3_capture_layers(raw, target.config.num_layers))
        except _UNREADABLE_HEAD as e:
            raise InvalidArgument("speculative_draft_model_path", str(e)) from e
    vocab = target.config.vocab_size if algo != "EAGLE3" else head.lm_head.out_features
    if cfg.speculative_token_map is not None:  # EAGLE only (resolve_speculative)
        ids = load_token_map(cfg.speculative_token_map, vocab, cfg.speculative_eagle_topk)
        growth = cfg.speculative_token_map_growth or 0
        if growth > vocab - ids.numel():
            raise InvalidArgument(
                "speculative_token_map_growth",
                f"must be in [0, {vocab - ids.numel()}] (the target's {vocab} tokens minus the "
                f"map's {ids.numel()}), got {growth}",
            )
        head.restrict_vocab(ids, growth)
        vocab = ids.numel()
    if cfg.speculative_eagle_topk > vocab:
        raise InvalidArgument(
            "speculative_eagle_topk",
            f"must be in [1, {vocab}] (the draft's vocabulary holds {vocab} tokens), "
            f"got {cfg.speculative_eagle_topk}",
        )
    return TreeDrafter(
        head,
        cfg.speculative_num_steps,
        cfg.speculative_eagle_topk,
        cfg.speculative_num_draft_tokens,
        capture,
        device,
        dtype,
        cfg.kernels,
    )
