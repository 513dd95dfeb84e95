"""The training job's distributed world: this process's rank and device from torchrun's environment,
its share of the node's cores, the process group and the few collectives the job uses, its SIGTERM flag,
and its log (rank 0's)."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import os
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.constants import default_pg_timeout

from tasks.jobs.threads import take_share


@dataclass
class World:
    """This process's place in the job, from torchrun's environment (a world of one without it)."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    local_size: int = 1  # the ranks on this node, which share its cores

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, *, group: bool = False) -> World:
        """``group``: a process group even for a world of one (``--sharding full`` shards over it)."""
        rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        take_share(sharers=local_size)  # before any work: the node's ranks must not spin against each other
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if size > 1 or group:
            backend = "nccl" if device.type == "cuda" else "gloo"
            store = _loopback_store(rank, size)
            if store is None:
                dist.init_process_group(backend)
            else:
                dist.init_process_group(backend, store=store, rank=rank, world_size=size)
        return cls(rank, local_rank, size, device, local_size)

    def take_threads(self, width: int) -> int:
        """This rank's torch threads for a model ``width`` units wide, once the model is known: one for a
        small model, else its share of the node's cores (``tasks.jobs.threads``)."""
        return take_share(sharers=self.local_size, width=width)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks; a world of one returns them as they are (no device round trip)."""
        if self.size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def any(self, flag: bool) -> bool:
        """Whether any rank's flag is set: an all-reduce (a host sync) on several ranks, none on one."""
        return flag if self.size == 1 else self.sum([float(flag)])[0] > 0

    def gather_rows(self, tensor: Tensor) -> Tensor:
        """This rank's rows of a [B/W, …] tensor joined with every other rank's, in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    @contextlib.contextmanager
    def local_rank_first(self) -> Iterator[None]:
        """The block on the first rank of each node, then on the node's other ranks (which find what it
        downloaded in the node's cache)."""
        if self.local_rank != 0:
            self.barrier()
        yield
        if self.local_rank == 0:
            self.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            # The trainer is in a reference cycle (its schedule's lambda holds it), so without a
            # collection here its DDP reducer, ZeRO optimizer or FSDP state, each holding the process
            # group, would be freed only at interpreter exit, after destroy_process_group: the gloo
            # group's destructor then runs during finalisation, its peers already gone, and a rank
            # aborts after its work is done ("terminate called without an active exception").
            gc.collect()
            dist.destroy_process_group()


def _loopback_store(rank: int, size: int) -> dist.TCPStore | None:
    """The job's store, hosted by rank 0 on loopback only, when torchrun gives a loopback ``MASTER_ADDR``
    and leaves the store to rank 0 (the local launcher); else None, and ``env://`` makes it.

    A TCPStore server listens on every interface whatever host it is given, unless it is handed a
    socket that is already bound (``master_listen_fd``), which is what rank 0 does here.
    """
    host, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", 0))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not _is_loopback(host):
        return None
    if rank != 0:
        return dist.TCPStore(host, port, size, is_master=False, timeout=default_pg_timeout)
    listening = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    return dist.TCPStore(
        host,
        port,
        size,
        is_master=True,
        timeout=default_pg_timeout,
        multi_tenant=True,
        master_listen_fd=listening.detach(),  # the store's from here on: it closes it
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Steps between the ranks' agreement on a SIGTERM: each is an all-reduce the host waits for. One rank
# reads its own flag every step, at no cost.
SIGNAL_EVERY = 10


class Preempted:
    """Set by SIGTERM (Slurm preemption, pod eviction, torchrun shutting down, a cancelled flow run)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.signalled = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signalled = True

    def stops_after(self, step: int, stop: int) -> bool:
        """Whether the job stops after ``step``: any rank signalled, as the ranks agree on the same steps."""
        due = self.world.size == 1 or step % SIGNAL_EVERY == 0 or step == stop
        return due and self.world.any(self.signalled)


def log(world: World, message: str) -> None:
    """A line of the job's log, from rank 0 only."""
    if world.is_main:
        print(message, flush=True)
