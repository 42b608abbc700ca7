"""Without CUDA, Triton kernels run in Triton's interpreter: its mode is fixed when a kernel is
decorated, so it is chosen here, before any test module imports one."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # under pytest-xdist each worker is a process of its own, one per core: torch's intra-op
    # threads (one per core each) would oversubscribe them
    if hasattr(config, "workerinput"):
        torch.set_num_threads(1)
