"""Resolution of the speculative-decoding arguments (called from EngineConfig.resolve)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from specserve.errors import InvalidArgument, require

ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
MAX_TOPK = 16  # siblings per node
MAX_STEPS = 16
SPEC_FIELDS = (
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
)


def resolve_speculative(c) -> tuple[Any, list[tuple[str, Any, str]]]:
    """Fill defaults and refuse impossible combinations. Returns (config, decisions)."""
    decisions: list[tuple[str, Any, str]] = []

    def decide(name: str, value: Any, reason: str) -> None:
        nonlocal c
        c = replace(c, **{name: value})
        decisions.append((name, value, reason))

    algo = c.speculative_algorithm
    if algo is None:
        for f in SPEC_FIELDS:
            if getattr(c, f) is not None:
                raise InvalidArgument(
                    f, "is set but speculative_algorithm is not (EAGLE, EAGLE3 or STANDALONE)"
                )
        return c, decisions
    if isinstance(algo, str) and algo.upper() in ALGORITHMS and algo != algo.upper():
        decide("speculative_algorithm", algo.upper(), "algorithm names are upper case")
        algo = c.speculative_algorithm
    require(
        algo in ALGORITHMS,
        "speculative_algorithm",
        f"{algo!r} is not one of {', '.join(ALGORITHMS)}",
    )
    if c.speculative_draft_model_path is None:
        raise InvalidArgument(
            "speculative_draft_model_path",
            f"{algo} needs a draft model (an EAGLE checkpoint folder, or for STANDALONE any model the engine loads)",
        )
    for name in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        v = getattr(c, name)
        if v is not None:
            require(
                isinstance(v, int) and not isinstance(v, bool),
                name,
                f"must be an integer, got {v!r}",
            )
    if (
        c.speculative_num_steps is None
        and c.speculative_eagle_topk is None
        and c.speculative_num_draft_tokens is None
    ):
        decide(
            "speculative_num_steps", 3, "nothing given: a 3-step chain suits a small verify budget"
        )
        decide("speculative_eagle_topk", 1, "nothing given: topk 1 drafts a chain")
    if c.speculative_num_steps is None:
        decide("speculative_num_steps", 3, "not given: 3 draft steps")
    if c.speculative_eagle_topk is None:
        decide("speculative_eagle_topk", 1, "not given: topk 1 drafts a chain")
    steps, topk = c.speculative_num_steps, c.speculative_eagle_topk
    require(
        1 <= steps <= MAX_STEPS,
        "speculative_num_steps",
        f"must be in [1, {MAX_STEPS}], got {steps}",
    )
    require(
        1 <= topk <= MAX_TOPK, "speculative_eagle_topk", f"must be in [1, {MAX_TOPK}], got {topk}"
    )
    max_tree = 1 + steps * topk
    if c.speculative_num_draft_tokens is None:
        value = min(max_tree, 64)
        decide(
            "speculative_num_draft_tokens",
            value,
            f"not given: 1 + num_steps * topk, at most 64 -> {value}",
        )
    ndt = c.speculative_num_draft_tokens
    require(
        2 <= ndt <= max_tree,
        "speculative_num_draft_tokens",
        f"must be in [2, {max_tree}] (1 + speculative_num_steps * speculative_eagle_topk with "
        f"num_steps={steps}, topk={topk}), got {ndt}",
    )
    return c, decisions
