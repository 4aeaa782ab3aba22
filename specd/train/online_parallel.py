"""Online SpecOPD over data-parallel ranks: rank 0 leads the service, the other ranks follow.

The trainer service with ``--data-parallel N`` runs N processes (torchrun). Rank 0 is the whole
service of one process — gRPC, metrics, the Redis stream (reads, acknowledgements, claims, dead
letters), the gate, publishing and every scoring call — with a `ParallelOnlineLearner` in place of
the `OnlineLearner`; ranks 1..N-1 hold only their shards of the drafter and apply rank 0's
commands (`follow`). Design choices:

- **The batch is broadcast, not the supervision.** A step's command carries the batch of
  trajectories (token ids: small); every rank draws its share of it from the drafter, exactly as
  `DataParallelSpecOPD` does offline (items r, r + W, ...; per-item seeds, so W ranks give the
  loss and weights of one rank fed the same traces). Drawing needs the sharded drafter on every
  rank anyway (FSDP all-gathers in each pass), so rank 0 could not build the supervision alone.
- **Scoring stays on rank 0** (`GatheredScorer`): the ranks' proposal trees go to rank 0, which
  scores all of them in ONE call of the service's scorer (verifiers or a local target) and sends
  each rank its rows. A scorer failure aborts the step on every rank before training, and rank 0
  raises the scorer's own error, so the service handles it as with one process (the batch stays
  queued and is retried whole, or is dead-lettered).
- **Commands** (`Command`): a `dist.broadcast_object_list` of ``(command, payload)`` from rank 0,
  then the collective itself on every rank: STEP (the batch), SAVE and LOAD (the checkpoint
  directory; DCP shards from every rank, ``trainer.json`` with the learner's state from rank 0),
  GATHER (the full weights on rank 0, `gather_drafter`, for the gate and for publishing), NOOP (a
  heartbeat while the stream is idle, so that a follower's wait never reaches the process group's
  timeout) and STOP. `Leader` sends them one at a time under a lock; a command that fails midway
  (other than a scoring abort) leaves the ranks out of step, and no further command is sent.
- **Checkpoints** are `DataParallelSpecOPD.save`'s: ``online/dcp`` + ``online/trainer.json``,
  swapped in by a rename; the service acknowledges traces only after that save returns on rank 0
  (its last barrier follows every rank's write). A directory holding the other kind of
  checkpoint (``state.pt`` of one process) is refused rather than overwritten.
- **Shutdown**: the followers ignore SIGTERM (torchrun forwards it to every rank); rank 0 drains,
  finishes its step, saves, acknowledges, then sends STOP (`Leader.close`) and every rank exits 0.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from specd.models.d3d import D3DModel
from specd.train.data_parallel import (
    TRAINER_STATE,
    DataParallelSpecOPD,
    GatheredScorer,
    Ranks,
    ScoringAborted,
    gather_drafter,
    shard_drafter,
)
from specd.train.online import GateDecision, OnlineConfig, OnlineLearner
from specd.train.opd import recover_checkpoint
from specd.train.specopd import SpecOPDConfig, StepResult, Trajectory, TreeScorer

logger = logging.getLogger(__name__)

LEADER = 0


class Command(enum.IntEnum):
    NOOP = 0
    STOP = 1
    STEP = 2
    SAVE = 3
    LOAD = 4
    GATHER = 5


@dataclass(kw_only=True, slots=True)
class Setup:
    """What rank 0 tells the other ranks once it has started: what they cannot know without a target."""

    vocab_size: int
    stop_token_ids: tuple[int, ...]
    config: SpecOPDConfig
    """Rank 0's, so that every rank draws with the same block, anchors, seed, ..."""


def parallel_trainer(scorer: TreeScorer | None, drafter: D3DModel, setup: Setup, ranks: Ranks) -> DataParallelSpecOPD:
    """``drafter`` sharded over the ranks and its trainer; ``scorer`` on rank 0 only (None elsewhere).
    Local: nothing here talks to the other ranks."""
    gathered = GatheredScorer(scorer, ranks, vocab_size=setup.vocab_size, stop_token_ids=setup.stop_token_ids)
    return DataParallelSpecOPD(gathered, shard_drafter(drafter, ranks.mesh), setup.config, ranks)


# ---------------------------------------------------------------------------- rank 0
class Leader:
    """Rank 0's end of the command channel (see the module docstring)."""

    def __init__(self, ranks: Ranks, *, heartbeat_seconds: float = 60.0) -> None:
        if not ranks.is_main:
            raise ValueError(f"rank {ranks.rank} cannot lead: rank {LEADER} does")
        self.ranks = ranks
        self.heartbeat_seconds = heartbeat_seconds
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self.state = "new"
        """new -> started -> closed; "broken" once a command failed midway."""

    def start(self, setup: Setup | None) -> None:
        """Tell the other ranks to build their trainers (None: rank 0 could not start; they exit)."""
        with self._lock:
            if self.state != "new":
                raise RuntimeError(f"the other ranks were already told to start (state {self.state})")
            dist.broadcast_object_list([setup], src=LEADER)
            self.state = "closed" if setup is None else "started"
            self._last = time.monotonic()

    @contextlib.contextmanager
    def command(self, command: Command, payload: Any = None) -> Iterator[None]:
        """Announce ``command``, then run rank 0's part of it in the ``with`` block."""
        with self._lock:
            if self.state != "started":
                raise RuntimeError(f"cannot send {command.name}: the other ranks are {self.state}")
            dist.broadcast_object_list([(command, payload)], src=LEADER)
            self._last = time.monotonic()
            try:
                yield
            except ScoringAborted:
                raise  # every rank left the step at the same point: still in step
            except BaseException:
                self.state = "broken"
                raise

    def heartbeat(self) -> None:
        """A NOOP when nothing was sent for ``heartbeat_seconds``."""
        if self.state == "started" and time.monotonic() - self._last >= self.heartbeat_seconds:
            with self.command(Command.NOOP):
                pass

    def close(self) -> None:
        """Let the other ranks go: STOP once started, an empty setup before. Nothing once broken:
        they wait inside the failed command, and the launcher ends them when rank 0 exits."""
        with self._lock:
            if self.state == "new":
                dist.broadcast_object_list([None], src=LEADER)
            elif self.state == "started":
                dist.broadcast_object_list([(Command.STOP, None)], src=LEADER)
            else:
                return
            self.state = "closed"


