"""Every engine knob in one dataclass, validated and resolved in one place.

`EngineConfig.resolve()` returns a new, frozen configuration in which every "auto" value
is decided, plus the list of decisions with their reasons (logged at start-up and shown
by `Engine.resolved_args()`). Invalid values and combinations raise `InvalidArgument`
naming the field and the allowed values. Nothing is mutated after resolution.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from specserve.config.environment import triton_interpreting
from specserve.config.kernels import Kernels, resolve_kernels
from specserve.config.speculative import (
    resolve_bundled_draft,
    resolve_simulation,
    resolve_speculative,
)
from specserve.errors import InvalidArgument, require
from specserve.model.registry import DEFAULT_MODEL

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "float16", "bfloat16")
# SGLang's and vLLM's other spellings of them
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_GRAPH_PREFILL_TOKENS = 512
# Each running request holds a row of device tables (sampling, page table, draft state),
# allocated as requests arrive; a bound keeps a typo from asking for terabytes.
MAX_RUNNING_REQUESTS = 1 << 16
_CUDA_INDEX = re.compile(r"cuda:\d{1,4}")
SEED_MAX = 2**63 - 1  # torch generators take a signed 64-bit seed


@dataclass(frozen=True)
class EngineConfig:
    model_path: str = DEFAULT_MODEL
    tokenizer_path: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 1
    tp_size: int = 1  # tensor parallelism: one process per rank (per GPU on CUDA)
    max_total_tokens: int | None = None  # KV slots; auto from memory
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None  # tokens per prefill batch; -1 disables chunking
    context_length: int | None = None
    skip_tokenizer_init: bool = False
    attention_backend: str = "auto"
    random_seed: int = 0
    mem_fraction_static: float = 0.85  # CUDA: share of the device memory for weights + KV
    debug_check_invariants: bool = False  # walk the KV ownership after every step (tests)
    disable_overlap_schedule: bool = False  # overlap: launch step k+1 before applying step k
    disable_cuda_graph: bool = False  # CUDA: replay decode steps from captured graphs
    cuda_graph_max_bs: int | None = None  # largest captured batch size (eager above it)
    cuda_graph_max_prefill_tokens: int | None = None  # one-chunk prefills replayed up to this
    disable_fused_kernels: bool = False  # the torch reference ops everywhere (debugging)
    disable_radix_cache: bool = False  # no prefix cache: every prompt is prefilled whole
    # CUDA: batch-invariant kernels, so a request's output is the same alone, in any batch, and
    # with or without speculation (SGLang's name); off by default: it costs a third to a half
    # of decode throughput on an H200 (config/kernels.py)
    enable_deterministic_inference: bool = False
    kernels: Kernels | None = None  # decided by resolve(); tests and benches may pass their own
    # speculative decoding (SGLang's names)
    no_default_draft: bool = False  # a packaged model's bundled draft stays off
    speculative_adaptive: bool = False  # each step drafts the tree shape that pays (or none)
    # adaptive: plain steps may skip the draft for this many tokens per request before it
    # must catch up (0: the draft runs every step); None: decided by resolve()
    speculative_adaptive_lag_tokens: int | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_token_map: str | None = None  # EAGLE: draft only among these tokens (a file)
    speculative_token_map_growth: int | None = None  # + room for the requests' own tokens
    # simulated acceptance (benchmarking); unset fields fall back to SPECSERVE_SIMULATE_ACC_*
    simulate_acc_len: float | None = None
    simulate_acc_method: str | None = None  # multinomial | match-expected | per-position
    simulate_acc_token_mode: str | None = None  # real-draft-token | fixed
    simulate_acc_fixed_token: int | None = None
    simulate_acc_rates: str | None = None  # per-position: comma-separated rates per depth
    log_level: str = "warning"
    # filled by resolve(): (field, value, reason)
    decisions: tuple[tuple[str, Any, str], ...] = field(default=(), compare=False)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "decisions"]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = set(cls.field_names())
        for k in kwargs:
            if k not in known:
                raise InvalidArgument(
                    k, f"unknown engine argument; allowed: {', '.join(sorted(known))}"
                )
        return cls(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.kernels is not None:
            d["kernels"] = self.kernels.as_dict()
        d["decisions"] = [{"field": f, "value": v, "reason": r} for f, v, r in self.decisions]
        return d

    # ------------------------------------------------------------------------------------
    def resolve(self, cuda_available: bool | None = None) -> EngineConfig:
        import torch

        if cuda_available is None:
            cuda_available = torch.cuda.is_available()
        decided: list[tuple[str, Any, str]] = []
        c = self

        def decide(name: str, value: Any, reason: str) -> None:
            nonlocal c
            c = replace(c, **{name: value})
            decided.append((name, value, reason))

        _check_types(c)
        if isinstance(c.dtype, str) and c.dtype in DTYPE_ALIASES:
            decide("dtype", DTYPE_ALIASES[c.dtype], f"{c.dtype!r} is SGLang's name for it")
        _check_choice("dtype", c.dtype, (*DTYPES, *DTYPE_ALIASES))
        _check_choice("attention_backend", c.attention_backend, ATTENTION_BACKENDS)
        if isinstance(c.log_level, str) and c.log_level != c.log_level.lower():
            decide("log_level", c.log_level.lower(), "log levels are read in any case")
        _check_choice("log_level", c.log_level, LOG_LEVELS)
        _check_int("page_size", c.page_size, minimum=1)
        for name in ("max_total_tokens", "max_running_requests"):
            if getattr(c, name) is not None:
                _check_int(name, getattr(c, name), minimum=1)
        if c.context_length is not None:  # (a prompt's token and the one it is answered with)
            _check_int("context_length", c.context_length, minimum=2)
        if c.max_running_requests is not None:
            _check_int(
                "max_running_requests", c.max_running_requests, 1, maximum=MAX_RUNNING_REQUESTS
            )
        _check_int("random_seed", c.random_seed, minimum=0, maximum=SEED_MAX)
        if c.chunked_prefill_size is not None:
            _check_int("chunked_prefill_size", c.chunked_prefill_size, minimum=-1)
            require(
                c.chunked_prefill_size != 0,
                "chunked_prefill_size",
                "must be >= 1, or -1 to disable chunking",
            )
        require(
            _is_real(c.mem_fraction_static) and 0.0 < c.mem_fraction_static < 1.0,
            "mem_fraction_static",
            f"must be a number in (0, 1), got {c.mem_fraction_static!r}",
        )
        _check_int("tp_size", c.tp_size, minimum=1)

        if c.device == "auto":
            decide(
                "device",
                "cuda" if cuda_available else "cpu",
                "CUDA is available" if cuda_available else "no CUDA device",
            )
        require(
            c.device in ("cpu", "cuda") or _CUDA_INDEX.fullmatch(c.device) is not None,
            "device",
            f"{c.device!r} is not one of auto, cpu, cuda, cuda:N",
        )
        if c.device.startswith("cuda") and not cuda_available:
            raise InvalidArgument("device", f"{c.device!r} requested but CUDA is not available")
        count = _cuda_device_count()
        if c.device.startswith("cuda:") and count is not None and int(c.device[5:]) >= count:
            raise InvalidArgument(
                "device",
                f"{c.device!r}: this machine's CUDA devices are cuda:0 to cuda:{count - 1}",
            )
        on_gpu = c.device.startswith("cuda")
        _resolve_tp_size(c, on_gpu, decided)
        if c.dtype == "auto":
            decide(
                "dtype",
                "bfloat16" if on_gpu else "float32",
                "bf16 on GPU" if on_gpu else "float32 on CPU (no fast bf16 matmul)",
            )
        if c.attention_backend == "auto":
            if on_gpu and _triton_available():
                decide("attention_backend", "triton", "CUDA device and Triton importable")
            else:
                reason = "no CUDA device" if not on_gpu else "Triton is not installed"
                decide("attention_backend", "torch", f"{reason}: the torch reference backend")
        elif c.attention_backend == "triton":
            require(
                _triton_available(),
                "attention_backend",
                "'triton' needs Triton installed; use 'torch' or 'auto'",
            )
            # Triton compiles for a GPU; on a CPU its kernels run only in its interpreter
            # (how the test suite checks them), which is Triton's own setting
            require(
                on_gpu or triton_interpreting(),
                "attention_backend",
                "'triton' on a CPU runs only under Triton's interpreter (TRITON_INTERPRET=1 "
                "set before triton is imported); use 'torch' or 'auto' on a CPU",
            )
        if c.max_running_requests is None:
            decide("max_running_requests", 256 if on_gpu else 64, "default for the device")
        if c.chunked_prefill_size is None:
            decide("chunked_prefill_size", 8192 if on_gpu else 2048, "default for the device")
        for resolve_part in (
            lambda c: resolve_bundled_draft(c, on_gpu),
            resolve_speculative,
            resolve_simulation,
        ):
            c, part_decisions = resolve_part(c)
            decided.extend(part_decisions)
        if c.enable_deterministic_inference and on_gpu:
            require(
                not c.disable_fused_kernels,
                "enable_deterministic_inference",
                "needs the fused kernels on CUDA (not disable_fused_kernels): the torch "
                "reference ops are not batch-invariant there",
            )
            require(
                c.attention_backend == "triton",
                "enable_deterministic_inference",
                f"needs attention_backend 'triton' on CUDA, not {c.attention_backend!r}",
            )
        if c.kernels is None:
            kernels, kernel_decisions = resolve_kernels(
                on_gpu,
                c.dtype in ("float16", "bfloat16"),
                _triton_available(),
                c.disable_fused_kernels,
                _torch_version(),
                deterministic=c.enable_deterministic_inference,
                gpu_name=_gpu_name(c.device) if on_gpu else "",
                tp_size=c.tp_size,
            )
            c = replace(c, kernels=kernels)
            decided.extend(kernel_decisions)
        else:
            require(isinstance(c.kernels, Kernels), "kernels", "must be a Kernels object")
            decided.append(("kernels", "given", "passed by the caller"))
        _resolve_cuda_graph(c, on_gpu, decide)  # decide() updates c
        decided.append(
            (
                "disable_radix_cache",
                c.disable_radix_cache,
                "requested: every prompt is prefilled whole"
                if c.disable_radix_cache
                else "prefix cache on: a request reuses the KV pages of its longest cached "
                "prefix (draft KV included, exact)",
            )
        )
        if c.disable_overlap_schedule:
            decided.append(
                (
                    "disable_overlap_schedule",
                    True,
                    "requested: each step is applied before the next is launched",
                )
            )
        else:
            why = (
                "the host schedules step k+1 while the GPU runs step k"
                if on_gpu
                else "on by default; on CPU device work is synchronous, so it only reorders host work"
            )
            decided.append(
                (
                    "disable_overlap_schedule",
                    False,
                    f"overlap on for plain and speculative decoding, every topk and page size: {why}",
                )
            )
        return replace(c, decisions=tuple(decided))

    def with_startup_decisions(self, decided: list[tuple[str, Any, str]]) -> EngineConfig:
        """This configuration with the values decided once the model is loaded and the device
        measured (they replace what was asked for; the reasons say how)."""
        for name, value, reason in decided:
            log.info("config: %s = %r (%s)", name, value, reason)
        values = {name: value for name, value, _ in decided}
        return replace(self, **values, decisions=self.decisions + tuple(decided))

    def draft_summary(self) -> str:
        """One line: which draft runs and why (a packaged model's bundled draft, or none)."""
        why = next((r for f, _, r in self.decisions if f == "speculative_draft_model_path"), None)
        if self.speculative_algorithm is None:
            return "plain decoding" + (f" ({why})" if why else "")
        what = (
            f"{self.speculative_algorithm} draft {self.speculative_draft_model_path} "
            f"({self.speculative_num_steps} steps, topk {self.speculative_eagle_topk}, "
            f"{self.speculative_num_draft_tokens} draft tokens)"
        )
        return what + (f": {why}" if why else "")

    def log_decisions(self) -> None:
        for name, value, reason in self.decisions:
            log.info("config: %s = %r (%s)", name, value, reason)


def _resolve_cuda_graph(c: EngineConfig, on_gpu: bool, decide) -> None:
    if c.cuda_graph_max_bs is not None:
        _check_int("cuda_graph_max_bs", c.cuda_graph_max_bs, minimum=1)
    if c.cuda_graph_max_prefill_tokens is not None:
        _check_int("cuda_graph_max_prefill_tokens", c.cuda_graph_max_prefill_tokens, minimum=0)
    off = None
    if c.disable_cuda_graph:
        off = "requested: decode steps run eagerly"
    elif not on_gpu:
        off = "no CUDA device: decode steps run eagerly"
    elif c.attention_backend != "triton":
        off = "the torch attention backend sizes its work from host lists; graphs need triton"
    if off is not None:
        decide("disable_cuda_graph", True, off)
        decide("cuda_graph_max_prefill_tokens", 0, "CUDA graphs are off: prefills run eagerly")
        return
    decide(
        "disable_cuda_graph",
        False,
        "CUDA: each decode step (draft, verify, accept, KV compaction, draft extend) is "
        "captured once per padded batch size, context bucket and sampling mode, then "
        "replayed; every batch size's greedy and plain sampled step (and every short prefill "
        "length's forward) at the shortest context before the first request, so their kernels "
        "compile at start, not in a request's time (adaptive speculation times every tier's "
        "greedy step instead; tensor-parallel ranks capture as steps meet shapes)",
    )
    if c.cuda_graph_max_bs is None:
        decide(
            "cuda_graph_max_bs",
            min(c.max_running_requests, 256),
            "max_running_requests, at most 256 (larger batches run eagerly)",
        )
    if c.cuda_graph_max_prefill_tokens is None:
        decide(
            "cuda_graph_max_prefill_tokens",
            DEFAULT_GRAPH_PREFILL_TOKENS,
            "a prefill of one request's chunk up to this many tokens replays a captured forward "
            "(a short prompt's eager prefill is bound by kernel launches); 0 turns this off",
        )


def _resolve_tp_size(c: EngineConfig, on_gpu: bool, decided: list) -> None:
    """The process layout; whether the model's heads and MLP divide by tp_size is checked
    once its shape is read (model/sharding.py), before any rank starts."""
    if c.tp_size == 1:
        decided.append(("tp_size", 1, "one process, no collectives"))
        return
    if on_gpu:
        import torch

        gpus = torch.cuda.device_count()
        require(
            c.tp_size <= gpus,
            "tp_size",
            f"{c.tp_size} ranks need as many GPUs; {gpus} visible (allowed: 1..{gpus})",
        )
        require(
            c.device in ("cuda", "cuda:0"),
            "device",
            f"with tp_size > 1 rank r runs on cuda:r; give 'cuda', got {c.device!r}",
        )
        why = f"one process per GPU (cuda:0..cuda:{c.tp_size - 1}), NCCL collectives"
    else:
        why = "one process per rank on the CPU, gloo collectives (float32 tests)"
    decided.append(("tp_size", c.tp_size, why))


def _triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    require(value in allowed, name, f"{value!r} is not one of {', '.join(map(str, allowed))}")


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    what = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    require(
        is_int and value >= minimum and (maximum is None or value <= maximum),
        name,
        f"must be an integer {what}, got {value!r}",
    )


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_types(c: EngineConfig) -> None:
    """Fields whose values are used as given: a wrong type would fail deep inside the engine
    or, for a flag given as the string "false", silently read as true."""
    for f in fields(c):
        if isinstance(f.default, bool):
            value = getattr(c, f.name)
            require(isinstance(value, bool), f.name, f"must be true or false, got {value!r}")
    require(
        isinstance(c.model_path, str) and c.model_path != "",
        "model_path",
        f"must be a packaged model name, a .gguf file or a model folder, got {c.model_path!r}",
    )
    for name in ("tokenizer_path", "speculative_draft_model_path", "speculative_token_map"):
        value = getattr(c, name)
        require(
            value is None or (isinstance(value, str) and value != ""),
            name,
            f"must be a path, got {value!r}",
        )
    require(
        isinstance(c.device, str),
        "device",
        f"must be one of auto, cpu, cuda, cuda:N, got {c.device!r}",
    )


def _cuda_device_count() -> int | None:
    """CUDA devices this process sees (None: none, where a caller forced cuda_available)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def _gpu_name(device: str) -> str:
    import torch

    if not torch.cuda.is_available():  # (a caller forcing cuda_available: a test)
        return ""
    return torch.cuda.get_device_name(torch.device(device))


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)
