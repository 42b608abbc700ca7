"""Per-request sampling parameters (SGLang's names), validated once on submission.

`check_field` is the one validation of a sampling parameter: the offline API
(`SamplingParams.from_any`) and the HTTP server's request models both call it, so a value is
accepted or rejected the same way everywhere. Types are strict: a boolean is not a number,
a float is not an integer, a string or null is not a boolean.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from specserve.errors import InvalidArgument

# Below this a temperature samples greedily (as vLLM): logits / T would overflow float32.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 100.0  # the engine and /generate; the OpenAI routes allow 2, as OpenAI
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024  # each generated token is looked up in this list
INT64_MAX = 2**63 - 1  # integers the engine packs into int64 tensors must fit
MAX_N = 64  # samples per prompt
MAX_TOP_LOGPROBS = 20  # alternatives per position (vLLM's default cap)
MAX_PENALTY = 2.0  # frequency / presence penalties in [-2, 2] (OpenAI's range)
MAX_REPETITION_PENALTY = 2.0  # (0, 2], SGLang's range (1: none)
MAX_LOGIT_BIAS = 100.0  # a bias in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # entries of one request's logit_bias
GRAMMAR_PARAMS = ("json_schema", "regex", "ebnf")  # structured output (SGLang's names)
# the parameters that change the target's draws beside sampling (runtime/penalties.py), and
# the values that leave them as they are
ADJUSTMENT_NEUTRALS = {
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "logit_bias": (None, {}),
    "min_new_tokens": (0,),
    "allowed_token_ids": (None,),
}


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # no stop token (EOS, stop_token_ids) or stop string before this
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    # the text keeps the stop string, or the stopping token's text (vLLM's
    # include_stop_str_in_output)
    no_stop_trim: bool = False
    n: int = 1  # samples of the prompt (the engine runs n requests; sample i uses seed + i)
    speculative: bool = True  # False: decoded plainly, also inside a speculative batch
    # penalties on the output so far (ops/penalties.py; 0, 0 and 1: none) and a bias per
    # token id (added to its logit)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # the only tokens drawn (vLLM's)
    # the prompt cut to its last k tokens once tokenized (vLLM's); -1: to the longest prompt
    # the engine takes
    truncate_prompt_tokens: int | None = None
    # structured output (at most one): the output follows a JSON schema (an object or its
    # text), a regular expression, or an EBNF grammar (runtime/grammar.py)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @staticmethod
    def from_any(
        value: SamplingParams | dict[str, Any] | None, max_temperature: float = MAX_TEMPERATURE
    ) -> SamplingParams:
        if value is None:
            return SamplingParams()
        if isinstance(value, SamplingParams):
            # a copy: the caller may change or reuse its object once it has been submitted,
            # which must not reach the requests already made from it (validate rebuilds
            # every list and dict field, so a shallow copy shares none of them)
            value = copy.copy(value)
            value.validate(max_temperature)
            return value
        if not isinstance(value, dict):
            raise InvalidArgument(
                "sampling_params", f"must be a dict or SamplingParams, got {type(value).__name__}"
            )
        kwargs = {name: check_field(name, v, max_temperature) for name, v in value.items()}
        params = SamplingParams(**kwargs)
        params._check_one_grammar()
        params._check_lengths()
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a logit bias or a minimum length changes this request's
        draws."""
        return any(
            getattr(self, name) not in neutral for name, neutral in ADJUSTMENT_NEUTRALS.items()
        )

    def validate(self, max_temperature: float = MAX_TEMPERATURE) -> None:
        """Check every field (and normalize: a tiny temperature becomes 0, i.e. greedy)."""
        for f in fields(self):
            setattr(self, f.name, check_field(f.name, getattr(self, f.name), max_temperature))
        self._check_one_grammar()
        self._check_lengths()

    def _check_lengths(self) -> None:
        grammar = next((n for n in GRAMMAR_PARAMS if getattr(self, n) is not None), None)
        if self.min_new_tokens and grammar is not None:
            # (a grammar complete before it would leave no token to draw: EOS held back, and
            # nothing else allowed. The grammar's field is not named: a server request may
            # have set it by another name, e.g. response_format)
            raise InvalidArgument(
                "min_new_tokens", "cannot be combined with structured output: only 0"
            )
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidArgument(
                "min_new_tokens",
                f"must be at most max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}",
            )

    def _check_one_grammar(self) -> None:
        given = [n for n in GRAMMAR_PARAMS if getattr(self, n) is not None]
        if len(given) > 1:
            raise InvalidArgument(
                given[1], f"structured output takes one of {', '.join(GRAMMAR_PARAMS)}; got {given}"
            )


# ---- the checks ---------------------------------------------------------------------------------
def is_int(v: Any) -> bool:
    """An integer, and not a bool (JSON's true is no count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> float | None:
    """A number as a finite float; None for anything else (an integer past a float's range
    too: math.isfinite raises on it)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _number(name: str, v: Any) -> float:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
        raise InvalidArgument(name, f"must be a number, got {short(v)}")
    x = _finite(v)
    if x is None:
        shown = v if isinstance(v, float) else "an integer past a float's range"
        raise InvalidArgument(name, f"must be a finite number, got {shown}")
    return x