class ParallelOnlineLearner(OnlineLearner):
    """`OnlineLearner` on rank 0 of a data-parallel trainer: the same decisions, with the steps,
    checkpoints and weight gathers run on every rank through ``leader`` (module docstring).

    ``drafter`` is sharded in place; ``live`` stays whole on rank 0. Construction starts the
    other ranks, after every local check has passed (a failure before that: `Leader.close`).
    """

    def __init__(self, scorer: TreeScorer, drafter: D3DModel, live: D3DModel, directory: Path, *, leader: Leader,
                 config: SpecOPDConfig | None = None, online: OnlineConfig | None = None) -> None:
        self.leader = leader
        self._whole: D3DModel | None = None  # the gathered weights of the current step
        super().__init__(scorer, drafter, live, directory, config=config, online=online)

    def _trainer(self, scorer: TreeScorer, drafter: D3DModel) -> DataParallelSpecOPD:
        setup = Setup(vocab_size=scorer.vocab_size, stop_token_ids=tuple(scorer.stop_token_ids), config=self.config)
        trainer = parallel_trainer(scorer, drafter, setup, self.leader.ranks)  # raises before any rank is told
        self.leader.start(setup)
        return trainer

    def _train(self, trajectories: list[Trajectory]) -> StepResult:
        self._whole = None
        try:
            with self.leader.command(Command.STEP, trajectories):
                return self.trainer.step(trajectories)
        except ScoringAborted as aborted:  # the scorer's own error, for the service to judge
            raise aborted.error from None

    def weights(self) -> D3DModel:
        """The full weights, gathered on rank 0 once per step (every rank takes part)."""
        if self._whole is None:
            with self.leader.command(Command.GATHER):
                whole = gather_drafter(self.trainer.drafter, self.leader.ranks)
            self._whole = whole.to(self.leader.ranks.device)
        return self._whole

    def judge(self, candidate: D3DModel | None = None) -> GateDecision:
        # The gate runs on rank 0 alone, on whole weights: the sharded drafter cannot run one rank's passes.
        return super().judge(self.weights() if candidate is None else candidate)

    def _save_checkpoint(self) -> None:
        with self.leader.command(Command.SAVE, str(self.checkpoint_dir)):
            self.trainer.save(self.checkpoint_dir, self, {})

    def _load_checkpoint(self) -> bool:
        recover_checkpoint(self.checkpoint_dir)  # rank 0 alone: the others load what it names
        if (self.checkpoint_dir / "state.pt").is_file():
            raise ValueError(f"{self.checkpoint_dir} holds a one-process checkpoint (state.pt): resume it with "
                             "--data-parallel 1, or use another checkpoint directory")
        if not (self.checkpoint_dir / TRAINER_STATE).is_file():
            return False
        self.trainer.read_state(self.checkpoint_dir)  # another configuration raises here, before the ranks load
        with self.leader.command(Command.LOAD, str(self.checkpoint_dir)):
            self.trainer.load(self.checkpoint_dir, self)
        self._whole = None
        return True

    def idle(self) -> None:
        self.leader.heartbeat()

    def close(self) -> None:
        self.leader.close()


# ---------------------------------------------------------------------------- ranks 1..N-1
class _NoCursor:
    """The data source a follower saves and loads with: the learner's state is rank 0's alone."""

    def state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        pass


def receive_setup() -> Setup | None:
    """A follower's first message: rank 0's `Setup`, or None when rank 0 could not start."""
    box: list[Setup | None] = [None]
    dist.broadcast_object_list(box, src=LEADER)
    return box[0]


def follow(trainer: DataParallelSpecOPD) -> int:
    """Apply rank 0's commands in order until STOP; returns how many were applied. Any failure
    raises (a follower that skipped a command would pair the wrong collectives)."""
    applied = 0
    while True:
        box: list[tuple[Command, Any] | None] = [None]
        dist.broadcast_object_list(box, src=LEADER)
        command, payload = box[0]
        if command == Command.STOP:
            return applied
        applied += 1
        if command == Command.STEP:
            try:
                trainer.step(payload)
            except ScoringAborted as aborted:  # rank 0 retries the batch or drops it
                logger.warning("rank %d: step abandoned: %s", trainer.ranks.rank, aborted)
        elif command == Command.SAVE:
            trainer.save(payload, _NoCursor(), {})
        elif command == Command.LOAD:
            trainer.load(payload, _NoCursor())
        elif command == Command.GATHER:
            gather_drafter(trainer.drafter, trainer.ranks)
