"""The process groups of an expert-parallel run, joined from torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; `launch.spawn` sets the same for one host).

Two groups: `compute` carries every MoE layer's combine (NCCL on CUDA, gloo on CPU) with a
timeout after which a rank that did not join is an error (MOETIER_DIST_TIMEOUT seconds, default
300); `control` carries rank 0's step inputs to the other ranks (gloo, CPU tensors, so the
broadcast needs no GPU stream), with a timeout of days: a server's followers wait for the next
request as long as it idles.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_ENV = "MOETIER_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
CONTROL_TIMEOUT = timedelta(days=30)
_joined: list[bool] = []  # this process joined a run (join)


def launched_ranks() -> int:
    """WORLD_SIZE when this process was started as one rank of several (torchrun, or
    launch.spawn), else 1."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def end_process(status: int) -> int:
    """The last call of a process that may have been a rank (the CLI's main, a spawned rank):
    where it joined a run, stdout and stderr are flushed and the process ends here with
    `status` (os._exit), without the interpreter's teardown, in which gloo's threads can abort
    the process ("terminate called without an active exception", exit -6) after its work was
    done and its groups closed (a loaded CI run; PyTorch's own account of it is an unfixed
    race between gloo's work threads and interpreter finalization). Else `status`."""
    if not _joined:
        return status
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def timeout_seconds() -> float:
    """MOETIER_DIST_TIMEOUT: how long a collective of the experts waits for every rank."""
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        return float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: give seconds, e.g. 300") from None


@dataclass
class RankGroup:
    """This process's place in the run and its two process groups."""

    rank: int
    ranks: int
    local_rank: int
    device: torch.device
    compute: Any  # a torch.distributed ProcessGroup: the experts' combine
    control: Any  # a gloo ProcessGroup: rank 0's step inputs
    timeout_s: float

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0's `message` (any picklable object; tensors on the CPU) -> on every rank
        (torch.distributed.broadcast_object_list over the gloo control group)."""
        box = [message if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self, finished: bool = False) -> None:
        """Leave the run. `finished`: every rank got to its end (rank 0 stopped the followers),
        so the ranks first meet at a barrier and none tears its sockets down while another is
        still reading the last message (gloo then aborts the process at exit, "terminate
        called without an active exception", seen in a loaded CI run); after an error the
        others may be gone, so no barrier then."""
        if not dist.is_initialized():
            return
        if finished:
            try:
                wait = timedelta(seconds=self.timeout_s)
                dist.monitored_barrier(group=self.control, timeout=wait)
            except (RuntimeError, dist.DistError):
                pass  # a rank gone at the very end: leave anyway, the launcher reports its exit
        dist.destroy_process_group()


def join(device: str) -> RankGroup:
    """Join the run this process was started in (RANK etc. in the environment). `device`: the
    engine's resolved device, cuda or cpu; on CUDA each rank takes GPU LOCAL_RANK."""
    rank = int(os.environ["RANK"])
    ranks = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    kind = device.split(":")[0]
    if kind == "cuda":
        if device != "cuda":
            raise ValueError(f"--device {device}: with several ranks give --device cuda (or auto); "
                             "each rank takes the GPU of its LOCAL_RANK")  # fmt: skip
        count = torch.cuda.device_count()
        if local >= count:
            raise ValueError(
                f"rank {rank} is local rank {local} and this node has {count} GPU(s): start at "
                f"most {count} ranks a node (--gpus / torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(local)
        backend, where = "nccl", torch.device("cuda", local)
    elif kind == "cpu":
        backend, where = "gloo", torch.device("cpu")
    else:
        raise ValueError(f"expert parallel runs on cuda or cpu, not {device!r}")
    timeout = timeout_seconds()
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    try:
        dist.init_process_group(backend, rank=rank, world_size=ranks,
                                timeout=timedelta(seconds=timeout))  # fmt: skip
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    except (RuntimeError, ValueError, dist.DistError) as err:
        raise RuntimeError(
            f"rank {rank} of {ranks} could not join the others at {address} within "
            f"{timeout:.0f} s ({err}): start every rank (torchrun on each node) with the same "
            f"--nnodes, --nproc-per-node and --rdzv-endpoint, or raise {TIMEOUT_ENV}"
        ) from err
    _joined.append(True)
    return RankGroup(rank, ranks, local, where, dist.group.WORLD, control, timeout)
