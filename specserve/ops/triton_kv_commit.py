"""Accepted-path KV compaction in one kernel (the torch reference,
`speculative/kv_commit.py: commit_path_reference`, is two indexing ops and runs without triton).

`buffer` is KVCache's [2, layers, slots, kv_heads, head_dim] tensor. For request b the path
node at depth d (node id path[b, d], whose KV sits at slot window_slots[b, path[b, d]]) moves
to slot window_slots[b, d]. Torch gathers every source row and then scatters them; on a
large cache its indexing kernels are split into many launches (64-bit offsets), which cost
about as much as the whole plain decode step's attention on small models.

In place, one program per (K-or-V layer plane, request), depths in increasing order. This
is safe without a staging copy: nodes are in topological order, so an accepted node at depth
d has id >= d and the slot written at depth d is never a later depth's source unless it
already holds that value (the padding past the accepted length repeats the last node, whose
own copy is to itself).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _commit_path_kernel(
    Buf, WindowSlots, Path,
    plane_stride, slot_stride, ws_stride, path_stride,
    DEPTH: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    plane = tl.program_id(0)
    b = tl.program_id(1)
    base = Buf + plane.to(tl.int64) * plane_stride
    offs = tl.arange(0, BLOCK)
    for d in tl.static_range(DEPTH):
        node = tl.load(Path + b * path_stride + d)
        src = tl.load(WindowSlots + b * ws_stride + node).to(tl.int64)
        dst = tl.load(WindowSlots + b * ws_stride + d).to(tl.int64)
        for start in tl.static_range(0, ROW, BLOCK):
            m = start + offs < ROW
            x = tl.load(base + src * slot_stride + start + offs, mask=m)
            tl.store(base + dst * slot_stride + start + offs, x, mask=m)


def commit_path(buffer: torch.Tensor, window_slots: torch.Tensor, path: torch.Tensor) -> None:
    """In-place compaction (see the module doc); buffer must be contiguous."""
    assert buffer.is_contiguous() and buffer.dim() == 5
    bsz, depth = path.shape
    if bsz == 0:
        return
    planes = buffer.shape[0] * buffer.shape[1]
    row = buffer.shape[3] * buffer.shape[4]
    ws = window_slots if window_slots.stride(-1) == 1 else window_slots.contiguous()
    pa = path if path.stride(-1) == 1 else path.contiguous()
    _commit_path_kernel[(planes, bsz)](
        buffer, ws, pa,
        buffer.stride(1), buffer.stride(2), ws.stride(0), pa.stride(0),
        DEPTH=depth, ROW=row, BLOCK=min(1024, triton.next_power_of_2(row)),
    )  # fmt: skip
