"""A Hugging Face transformers model read from a GGUF file: the peer in benchmarks and the
reference in tests.

transformers' `from_pretrained(..., gguf_file=...)` insists on `accelerate` being installed
(not a dependency of this project). Without it, the model is built from the same GGUF reader
and dequantizer that `from_pretrained` uses (`load_gguf_checkpoint`); both give identical
weights.
"""

from __future__ import annotations

import os
import warnings

import torch


def load_transformers_gguf(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    try:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    except ValueError as e:
        if "accelerate" not in str(e):
            raise
    warnings.warn(
        "accelerate is not installed, so transformers' from_pretrained(gguf_file=...) refuses "
        "to load; using transformers' load_gguf_checkpoint (the same reader) directly",
        stacklevel=2,
    )
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(
            f"{path}: GGUF tensors do not fit: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    return model.to(dtype)