def _integer(name: str, v: Any, low: int, allowed: str) -> int:
    if not is_int(v):
        raise InvalidArgument(name, f"must be an integer, got {short(v)}")
    if not low <= v <= INT64_MAX:
        raise InvalidArgument(name, f"must be {allowed}, got {v}")
    return v


def _boolean(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgument(name, f"must be true or false, got {short(v)}")
    return v


def _temperature(v: Any, max_temperature: float) -> float:
    t = _number("temperature", v)
    if not 0.0 <= t <= max_temperature:
        raise InvalidArgument(
            "temperature", f"must be in [0, {max_temperature:g}] (0 = greedy), got {short(v)}"
        )
    return 0.0 if t < GREEDY_BELOW else t


def _top_p(v: Any) -> float:
    p = _number("top_p", v)
    if not 0.0 < p <= 1.0:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {short(v)}")
    return p


def _min_p(v: Any) -> float:
    p = _number("min_p", v)
    if not 0.0 <= p <= 1.0:
        raise InvalidArgument("min_p", f"must be in [0, 1], got {short(v)}")
    return p


def _top_k(v: Any) -> int:
    return _integer("top_k", v, -1, "-1 or 0 (no limit) or a positive integer below 2**63")


def _max_new_tokens(v: Any) -> int:
    return _integer("max_new_tokens", v, 0, "an integer in [0, 2**63)")


def noise_seed(seed: int) -> int:
    """The 32-bit seed the sampler's noise uses (ops/sampling.py keeps a seed's low 32 bits)
    for a seed in [0, 2**63): the low bits XOR an odd multiple of the high ones, so seeds that
    differ only above bit 32 (`run << 32 | trial`, or -1 beside 2**32 - 1) draw differently;
    one below 2**32 is its own (the outputs recorded with it stay the same)."""
    return (seed ^ ((seed >> 32) * 0x9E3779B1)) & 0xFFFFFFFF


def _seed(v: Any) -> int | None:
    # (negative seeds too, as vLLM and OpenAI's API take them: -1 is a common "some seed";
    # the engine draws with the seed modulo 2**63)
    return (
        None
        if v is None
        else _integer("seed", v, -(2**63), "an integer in [-2**63, 2**63) or null")
    )


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    if len(v) > MAX_STOP_STRINGS:
        raise InvalidArgument(
            "stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(v)}"
        )
    for s in v:
        if not s:
            raise InvalidArgument("stop", "stop strings must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(
                "stop", f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(s)}"
            )
    return list(v)


def _token_ids(name: str, v: Any, what: str = "a list") -> list[int]:
    if not isinstance(v, list) or not all(is_int(t) and 0 <= t <= INT64_MAX for t in v):
        raise InvalidArgument(name, f"must be {what} of non-negative integer token ids")
    return list(v)


def _stop_token_ids(v: Any) -> list[int]:
    if v is None:
        return []
    v = _token_ids("stop_token_ids", v)
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids are allowed, got {len(v)}"
        )
    return list(v)


def _n(v: Any) -> int:
    n = _integer("n", v, 1, f"an integer in [1, {MAX_N}]")
    if n > MAX_N:
        raise InvalidArgument("n", f"must be an integer in [1, {MAX_N}], got {n}")
    return n


def _penalty(name: str, v: Any) -> float:
    x = _number(name, v)
    if not -MAX_PENALTY <= x <= MAX_PENALTY:
        raise InvalidArgument(
            name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {short(v)}"
        )
    return x


def _repetition_penalty(v: Any) -> float:
    x = _number("repetition_penalty", v)
    if not 0.0 < x <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(
            "repetition_penalty",
            f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1: no penalty), got {short(v)}",
        )
    return x


