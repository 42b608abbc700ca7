"""Load a target model from a packaged name, a GGUF file, an HF folder, or random weights."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError

from specserve.errors import InvalidArgument
from specserve.model.config import PRESETS, ModelConfig
from specserve.model.gguf_loader import gguf_has_tokenizer, iter_gguf_weights, load_gguf_config
from specserve.model.hf_loader import iter_safetensors, load_hf_config
from specserve.model.llama import LlamaForCausalLM
from specserve.model.registry import packaged_model_names, resolve_packaged
from specserve.model.tokenizer import has_tokenizer_files, load_tokenizer, tokenizer_files

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


@dataclass
class ModelSource:
    path: str  # file, folder or preset name
    kind: str  # 'gguf' | 'hf' | 'preset'


def locate(model_path: str, load_format: str, field: str = "model_path") -> ModelSource:
    """field: the user's argument that named this path (errors point at it)."""
    if load_format not in LOAD_FORMATS:
        raise InvalidArgument(
            "load_format", f"{load_format!r} is not one of {', '.join(LOAD_FORMATS)}"
        )
    if load_format == "dummy" and model_path.lower() in PRESETS:
        return ModelSource(model_path.lower(), "preset")
    packaged = resolve_packaged(model_path)
    if packaged is not None:
        if load_format == "dummy":
            return ModelSource(model_path.lower(), "preset")
        return ModelSource(packaged, "gguf")
    src = None
    if os.path.isfile(model_path) and model_path.lower().endswith(".gguf"):
        src = ModelSource(model_path, "gguf")
    elif os.path.isdir(model_path):
        src = ModelSource(model_path, "hf")
    if src is not None:
        expected = {"gguf": "gguf", "hf": "safetensors"}[src.kind]
        if load_format not in ("auto", "dummy", expected):
            raise InvalidArgument(
                "load_format",
                f"{load_format!r} does not match {model_path!r}, which is read as "
                f"{expected} (allowed: auto, {expected}, dummy)",
            )
        return src
    allowed = packaged_model_names() + [f"{p} (with load_format='dummy')" for p in PRESETS]
    raise InvalidArgument(
        field,
        f"{model_path!r} is not a .gguf file, a model folder, or a known name; known names: {', '.join(allowed)}",
    )


def read_config(src: ModelSource) -> ModelConfig:
    if src.kind == "gguf":
        return load_gguf_config(src.path)
    if src.kind == "hf":
        return load_hf_config(src.path)
    return PRESETS[src.path]


def random_weights(model: torch.nn.Module, seed: int, device=None):
    """(name, float32 tensor) for each parameter of `model`, in order: N(0, 0.02) weights,
    unit norms, zero biases, generated on `device` (default: the parameter's; an 8B-shaped
    model initialises in seconds on a GPU). The same seed gives the same weights on the same
    device type."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        dev = p.device if device is None else torch.device(device)
        if name.endswith("norm.weight"):
            yield name, torch.ones(p.shape, device=dev)
        elif p.dim() == 1:
            yield name, torch.zeros(p.shape, device=dev)
        else:
            g = gens.setdefault(dev, torch.Generator(device=dev).manual_seed(seed))
            t = torch.empty(p.shape, dtype=torch.float32, device=dev)
            yield name, t.normal_(0.0, 0.02, generator=g)


def random_init_(model: torch.nn.Module, seed: int) -> None:
    """`random_weights` into the model's parameters."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in random_weights(model, seed):
            params[name].copy_(t)


def build_model(
    cfg: ModelConfig,
    src: ModelSource,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    tp=None,
) -> torch.nn.Module:
    """tp: a TensorParallel handle: this rank's shard (model/sharding.py)."""
    shard = None
    with torch.device("meta"):
        if tp is None:
            model = LlamaForCausalLM(cfg)
        else:
            from specserve.model.sharding import CheckpointShard, ShardedLlamaForCausalLM

            model = ShardedLlamaForCausalLM(cfg, tp)
            shard = CheckpointShard(cfg, tp)
    # (cast on the meta device, then allocated once in `dtype`; RotaryEmbedding recomputes its
    # float32 frequencies on the new device itself)
    model = model.to(dtype)
    try:
        model = model.to_empty(device=device)
    except RuntimeError as e:  # (torch.OutOfMemoryError on CUDA, the CPU allocator's error)
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        count = sum(p.numel() for p in model.parameters())
        size = count * dtype.itemsize / 2**30
        whose = "its config's shape" if tp is None else "this rank's shard of its config's shape"
        raise ValueError(
            f"{whose} has {count:,} parameters ({size:,.1f} GiB in "
            f"{str(dtype).removeprefix('torch.')}), more than {device} could allocate"
        ) from None
    if load_format == "dummy" or src.kind == "preset":
        if shard is None:
            random_init_(model, seed)
        else:  # the unsharded model's weights, this rank's slices of them
            model.load_weights(shard.random_weights(seed, device))
    elif src.kind == "gguf":
        model.load_weights(iter_gguf_weights(src.path, cfg, shard=shard))
    else:
        model.load_weights(iter_safetensors(src.path, shard))
    return model.eval().requires_grad_(False)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: object | None
    source: ModelSource


