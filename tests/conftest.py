"""Without CUDA, Triton kernels run in Triton's interpreter: its mode is fixed when a kernel is
decorated, so it is chosen here, before any test module imports one."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
