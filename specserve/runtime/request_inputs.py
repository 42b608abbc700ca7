"""The offline API's inputs (`Engine.generate`, `submit`, `make_samples`), normalized to one
entry per prompt, or refused naming the argument at fault (InvalidArgument) in the caller's
thread, before anything reaches the engine's loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specserve.errors import InvalidArgument
from specserve.model.tokenizer import check_text
from specserve.sampling_params import LOGPROB_FIELDS, SamplingParams, check_logprob_field, is_int


def check_rid(rid: Any, made_if_none: bool = True) -> None:
    """A request id is a non-empty string (the loop files requests by id, and an unhashable
    one raised there, ending the loop; an empty one could not be aborted by it). None asks
    for an id to be made, where one is (`made_if_none`: a submission, not an abort)."""
    if rid is None and not made_if_none:
        raise InvalidArgument("rid", "must be the id of a submitted request (a string), got None")
    if rid is not None and not isinstance(rid, str):
        raise InvalidArgument("rid", f"must be a string, got {type(rid).__name__}")
    if rid == "":
        raise InvalidArgument("rid", "must be a non-empty string or null (an id is made)")


def normalize_prompts(
    prompt, input_ids, tokenizer, no_tokenizer: Callable[[], str]
) -> tuple[bool, list[tuple[list[int], str]]]:
    """(whether one prompt was given, not a list; per prompt its ids and the argument it came
    in). no_tokenizer(): why there is no tokenizer, where text needs one."""
    if (prompt is None) == (input_ids is None):
        raise InvalidArgument("prompt", "give exactly one of prompt or input_ids")
    if prompt is not None:
        if tokenizer is None:
            why = no_tokenizer()
            raise InvalidArgument("prompt", f"text needs a tokenizer ({why}); pass input_ids")
        if isinstance(prompt, str):
            return True, [(_encode(tokenizer, prompt, "prompt"), "prompt")]
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(p, str) for p in prompt)
        ):
            raise InvalidArgument("prompt", "must be a string or a non-empty list of strings")
        return False, [
            (_encode(tokenizer, p, f"prompt[{i}]"), f"prompt[{i}]") for i, p in enumerate(prompt)
        ]
    if not isinstance(input_ids, list) or not input_ids:
        raise InvalidArgument(
            "input_ids", "must be a non-empty list of token ids or of lists of token ids"
        )
    if all(is_int(t) for t in input_ids):
        return True, [(list(input_ids), "input_ids")]
    if all(isinstance(x, list) and all(is_int(t) for t in x) for x in input_ids):
        return False, [(list(x), f"input_ids[{i}]") for i, x in enumerate(input_ids)]
    raise InvalidArgument("input_ids", "must be a list of ints or a list of lists of ints")


def _encode(tokenizer, text: str, field: str) -> list[int]:
    check_text(field, text)
    return list(tokenizer.encode(text, add_special_tokens=True))


def normalize_params(sp, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: one for all, or a list of n (an entry's error names
    it: `sampling_params[i].field`)."""
    if isinstance(sp, list):
        if len(sp) != n:
            raise InvalidArgument("sampling_params", f"has {len(sp)} entries for {n} prompts")
        out = []
        for i, x in enumerate(sp):
            try:
                out.append(SamplingParams.from_any(x))
            except InvalidArgument as e:
                raise entry_error(e, i) from None
        return out
    one = SamplingParams.from_any(sp)
    return [one] * n


def entry_error(e: InvalidArgument, i: int) -> InvalidArgument:
    """e, raised by entry i of a list of sampling parameters, naming that entry."""
    message = str(e)[len(e.field) + 2 :]  # (without its "field: ")
    field = "sampling_params" if e.field == "sampling_params" else f"sampling_params.{e.field}"
    return InvalidArgument(field.replace("sampling_params", f"sampling_params[{i}]", 1), message)


def normalize_rids(rid, n: int) -> list[str | None]:
    """One request id (or None) per prompt."""
    if rid is None:
        return [None] * n
    if isinstance(rid, str):
        if n != 1:
            raise InvalidArgument("rid", "give one id per prompt")
        check_rid(rid)
        return [rid]
    if not isinstance(rid, list) or not all(isinstance(r, str) and r for r in rid):
        raise InvalidArgument("rid", "must be a non-empty string or a list of them")
    if len(rid) != n:
        raise InvalidArgument("rid", f"has {len(rid)} ids for {n} prompts")
    return list(rid)


def normalize_logprob_options(n: int, **options: Any) -> list[dict[str, Any]]:
    """Per prompt, the log-prob options checked (each given once, or once per prompt)."""
    per_prompt: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, value in options.items():
        if name not in LOGPROB_FIELDS:
            raise InvalidArgument(name, f"unknown option; allowed: {', '.join(LOGPROB_FIELDS)}")
        values = value if isinstance(value, list) else [value] * n
        if len(values) != n:
            raise InvalidArgument(name, f"has {len(values)} entries for {n} prompts")
        for opts, v in zip(per_prompt, values):
            opts[name] = check_logprob_field(name, v)
    return per_prompt
