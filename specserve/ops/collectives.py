"""The collectives of a tensor-parallel group, over torch.distributed.

`TensorParallel` is one rank's handle on its group: NCCL on CUDA, gloo on the CPU. It is built
once per rank from a rendezvous store and handed explicitly to whatever needs it (the sharded
layers, the engine); the process group is created directly rather than as torch.distributed's
default group, so no module state decides anything and several engines, sharded or not, can
live in one process. With tp_size 1 nothing of this exists and no collective runs.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

LOCALHOST = "127.0.0.1"


def serve_rendezvous(world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0's store on a free local port (the OS picks it: no race between choosing and
    binding); the other ranks reach it with `connect_rendezvous(store.port, ...)`."""
    return dist.TCPStore(
        LOCALHOST, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
    )


def connect_rendezvous(port: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    return dist.TCPStore(LOCALHOST, port, world_size, is_master=False, timeout=timeout)


class TensorParallel:
    def __init__(self, rank: int, size: int, group, device: torch.device):
        self.rank = rank
        self.size = size
        self.group = group
        self.device = device

    @classmethod
    def join(
        cls,
        rank: int,
        size: int,
        device: torch.device,
        timeout: datetime.timedelta,
        store: dist.Store,
    ) -> TensorParallel:
        """Every rank of the group calls this with the rendezvous store; it returns once all
        have. A collective waiting longer than `timeout` for a peer raises instead of hanging."""
        store = dist.PrefixStore("tp", store)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            # loopback only: the ranks are processes of one machine, whatever its hostname resolves to
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOCALHOST)]
            group = dist.ProcessGroupGloo(store, rank, size, opts)
        return cls(rank, size, group, device)

    # ---- collectives (every rank calls each, in the same order) ------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (returned for chaining). Every rank gets the same
        bits, so ranks that go on computing from it stay identical."""
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along `dim`, rank 0 first."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s tensor, in place on every rank."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([x], opts).wait()
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (sizes every rank must agree on)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    def abort(self) -> None:
        """Fail the collectives in flight (a peer is gone; NCCL would wait for it until the
        timeout). Gloo notices a closed peer by itself."""
        if self.device.type == "cuda":
            self.group.abort()
