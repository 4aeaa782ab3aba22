"""The processes of a ``--data-parallel N`` trainer: the process group, and ranks 1..N-1's whole life.

Rank 0 runs the service (`services.trainer.server.main`) with a `specd.train.online_parallel.Leader`;
the other ranks start no server and touch no Redis: they load the drafter, shard it, and apply
rank 0's commands until it says STOP (`specd.train.online_parallel.follow`).
"""

from __future__ import annotations

import logging
import os
import signal

import torch

from specd.models.loading import load_model
from specd.train.data_parallel import Ranks, init_distributed
from specd.train.online_parallel import follow, parallel_trainer, receive_setup

logger = logging.getLogger(__name__)


def launch_command(size: int) -> str:
    return f"torchrun --nproc-per-node {size} --standalone -m services.trainer --data-parallel {size} ..."


def start_ranks(size: int, device: str) -> Ranks:
    """The process group of a ``--data-parallel size`` trainer that torchrun launched: NCCL with
    each rank on ``cuda:LOCAL_RANK`` for a CUDA ``device``, gloo on the CPU. RuntimeError naming
    the torchrun command when this process is not one of ``size`` ranks."""
    world_size = os.environ.get("WORLD_SIZE")
    if world_size != str(size):
        found = "WORLD_SIZE is not set" if world_size is None else f"WORLD_SIZE is {world_size}"
        raise RuntimeError(f"--data-parallel {size} needs {size} processes, one per rank, but {found}: "
                           f"launch it as `{launch_command(size)}`")
    return init_distributed(torch.device(device).type)


def run_follower(drafter_dir: str, ranks: Ranks) -> int:
    """Rank ``ranks.rank`` > 0 until rank 0's STOP, training ``drafter_dir``'s drafter; the exit
    status (1 when rank 0 could not start).

    SIGTERM and SIGINT are ignored: torchrun forwards them to every rank, and a rank that left
    would strand rank 0 in its next collective; rank 0 drains, saves, then sends STOP.
    """
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    setup = receive_setup()
    if setup is None:
        logger.error("rank %d: rank 0 could not start (its log says why); exiting", ranks.rank)
        return 1
    # The same directory rank 0 loaded and checked: identical initial weights on every rank.
    drafter = load_model(drafter_dir, device=ranks.device)
    trainer = parallel_trainer(None, drafter, setup, ranks)
    logger.info("rank %d of %d: training its shards on %s; following rank 0", ranks.rank, ranks.world_size,
                ranks.device)
    applied = follow(trainer)
    logger.info("rank %d: STOP after %d commands (%d steps); exiting", ranks.rank, applied, trainer.num_steps)
    return 0