def load_model(
    model_path: str,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    skip_tokenizer_init: bool = False,
    tokenizer_path: str | None = None,
    seed: int = 0,
    tp=None,
    field: str = "model_path",
) -> LoadedModel:
    """tp: a TensorParallel handle: load this rank's shard of the model. field: the user's
    argument that named `model_path`; a path that cannot be read as a model raises
    InvalidArgument naming it."""
    src = locate(model_path, load_format, field)
    try:
        cfg = read_config(src)
        model = build_model(cfg, src, load_format, dtype, device, seed, tp)
    except InvalidArgument:
        raise
    except _UNREADABLE as e:
        raise _cannot_load(field, model_path, e) from e
    tokenizer = None if skip_tokenizer_init else _load_tokenizer(src, tokenizer_path, field)
    return LoadedModel(model, cfg, tokenizer, src)


def read_model_config(model_path: str, load_format: str, field: str = "model_path"):
    """The model's config alone (e.g. its shape, checked before tensor-parallel ranks start),
    refused as `load_model` refuses a model it cannot read."""
    try:
        return read_config(locate(model_path, load_format, field))
    except InvalidArgument:
        raise
    except _UNREADABLE as e:
        raise _cannot_load(field, model_path, e) from e


def _cannot_load(field: str, model_path: str, e: Exception) -> InvalidArgument:
    return InvalidArgument(field, f"{model_path!r} cannot be loaded: {e}")


# what reading a malformed or unsupported checkpoint raises (json, struct, safetensors, the
# weight loader's checks)
_UNREADABLE = (ValueError, KeyError, OSError, EOFError, SafetensorError)


def _tokenizer_faults() -> tuple[type[BaseException], ...]:
    """What transformers and tokenizers raise on malformed tokenizer files, beyond
    _UNREADABLE: TypeError (merges of the wrong form, from the Rust binding), AttributeError
    (a tokenizer_config.json that is not an object), IndexError (a special id past the GGUF
    token list), huggingface_hub's StrictDataclassError (config.json fields of the wrong
    type). Caught around the tokenizer's construction only; the original stays chained."""
    faults = (*_UNREADABLE, TypeError, AttributeError, IndexError)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # (older huggingface_hub)
        return faults
    return (*faults, StrictDataclassError)


def _tokenizer_error(field: str, path: str, kind: str, e: BaseException) -> InvalidArgument:
    if kind == "gguf":
        files = "tokenizer.ggml.* metadata"
    else:
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        files = f"tokenizer files ({', '.join(tokenizer_files(folder)) or 'none found'})"
    return InvalidArgument(
        field, f"{path!r}: its {files} cannot be read as a tokenizer ({type(e).__name__}: {e})"
    )


def _load_tokenizer(src: ModelSource, tokenizer_path: str | None, field: str):
    faults = _tokenizer_faults()
    if tokenizer_path:
        if not os.path.exists(tokenizer_path):
            raise InvalidArgument(
                "tokenizer_path", f"{tokenizer_path!r} is neither a .gguf file nor a folder"
            )
        kind = "gguf" if tokenizer_path.lower().endswith(".gguf") else "hf"
        try:
            return load_tokenizer(tokenizer_path, kind)
        except faults as e:
            raise _tokenizer_error("tokenizer_path", tokenizer_path, kind, e) from e
    if src.kind == "gguf":
        try:
            return load_tokenizer(src.path, "gguf")
        except faults as e:
            if not gguf_has_tokenizer(src.path):  # (asked only then: it parses the header)
                log.warning("%s holds no tokenizer: token ids only", src.path)
                return None
            raise _tokenizer_error(field, src.path, "gguf", e) from e
    if src.kind == "hf" and has_tokenizer_files(src.path):
        try:
            return load_tokenizer(src.path, "hf")
        except faults as e:
            raise _tokenizer_error(field, src.path, "hf", e) from e
    if src.kind == "preset" and src.path in ("smollm2-135m", "smollm2-135m-instruct"):
        try:  # the real model's tokenizer, when its package is installed
            packaged = resolve_packaged(src.path)
            return load_tokenizer(packaged, "gguf") if packaged else None
        except FileNotFoundError:
            log.warning("%s: package not installed, token ids only", src.path)
            return None
    log.warning("no tokenizer found for %s: token ids only (as with skip_tokenizer_init)", src.path)
    return None