def _logit_bias(v: Any) -> dict[int, float] | None:
    """Token id -> bias; ids may come as strings of digits (JSON object keys, as OpenAI's
    API sends them)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise InvalidArgument(
            "logit_bias", f"must be an object of token id -> bias, got {short(v)}"
        )
    if len(v) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidArgument(
            "logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} token ids are allowed, got {len(v)}"
        )
    out = {}
    for key, bias in v.items():
        # (digits past int64's length stay a string, refused below: int() refuses thousands)
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 20
        token = int(key) if digits else key
        if not is_int(token) or not 0 <= token <= INT64_MAX:
            raise InvalidArgument(
                "logit_bias", f"keys must be non-negative integer token ids, got {short(key)}"
            )
        x = _finite(bias)
        if x is None or not -MAX_LOGIT_BIAS <= x <= MAX_LOGIT_BIAS:
            huge = x is None and is_int(bias)
            shown = "an integer past a float's range" if huge else short(bias)
            raise InvalidArgument(
                "logit_bias",
                f"the bias of token {token} must be a number in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {shown}",
            )
        if token in out:  # ("5" and "05": one token twice, whose bias would be lost)
            raise InvalidArgument("logit_bias", f"token {token} is given twice, as {short(key)}")
        out[token] = x
    return out or None


def _allowed_token_ids(v: Any) -> list[int] | None:
    if v is None:
        return None
    what = "a non-empty list"
    if not v:
        raise InvalidArgument("allowed_token_ids", f"must be {what} of token ids, got []")
    return _token_ids("allowed_token_ids", v, what)


def _truncate_prompt_tokens(v: Any) -> int | None:
    if v is None:
        return None
    if not is_int(v) or not (v == -1 or 1 <= v <= INT64_MAX):
        raise InvalidArgument(
            "truncate_prompt_tokens",
            f"must be null, -1 (the longest prompt the engine takes) or an integer >= 1, "
            f"got {short(v)}",
        )
    return v


def _json_schema(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):
        try:
            return json.dumps(v, allow_nan=False)  # (NaN and Infinity are no JSON)
        except (TypeError, ValueError) as e:
            raise InvalidArgument("json_schema", f"is not JSON-serializable: {e}") from None
        except RecursionError:  # (nested past what Python's stack holds)
            raise InvalidArgument("json_schema", "is nested too deeply to be serialized") from None
    if not isinstance(v, str) or not v.strip():
        raise InvalidArgument("json_schema", "must be a JSON schema: an object or its JSON text")
    return v


def _grammar_text(name: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise InvalidArgument(name, f"must be a non-empty string, got {short(v)}")
    return v


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "json_schema": _json_schema,
    "regex": lambda v: _grammar_text("regex", v),
    "ebnf": lambda v: _grammar_text("ebnf", v),
    "top_p": _top_p,
    "top_k": _top_k,
    "min_p": _min_p,
    "max_new_tokens": _max_new_tokens,
    "min_new_tokens": lambda v: _integer("min_new_tokens", v, 0, "an integer in [0, 2**63)"),
    "stop": _stop,
    "stop_token_ids": _stop_token_ids,
    "ignore_eos": lambda v: _boolean("ignore_eos", v),
    "seed": _seed,
    "skip_special_tokens": lambda v: _boolean("skip_special_tokens", v),
    "no_stop_trim": lambda v: _boolean("no_stop_trim", v),
    "n": _n,
    "speculative": lambda v: _boolean("speculative", v),
    "frequency_penalty": lambda v: _penalty("frequency_penalty", v),
    "presence_penalty": lambda v: _penalty("presence_penalty", v),
    "repetition_penalty": _repetition_penalty,
    "logit_bias": _logit_bias,
    "allowed_token_ids": _allowed_token_ids,
    "truncate_prompt_tokens": _truncate_prompt_tokens,
}
FIELDS = tuple(f.name for f in fields(SamplingParams))


def check_field(name: Any, value: Any, max_temperature: float = MAX_TEMPERATURE) -> Any:
    """The validated (normalized) value of one sampling parameter; InvalidArgument naming
    the field otherwise."""
    if name == "temperature":
        return _temperature(value, max_temperature)
    check = _CHECKS.get(name) if isinstance(name, str) else None
    if check is None:
        raise InvalidArgument(
            str(name), f"unknown sampling parameter; allowed: {', '.join(sorted(FIELDS))}"
        )
    return check(value)


def short(value: Any, limit: int = 60) -> str:
    """`value`'s repr, cut to `limit` characters (an error quotes what it refuses)."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


# ---- log-probability options (request-level, SGLang's names; not sampling parameters) ----------
def _top_logprobs_num(v: Any) -> int:
    k = _integer("top_logprobs_num", v, 0, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    if k > MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            "top_logprobs_num", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k}"
        )
    return k


def _logprob_start_len(v: Any) -> int:
    allowed = "-1 (no prompt positions) or a prompt position >= 0"
    if not is_int(v):
        raise InvalidArgument("logprob_start_len", f"must be an integer, {allowed}; got {short(v)}")
    if not -1 <= v <= INT64_MAX:
        raise InvalidArgument("logprob_start_len", f"must be {allowed}, got {v}")
    return v


_LOGPROB_CHECKS: dict[str, Callable[[Any], Any]] = {
    "return_logprob": lambda v: _boolean("return_logprob", v),
    "top_logprobs_num": _top_logprobs_num,
    "logprob_start_len": _logprob_start_len,
    "return_text_in_logprobs": lambda v: _boolean("return_text_in_logprobs", v),
}
LOGPROB_FIELDS = tuple(_LOGPROB_CHECKS)


def check_logprob_field(name: str, value: Any) -> Any:
    """The validated value of one log-probability option (`Engine.generate` and /generate
    take them beside the sampling parameters); InvalidArgument naming the field otherwise."""
    check = _LOGPROB_CHECKS.get(name)
    if check is None:
        raise InvalidArgument(
            name, f"unknown log-probability option; allowed: {', '.join(LOGPROB_FIELDS)}"
        )
    return check(value)
