"""A draft's reduced vocabulary ("hot tokens", as in FR-Spec and SGLang's
`--speculative-token-map`): an EAGLE head that shares the target's lm_head ranks only these
tokens while drafting.

Why: at batch 1 on a small target the draft's lm_head over the full vocabulary is the largest
kernel of a draft step (49,152 x 576 for SmolLM2-135M: ~16 us of a ~70 us step on an H200), and
the top-k after it scales with the vocabulary too. The few thousand most frequent tokens of the
target's own answers cover nearly all of what it emits. Verification is unchanged (the target
checks every drafted token against its own choice), so the output stays exactly the target's;
a token outside the map can only never be drafted.

File: `.json`, either a list of token ids or {"token_ids": [...], ...} (other keys are notes:
coverage, source), most frequent first; any other name is a torch file holding a 1-D integer
tensor or list of ids (SGLang's format). Ids must be distinct integers inside the target's
vocabulary. Unlike SGLang, a path is a local file only (no model hub is fetched), and the
option is refused rather than ignored for EAGLE3 drafts (they carry their own vocabulary).
"""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter
from collections.abc import Iterable

import torch

from specserve.errors import InvalidArgument

FIELD = "speculative_token_map"


def load_token_map(path: str, vocab_size: int, min_size: int = 1) -> torch.Tensor:
    """int64 [N] token ids from `path`, validated against the target's vocabulary."""
    if not os.path.isfile(path):
        raise InvalidArgument(FIELD, f"{path!r} is not a file (a local path; hubs are not fetched)")
    try:
        if path.endswith(".json"):
            with open(path) as f:
                raw = json.load(f)
            if isinstance(raw, dict):
                raw = raw.get("token_ids")
            if not isinstance(raw, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in raw
            ):
                raise TypeError("expected a list of integers")
            ids = torch.tensor(raw, dtype=torch.int64)
        else:
            ids = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True))
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise TypeError(f"token ids must be integers, got {ids.dtype}")
            ids = ids.to(torch.int64)
    except (OSError, ValueError, TypeError, RuntimeError, pickle.UnpicklingError) as e:
        raise InvalidArgument(FIELD, f"{path!r} is not a token-id list ({e})") from e
    if ids.dim() != 1 or ids.numel() == 0:
        raise InvalidArgument(
            FIELD,
            f"{path!r} must hold a non-empty list of token ids (JSON list, "
            '{"token_ids": [...]}, or a 1-D tensor)',
        )
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InvalidArgument(
            FIELD, f"{path!r}: token ids must be in [0, {vocab_size}) (the target's vocabulary)"
        )
    if torch.unique(ids).numel() != ids.numel():
        raise InvalidArgument(FIELD, f"{path!r}: token ids must be distinct")
    if ids.numel() < min_size:
        raise InvalidArgument(
            FIELD,
            f"{path!r} has {ids.numel()} tokens; speculative_eagle_topk={min_size} needs at least "
            f"{min_size}",
        )
    return ids


def rank_tokens(
    answers: Iterable[list[int]], vocab_size: int, size: int, prompts: Iterable[list[int]] = ()
) -> tuple[list[int], float]:
    """The `size` most frequent tokens of the target's answers (ties: more frequent in the
    prompts, then lower id; ids never seen fill the rest in id order), and the share of answer
    tokens they cover."""
    in_answers = Counter(t for a in answers for t in a)
    in_prompts = Counter(t for p in prompts for t in p)
    order = sorted(range(vocab_size), key=lambda t: (-in_answers[t], -in_prompts[t], t))
    keep = order[: min(size, vocab_size)]
    total = sum(in_answers.values())
    covered = sum(in_answers[t] for t in keep)
    return keep, (covered / total if total else 0.0)


def save_token_map(path: str, ids: list[int], **notes) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({**notes, "size": len(ids), "token_ids": ids}, f)
    os.replace(path + ".tmp", path)
