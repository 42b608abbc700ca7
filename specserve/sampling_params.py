"""Per-request sampling parameters (SGLang's names), validated once on submission."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from specserve.errors import InvalidArgument, require


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True

    @staticmethod
    def from_any(value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if value is None:
            return SamplingParams()
        if isinstance(value, SamplingParams):
            value.validate()
            return value
        if not isinstance(value, dict):
            raise InvalidArgument("sampling_params", "must be a dict or SamplingParams")
        known = {f.name for f in fields(SamplingParams)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidArgument(
                unknown[0], f"unknown sampling parameter; allowed: {', '.join(sorted(known))}"
            )
        kwargs = dict(value)
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        if kwargs.get("stop") is None:
            kwargs["stop"] = []
        if kwargs.get("stop_token_ids") is None:
            kwargs["stop_token_ids"] = []
        params = SamplingParams(**kwargs)
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def validate(self) -> None:
        def number(name: str, v: Any) -> None:
            require(
                isinstance(v, (int, float)) and not isinstance(v, bool),
                name,
                f"must be a number, got {v!r}",
            )

        number("temperature", self.temperature)
        require(
            self.temperature >= 0.0,
            "temperature",
            f"must be >= 0 (0 = greedy), got {self.temperature}",
        )
        number("top_p", self.top_p)
        require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        require(
            isinstance(self.top_k, int) and not isinstance(self.top_k, bool),
            "top_k",
            f"must be an integer, got {self.top_k!r}",
        )
        require(
            self.top_k == -1 or self.top_k >= 0,
            "top_k",
            f"must be -1 (off) or >= 0, got {self.top_k}",
        )
        number("min_p", self.min_p)
        require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        require(
            isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool),
            "max_new_tokens",
            f"must be an integer, got {self.max_new_tokens!r}",
        )
        require(
            self.max_new_tokens >= 0, "max_new_tokens", f"must be >= 0, got {self.max_new_tokens}"
        )
        require(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a non-empty string or a list of non-empty strings",
        )
        require(
            isinstance(self.stop_token_ids, list)
            and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            ),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        if self.seed is not None:
            require(
                isinstance(self.seed, int)
                and not isinstance(self.seed, bool)
                and 0 <= self.seed < 2**63,
                "seed",
                f"must be an integer in [0, 2**63), got {self.seed!r}",
            )
