"""Resolution of the speculative-decoding arguments (called from EngineConfig.resolve): the
bundled draft of a packaged model, the tree shape, simulated acceptance."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

from specserve.config.environment import SIMULATE_FIELDS, simulate_acc_aliases
from specserve.errors import InvalidArgument, require
from specserve.model.registry import bundled_draft, bundled_draft_folder, draft_serving_settings
from specserve.sampling_params import is_int

ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE")
MAX_TOPK = 16  # siblings per node
MAX_STEPS = 16
MAX_GROWTH = 1 << 20  # rows a growing draft vocabulary may add (speculative/draft_vocab.py)
SIMULATE_METHODS = ("multinomial", "match-expected", "per-position")
SIMULATE_TOKEN_MODES = ("real-draft-token", "fixed")
SPEC_FIELDS = (
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_token_map",
    "speculative_token_map_growth",
    "speculative_adaptive_lag_tokens",
)


# Plain steps of adaptive speculation skip the draft for up to this many tokens per request
# (a ring of the target's features per request): one catch-up pass reads the draft's weights
# once for them all, and the ring stays small (EAGLE3 at 8B: 24 KiB per token).
DRAFT_LAG_TOKENS = 32
# The ring holds this many positions of target features per running request (EAGLE3 at 8B:
# 24 KiB each), and one catch-up pass extends the draft over them all.
MAX_DRAFT_LAG_TOKENS = 1024


def chain_sized(steps: int, topk: int, num_draft_tokens: int) -> int:
    """The tree size that runs: a chain (topk 1) verifies its root and every drafted token,
    num_steps + 1, whatever size was given (as SGLang sets it); a tree, the size given."""
    return steps + 1 if topk == 1 else num_draft_tokens


def small_tree(steps: int, topk: int, tokens: int) -> tuple[int, int, int] | None:
    """(steps, topk, tokens) of the small tree load-adaptive speculation adds to a configured
    tree: at most 4 steps of topk 4 verifying 16 nodes, no more than those steps and topk
    draft; None where the configured tree is a chain or no larger (why it is a tier:
    speculative/adaptive.py's `speculation_tiers`). A leaf here, so the resolver's account
    of the tiers and the policy build it alike."""
    if topk == 1:
        return None
    small_steps, small_topk = min(steps, 4), min(topk, 4)
    drafted = 1 + small_topk + (small_steps - 1) * small_topk * small_topk  # root + candidates
    small = (small_steps, small_topk, min(tokens, 16, drafted))
    if small == (steps, topk, tokens) or small[2] <= small_steps + 1:
        return None
    return small


def resolve_bundled_draft(c, on_gpu: bool) -> tuple[Any, list[tuple[str, Any, str]]]:
    """A packaged model runs with its bundled draft unless told otherwise: the draft's own
    serving settings fill every speculative argument the user left unset (one by one), so
    `speculative_num_steps=5` alone runs the bundled draft 5 steps deep."""
    decisions: list[tuple[str, Any, str]] = []
    draft = bundled_draft(c.model_path)
    if draft is None:
        return c, decisions
    why_not = None
    if c.no_default_draft:
        why_not = "no_default_draft: plain decoding"
    elif c.load_format == "dummy":
        why_not = "load_format=dummy: random target weights, a trained draft is no use"
    elif c.speculative_draft_model_path is not None:
        why_not = "the user's own draft"
    elif c.speculative_algorithm is not None and str(c.speculative_algorithm).upper() != (
        draft.algorithm
    ):
        why_not = f"{c.speculative_algorithm} asked for; the bundled draft is {draft.algorithm}"
    folder = None if why_not else bundled_draft_folder(c.model_path)
    if why_not is None and folder is None:
        why_not = "its files are missing from this installation"
    if why_not is not None:
        decisions.append(
            (
                "speculative_draft_model_path",
                c.speculative_draft_model_path,
                f"bundled {draft.algorithm} draft of {c.model_path} not used: {why_not}",
            )
        )
        return c, decisions
    user_draft_tokens = c.speculative_num_draft_tokens
    settings = {
        "speculative_algorithm": draft.algorithm,
        "speculative_draft_model_path": folder,
        **draft_serving_settings(folder, on_gpu),
    }
    device = "GPU" if on_gpu else "CPU"
    for name, value in settings.items():
        if getattr(c, name) is None:
            c = replace(c, **{name: value})
            decisions.append(
                (
                    name,
                    value,
                    f"the bundled draft of {c.model_path}, as served on a {device} "
                    "(no_default_draft turns it off)",
                )
            )
    # A user's steps / topk may leave the bundled tree size impossible: fit it to the tree
    # (a size the user gave is theirs, checked by resolve_speculative)
    steps, topk = c.speculative_num_steps, c.speculative_eagle_topk
    ndt = c.speculative_num_draft_tokens
    if user_draft_tokens is None and all(is_int(v) and v >= 1 for v in (steps, topk, ndt)):
        max_tree = 1 + topk + (steps - 1) * topk * topk
        if ndt > max_tree:
            c = replace(c, speculative_num_draft_tokens=max_tree)
            decisions.append(
                (
                    "speculative_num_draft_tokens",
                    max_tree,
                    f"the bundled {ndt} exceeds the largest tree of {steps} steps, topk {topk}",
                )
            )
        elif topk == 1 and ndt < steps + 1:  # (not the user's size: no warning about it)
            c = replace(c, speculative_num_draft_tokens=steps + 1)
            decisions.append(
                (
                    "speculative_num_draft_tokens",
                    steps + 1,
                    f"the bundled {ndt} is short of a chain of {steps} steps: num_steps + 1",
                )
            )
    return c, decisions


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
        # (refused like the other speculative settings: a user asking for it expects drafts)
        require(
            not c.speculative_adaptive,
            "speculative_adaptive",
            "needs speculative decoding: set speculative_algorithm (EAGLE, EAGLE3 or "
            "STANDALONE) with its draft, or serve a packaged model with its bundled draft",
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
    for name, most in (("speculative_num_steps", MAX_STEPS), ("speculative_eagle_topk", MAX_TOPK)):
        v = getattr(c, name)
        require(v is None or 1 <= v <= most, name, f"must be in [1, {most}], got {v}")
    if c.speculative_num_steps is None:
        # SGLang chooses the three together, and refuses topk or a tree size without the steps
        for name in ("speculative_eagle_topk", "speculative_num_draft_tokens"):
            if getattr(c, name) is not None:
                raise InvalidArgument(
                    "speculative_num_steps",
                    f"must be set (an integer in [1, {MAX_STEPS}]) when {name} is, as SGLang "
                    "requires; or leave all "
                    "three tree settings unset for the default 3-step chain",
                )
        decide(
            "speculative_num_steps", 3, "nothing given: a 3-step chain suits a small verify budget"
        )
        decide("speculative_eagle_topk", 1, "nothing given: topk 1 drafts a chain")
    if c.speculative_eagle_topk is None:
        decide("speculative_eagle_topk", 1, "not given: topk 1 drafts a chain")
    steps, topk = c.speculative_num_steps, c.speculative_eagle_topk
    # the candidates drafting produces: topk at depth 1, then topk children of each of the topk
    # frontier nodes per further step (SGLang's bound); the tree keeps the best of them
    max_tree = 1 + topk + (steps - 1) * topk * topk
    if c.speculative_num_draft_tokens is None:
        value = min(1 + steps * topk, 64)
        decide(
            "speculative_num_draft_tokens",
            value,
            f"not given: 1 + num_steps * topk, at most 64 -> {value}",
        )
    if c.speculative_num_draft_tokens != chain_sized(steps, topk, c.speculative_num_draft_tokens):
        # as SGLang does: a chain verifies its root and every drafted token, no fewer (it
        # would draft tokens nothing verifies) and no more (there are none)
        reason = (
            f"{c.speculative_num_draft_tokens} adjusted to num_steps + 1 = {steps + 1}, "
            "as SGLang does when speculative_eagle_topk == 1 (a chain of num_steps tokens)"
        )
        logging.getLogger(__name__).warning("speculative_num_draft_tokens %s", reason)
        decide("speculative_num_draft_tokens", steps + 1, reason)
    ndt = c.speculative_num_draft_tokens
    require(
        2 <= ndt <= max_tree,
        "speculative_num_draft_tokens",
        f"must be in [2, {max_tree}] (1 + topk + (num_steps - 1) * topk^2: the draft "
        f"candidates with num_steps={steps}, topk={topk}), got {ndt}",
    )
    if c.speculative_token_map is not None:
        # the file itself is read and checked against the vocabulary when the draft is built
        require(
            algo == "EAGLE",
            "speculative_token_map",
            f"applies to EAGLE drafts, which rank tokens with the target's lm_head; got {algo} "
            "(an EAGLE3 draft has its own reduced vocabulary, a STANDALONE draft its own lm_head)",
        )
        require(
            isinstance(c.speculative_token_map, str) and c.speculative_token_map != "",
            "speculative_token_map",
            f"must be a file path, got {c.speculative_token_map!r}",
        )
    growth = c.speculative_token_map_growth
    if growth is not None:
        require(
            isinstance(growth, int) and not isinstance(growth, bool) and 0 <= growth <= MAX_GROWTH,
            "speculative_token_map_growth",
            f"must be an integer in [0, {MAX_GROWTH}], got {growth!r}",
        )
        require(
            growth == 0 or c.speculative_token_map is not None,
            "speculative_token_map_growth",
            "extends a reduced draft vocabulary (EAGLE drafts only): give "
            "speculative_token_map too",
        )
    if c.speculative_adaptive:
        steps = min(steps, ndt - 1)  # what the drafter drafts (speculative/drafter.py)
        chain = min(steps, 3)
        budgets = [v for v in (ndt // 4, ndt // 2) if 2 <= v < ndt] if topk > 1 else []
        ragged = "".join(f", the tree verifying {v} of its nodes per request" for v in budgets)
        chains = "a chain of 1" if chain == 1 else f"chains of 1 to {chain} steps"
        small = small_tree(steps, topk, ndt)
        if small is not None:
            chains += f", a {small[0]}-step topk-{small[1]} tree of {small[2]}"
        tiers = f"plain, {chains}{ragged}, the {steps}-step topk-{topk} tree of {ndt}"
        decisions.append(
            (
                "speculative_adaptive",
                True,
                f"each step drafts one of: {tiers} tokens, the one emitting the most tokens "
                "per second at its batch size (step times measured on this device, acceptance "
                "observed); a partly verified tree gives each request as many nodes as its "
                "calibrated draft probabilities say they are worth",
            )
        )
        lag = c.speculative_adaptive_lag_tokens
        require(
            lag is None or (is_int(lag) and 0 <= lag <= MAX_DRAFT_LAG_TOKENS),
            "speculative_adaptive_lag_tokens",
            f"must be an integer in [0, {MAX_DRAFT_LAG_TOKENS}] (0: the draft runs every "
            f"step), got {lag!r}",
        )
        if lag is None:
            c = replace(c, speculative_adaptive_lag_tokens=DRAFT_LAG_TOKENS)
            decisions.append(
                (
                    "speculative_adaptive_lag_tokens",
                    DRAFT_LAG_TOKENS,
                    "plain steps skip the draft (its weights are not read every step); it "
                    f"catches up on up to {DRAFT_LAG_TOKENS} tokens in one pass when "
                    "speculation resumes, and a request further behind stops speculating",
                )
            )
    else:
        require(
            not c.speculative_adaptive_lag_tokens,
            "speculative_adaptive_lag_tokens",
            "applies to speculative_adaptive only: set speculative_adaptive too",
        )
        decisions.append(
            (
                "speculative_adaptive",
                False,
                "every step drafts the configured shape (the default: with the bundled draft "
                "on chat prompts on an H100 adaptive speculation ran 1.00x the served tree "
                "at batch 1 and 1.15-1.99x it at 16-128, but 0.99x the best fixed tier at "
                "16, 0.96x at 64 and 0.91x at 128, where steps wait on the host; and it "
                "captures and times every tier at start-up, 84-115 s for SmolLM2-135M and "
                "87 s at a Llama-3-8B shape on a fresh machine): speculative_adaptive turns "
                "it on",
            )
        )
    return c, decisions


def resolve_simulation(c) -> tuple[Any, list[tuple[str, Any, str]]]:
    """Simulated acceptance: unset fields from their environment aliases
    (SPECSERVE_SIMULATE_ACC_*, as SGLang's SGLANG_SIMULATE_ACC_*), validate, clip."""
    decisions: list[tuple[str, Any, str]] = []

    def decide(name: str, value: Any, reason: str) -> None:
        nonlocal c
        c = replace(c, **{name: value})
        decisions.append((name, value, reason))

    aliases = simulate_acc_aliases()
    for name in SIMULATE_FIELDS:
        env = aliases.get(name)
        if getattr(c, name) is None and env not in (None, ""):
            try:
                value = (
                    int(env)
                    if name == "simulate_acc_fixed_token"
                    else (float(env) if name == "simulate_acc_len" else env)
                )
            except ValueError as e:
                raise InvalidArgument(name, f"environment value {env!r} is not a number") from e
            decide(name, value, "from the environment")
    if c.simulate_acc_len is None:
        for name in SIMULATE_FIELDS[1:]:
            if getattr(c, name) is not None:
                raise InvalidArgument(name, "is set but simulate_acc_len is not")
        return c, decisions
    if c.speculative_algorithm is None:
        raise InvalidArgument(
            "simulate_acc_len", "needs speculative decoding (set speculative_algorithm)"
        )
    length = c.simulate_acc_len
    require(
        isinstance(length, (int, float))
        and not isinstance(length, bool)
        and (not isinstance(length, float) or math.isfinite(length))
        and length >= 1,
        "simulate_acc_len",
        f"must be a finite number >= 1 (the mean accept length: 1 = every draft rejected), "
        f"got {length!r}",
    )
    if c.simulate_acc_method is None:
        decide(
            "simulate_acc_method",
            "multinomial",
            "SGLang's default: each length is round(Normal(simulate_acc_len, 1)) clipped to "
            "[1, num_steps + 1], so near either end the mean moves inward (1 gives about 1.4); "
            "match-expected gives the mean exactly",
        )
    require(
        c.simulate_acc_method in SIMULATE_METHODS,
        "simulate_acc_method",
        f"{c.simulate_acc_method!r} is not one of {', '.join(SIMULATE_METHODS)}",
    )
    if c.simulate_acc_token_mode is None:
        decide(
            "simulate_acc_token_mode", "real-draft-token", "keeps tokens and KV cache consistent"
        )
    require(
        c.simulate_acc_token_mode in SIMULATE_TOKEN_MODES,
        "simulate_acc_token_mode",
        f"{c.simulate_acc_token_mode!r} is not one of {', '.join(SIMULATE_TOKEN_MODES)}",
    )
    # a tree of N nodes is at most N - 1 deep: a wide tree may verify fewer than num_steps + 1
    max_len = min(c.speculative_num_steps, c.speculative_num_draft_tokens - 1) + 1
    if length > max_len:
        reason = (
            f"{length} exceeds the longest accepted path, min(num_steps, "
            f"num_draft_tokens - 1) + 1 = {max_len}: clipped"
        )
        logging.getLogger(__name__).warning("simulate_acc_len %s", reason)
        decide("simulate_acc_len", float(max_len), reason)
    if c.simulate_acc_method == "per-position":
        rates = parse_rates(c.simulate_acc_rates)
        require(
            len(rates) == c.speculative_num_steps,
            "simulate_acc_rates",
            f"per-position needs {c.speculative_num_steps} rates (one per draft depth), got {len(rates)}",
        )
    elif c.simulate_acc_rates is not None:
        raise InvalidArgument(
            "simulate_acc_rates", "only applies to simulate_acc_method=per-position"
        )
    if c.simulate_acc_fixed_token is not None:
        t = c.simulate_acc_fixed_token
        require(
            c.simulate_acc_token_mode == "fixed",
            "simulate_acc_fixed_token",
            "applies to simulate_acc_token_mode=fixed only: set that mode too",
        )
        require(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0,
            "simulate_acc_fixed_token",
            f"must be a token id >= 0, got {t!r}",
        )
    return c, decisions


def parse_rates(value) -> list[float]:
    if value is None:
        raise InvalidArgument("simulate_acc_rates", "per-position needs rates, e.g. '0.8,0.6,0.4'")
    try:
        rates = (
            [float(x) for x in str(value).split(",")]
            if not isinstance(value, (list, tuple))
            else [float(x) for x in value]
        )
    except ValueError as e:
        raise InvalidArgument(
            "simulate_acc_rates", f"{value!r} is not a comma-separated list of numbers"
        ) from e
    for r in rates:
        require(0.0 <= r <= 1.0, "simulate_acc_rates", f"every rate must be in [0, 1], got {r}")
    return rates
