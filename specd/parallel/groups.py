"""Process groups made for one job: a ``TCPStore`` on a free port and a gloo or NCCL group built on
it, not the default group of ``init_process_group``.

A process can hold only one default group, but a trainer may broadcast a drafter version while it
keeps a scoring tensor channel open, and a test (or a colocated deployment) runs both ends in one
process. Group objects built directly on a store carry no process-wide state, so any number of
them live side by side and each is shut down when its job ends. The weight broadcast and the
Score tensor channel (`services.common.broadcast`, `services.common.tensor_channel`) build theirs
here, and `specd bench gpu` checks NCCL the same way.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["broadcast_from_rank0", "master_store", "new_group", "seconds_timedelta"]


def seconds_timedelta(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def master_store(host: str, timeout: float) -> dist.TCPStore:
    """A TCPStore on a free port of ``host`` that does not wait for its clients: they connect
    whenever they read its address (an announcement, a Score request)."""
    return dist.TCPStore(host, 0, None, True, timeout=seconds_timedelta(timeout), wait_for_workers=False)


def new_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout: float) -> dist.Backend:
    """A ``backend`` ("gloo" or "nccl") group of ``world_size`` ranks on ``store``, for one job
    only (module docstring: why not the default group). RuntimeError when this torch has no NCCL."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, seconds_timedelta(timeout))
    if not dist.is_nccl_available():
        raise RuntimeError("this torch has no NCCL: an NCCL group needs a CUDA build of torch on every rank")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = seconds_timedelta(timeout)
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def broadcast_from_rank0(group: dist.Backend, tensor: torch.Tensor, timeout: float) -> None:
    """``tensor`` from rank 0 to every rank of ``group``, in place; returns once it has landed."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait(seconds_timedelta(timeout))
    if tensor.is_cuda:  # the next chunk reuses host memory: let this one land first
        torch.cuda.current_stream(tensor.device).synchronize()
