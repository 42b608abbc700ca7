"""Moving host tensors to the device without making the host wait (any room may import this)."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without making the host wait for queued device work (pinned staging):
    a pageable copy would block until the step launched ahead has finished."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
