"""The one module of the package that reads the environment.

Only aliases of engine arguments live here: `SPECSERVE_SIMULATE_ACC_*` for the simulated-
acceptance fields (as SGLang's `SGLANG_SIMULATE_ACC_*`), so a benchmark harness can force
acceptance lengths without changing its command line. An explicit argument always wins.
Besides them, one fact the resolver checks: whether Triton runs its interpreter; and one
credential, `OPENAI_API_KEY`, which `bench serving` sends when no `--api-key` is given (as
`vllm bench serve` does).
"""

from __future__ import annotations

import os

SIMULATE_FIELDS = (
    "simulate_acc_len",
    "simulate_acc_method",
    "simulate_acc_token_mode",
    "simulate_acc_fixed_token",
    "simulate_acc_rates",
)


def simulate_acc_aliases() -> dict[str, str]:
    """{field: value} of the simulated-acceptance aliases that are set."""
    out = {}
    for name in SIMULATE_FIELDS:
        value = os.environ.get("SPECSERVE_" + name.upper())
        if value is not None:
            out[name] = value
    return out


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (its own setting, TRITON_INTERPRET):
    the only way its kernels run on a CPU."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def openai_api_key() -> str | None:
    """The API key a benchmark client sends when given none (OPENAI_API_KEY; unset or empty:
    none)."""
    return os.environ.get("OPENAI_API_KEY") or None
