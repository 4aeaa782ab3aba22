"""A tensor-parallel verifier: rank 0 serves, the other ranks replay its target calls in lockstep.

A target sharded with `specd.parallel.tensor_parallel` runs collectives inside every pass, so
every rank must run the same passes, in the same order, over the same batches, each on its own
cache. The verifier touches the target only through a few calls (``target(batch, cache)``,
``target.hidden_states``, ``target.lm_head``, ``target.new_cache``, and the cache's ``commit``,
``rollback``, ``prepare``, ``reserve``, ``lengths``), so:

- on rank 0, `LockstepTarget` stands in for the target (an ``nn.Module`` with the same calls;
  `LockstepCache` for each cache). Each call first broadcasts an *op* to the followers, then runs
  on rank 0's own shard; the engine, the tree scoring (``Score``) and the HTTP API run unchanged;
- on every other rank, `follow` receives ops and applies them to its shard and caches. The
  passes' collectives pair with rank 0's because both sides apply ops through one function
  (`apply`), in the order rank 0 sent them.

An op is one `dist.broadcast_object_list` of a small `Header` (the verb, the cache's id, small
arguments such as commit paths and rollback lengths, and the layout of a batch), then, when it
carries a `ForwardBatch`, two tensor broadcasts: every int64 field and the trees' flat tensors
packed in one, the attention mask (as bytes) in the other. A commit of the batch the cache's last
pass ran (the engine's case) sends no tensors: the followers kept that batch. The existing tensor
channel (`services.common.tensor_channel`) does not fit: it is a trainer-verifier pair on its own
store; here the ops must be ordered with the model's own collectives, on the same group.

Ordering. Ops come from the engine thread (passes, commits, row resets) and from ``Score``
threads (a temporary cache per request); one lock makes each op (its broadcast AND its run on
rank 0, collectives included) atomic, so the followers see one total order. A cache that rank 0
drops (``Score``'s temporary ones) is released on the followers with the next op. While the
service is idle, rank 0 sends a no-op every ``heartbeat_seconds`` so that a follower's wait never runs
into the process group's collective timeout.

Lifecycle (`services.verifier.server`): ``torchrun --nproc-per-node N -m services.verifier
--tensor-parallel N ...``; every rank loads the checkpoint and shards it; rank 0 serves gRPC/HTTP.
SIGTERM (torchrun forwards it to every rank) drains rank 0, which then sends the stop op; the
followers ignore the signal and exit on that op. A follower that fails raises (and torchrun ends
the job): a follower that skipped an op would pair the wrong collectives.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.tree import TokenTree

logger = logging.getLogger("specd.verifier.lockstep")

LEADER = 0


class Op(enum.IntEnum):
    NOOP = 0  # heartbeat (and a carrier for released caches)
    STOP = 1
    NEW_CACHE = 2
    FORWARD = 3
    HIDDEN_STATES = 4
    LM_HEAD = 5
    COMMIT = 6
    ROLLBACK = 7
    PREPARE = 8
    RESERVE = 9


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """What a follower needs to receive a `ForwardBatch`'s tensors (shapes and scalars)."""

    num_seqs: int
    max_new: int
    mask_shape: tuple[int, int, int]
    tree_sizes: tuple[int, ...]  # nodes per tree (no trees: a dense training batch)
    dense_causal: bool
    scratch_slot: int


@dataclass(frozen=True, slots=True)
class Header:
    op: Op
    cache: int = -1
    """The cache's id (-1: no cache)."""
    args: tuple = ()
    """Small arguments: (num_seqs, capacity), (paths,), (lengths,), (num_slots,)."""
    batch: BatchLayout | None = None
    """The batch that follows as tensors; None with ``same_batch`` or when the op takes none."""
    same_batch: bool = False
    """The op's batch is the one the cache's previous batch-carrying op sent."""
    hidden: tuple[tuple[int, ...], torch.dtype] | None = None
    """LM_HEAD: shape and dtype of the hidden states that follow; None: the last HIDDEN_STATES result."""
    released: tuple[int, ...] = field(default=())
    """Caches rank 0 dropped since the previous op."""


# ---------------------------------------------------------------------------------- batches on the wire
INT_FIELDS = ("input_ids", "positions", "write_slots")  # [num_seqs, max_new] each


def batch_layout(batch: ForwardBatch) -> BatchLayout:
    return BatchLayout(
        num_seqs=batch.num_seqs, max_new=batch.max_new, mask_shape=tuple(batch.mask.shape),
        tree_sizes=tuple(tree.num_nodes for tree in batch.trees), dense_causal=batch.dense_causal,
        scratch_slot=batch.scratch_slot,
    )


def pack_batch(batch: ForwardBatch, device: torch.device) -> tuple[Tensor, Tensor]:
    """Every int64 field and the trees' tensors in one flat tensor; the mask as ``uint8``."""
    parts = [getattr(batch, name).reshape(-1) for name in INT_FIELDS]
    parts += [batch.num_new, batch.cache_lens]
    parts += [t for tree in batch.trees for t in (tree.tokens, tree.parents, tree.anchors)]
    ints = torch.cat([part.to(device=device, dtype=torch.long) for part in parts])
    return ints, batch.mask.to(device).contiguous().view(torch.uint8)


def receive_batch(layout: BatchLayout, device: torch.device, group) -> ForwardBatch:
    num_seqs, max_new = layout.num_seqs, layout.max_new
    sizes = [num_seqs * max_new] * len(INT_FIELDS) + [num_seqs, num_seqs]
    sizes += [n for n in layout.tree_sizes for _ in range(3)]
    ints = torch.empty(sum(sizes), dtype=torch.long, device=device)
    mask = torch.empty(layout.mask_shape, dtype=torch.uint8, device=device)
    dist.broadcast(ints, LEADER, group=group)
    dist.broadcast(mask, LEADER, group=group)
    pieces = list(torch.split(ints, sizes))
    fields = {name: pieces.pop(0).view(num_seqs, max_new) for name in INT_FIELDS}
    num_new, cache_lens = pieces.pop(0), pieces.pop(0)
    trees = tuple(TokenTree(*pieces[3 * i : 3 * i + 3]) for i in range(len(layout.tree_sizes)))
    return ForwardBatch(
        **fields, mask=mask.view(torch.bool), num_new=num_new, trees=trees, cache_lens=cache_lens,
        dense_causal=layout.dense_causal, scratch_slot=layout.scratch_slot,
    )


# ---------------------------------------------------------------------------------- both sides
@dataclass(slots=True)
class Replica:
    """One rank's side of the ops: its shard, its caches, and what later ops may refer to."""

    model: nn.Module
    caches: dict[int, Any] = field(default_factory=dict)
    last_batch: dict[int, ForwardBatch] = field(default_factory=dict)  # per cache
    last_hidden: Tensor | None = None

    def release(self, cache_ids: Sequence[int]) -> None:
        for cache_id in cache_ids:
            self.caches.pop(cache_id, None)
            self.last_batch.pop(cache_id, None)


@torch.no_grad()
def apply(replica: Replica, header: Header, batch: ForwardBatch | None, hidden: Tensor | None) -> Any:
    """Run one op on this rank's shard; rank 0 and the followers both come through here."""
    model, cache = replica.model, replica.caches.get(header.cache)
    if batch is not None and header.cache >= 0:
        replica.last_batch[header.cache] = batch
    op = header.op
    if op == Op.NEW_CACHE:
        replica.caches[header.cache] = model.new_cache(*header.args)
        return replica.caches[header.cache]
    if op == Op.FORWARD:
        return model(batch, cache)
    if op == Op.HIDDEN_STATES:
        replica.last_hidden = model.hidden_states(batch, cache)
        return replica.last_hidden
    if op == Op.LM_HEAD:
        return model.lm_head(replica.last_hidden if hidden is None else hidden)
    if op == Op.COMMIT:
        return cache.commit(batch, *header.args)
    if op == Op.ROLLBACK:
        return cache.rollback(*header.args)
    if op == Op.PREPARE:
        return cache.prepare(batch)
    if op == Op.RESERVE:
        return cache.reserve(*header.args)
    if op in (Op.NOOP, Op.STOP):
        return None
    raise ValueError(f"unknown lockstep op {op!r}")


# ---------------------------------------------------------------------------------- rank 0
class LockstepCache:
    """Rank 0's handle on a cache: its verbs are broadcast to the followers, then run here."""

    def __init__(self, leader: LockstepTarget, cache_id: int, local: Any) -> None:
        self.leader, self.id, self.local = leader, cache_id, local
        self.last_batch: ForwardBatch | None = None  # the batch the followers hold for this cache
        # Dropped (a Score request's cache): the followers drop theirs with the next op.
        weakref.finalize(self, leader.released.append, cache_id)

    @property
    def lengths(self) -> Tensor:  # [num_seqs]
        return self.local.lengths

    @property
    def capacity(self) -> int:
        return self.local.capacity

    @property
    def supports_row_prefix(self) -> bool:
        return self.local.supports_row_prefix

    def commit(self, batch: ForwardBatch, paths: Sequence[Sequence[int] | None]) -> None:
        paths = [None if path is None else [int(node) for node in path] for path in paths]
        self.leader.run(Op.COMMIT, self, args=(paths,), batch=batch)

    def rollback(self, lengths: Sequence[int] | Tensor) -> None:
        lengths = lengths.tolist() if isinstance(lengths, Tensor) else [int(n) for n in lengths]
        self.leader.run(Op.ROLLBACK, self, args=(lengths,))

    def prepare(self, batch: ForwardBatch) -> None:
        self.leader.run(Op.PREPARE, self, batch=batch)

    def reserve(self, num_slots: int) -> None:
        self.leader.run(Op.RESERVE, self, args=(int(num_slots),))


class LockstepTarget(nn.Module):
    """Rank 0's target: the same calls as the sharded model, each broadcast to the followers first."""

    def __init__(self, model: nn.Module, group=None, *, heartbeat_seconds: float = 30.0) -> None:
        super().__init__()
        self.sharded = model
        self.config = model.config
        self.group = group
        self.device = next(model.parameters()).device
        self.replica = Replica(model)
        self.released: deque[int] = deque()  # appended by finalizers in any thread (deque ops are atomic)
        self._lock = threading.Lock()
        self._next_cache = 0
        self._last_op = time.monotonic()
        self._stopped = False
        self._heartbeat_seconds = heartbeat_seconds
        self._stopping = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="lockstep-heartbeat", daemon=True)
        self._heartbeat.start()

    # ------------------------------------------------------------------ the target's calls
    def new_cache(self, num_seqs: int, capacity: int = 256) -> LockstepCache:
        with self._lock:
            cache_id, self._next_cache = self._next_cache, self._next_cache + 1
        local = self.run(Op.NEW_CACHE, None, args=(int(num_seqs), int(capacity)), cache_id=cache_id)
        return LockstepCache(self, cache_id, local)

    def forward(self, batch: ForwardBatch, cache: LockstepCache | None = None) -> Tensor:
        """Logits ``[num_seqs, max_new, vocab]`` (full vocabulary)."""
        return self.run(Op.FORWARD, cache, batch=batch)

    def hidden_states(self, batch: ForwardBatch, cache: LockstepCache | None = None) -> Tensor:
        """Final-norm hidden states ``[num_seqs, max_new, hidden]`` (the same on every rank)."""
        return self.run(Op.HIDDEN_STATES, cache, batch=batch)

    def lm_head(self, hidden: Tensor) -> Tensor:  # [..., hidden] -> [..., vocab]
        return self.run(Op.LM_HEAD, None, hidden=hidden)

    # ------------------------------------------------------------------ ops
    def run(self, op: Op, cache: LockstepCache | None, *, args: tuple = (), batch: ForwardBatch | None = None,
            hidden: Tensor | None = None, cache_id: int | None = None) -> Any:
        """Broadcast one op (header, then its tensors), then apply it here: atomically."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the tensor-parallel target was stopped (the verifier is shutting down)")
            if cache_id is None:
                cache_id = -1 if cache is None else cache.id
            released = tuple(self.released.popleft() for _ in range(len(self.released)))
            self.replica.release(released)
            same_batch = batch is not None and cache is not None and batch is cache.last_batch
            send_batch = batch is not None and not same_batch
            send_hidden = hidden is not None and hidden is not self.replica.last_hidden
            header = Header(
                op=op, cache=cache_id, args=args, released=released, same_batch=same_batch,
                batch=batch_layout(batch) if send_batch else None,
                hidden=(tuple(hidden.shape), hidden.dtype) if send_hidden else None,
            )
            self._broadcast(header, batch if send_batch else None, hidden if send_hidden else None)
            if cache is not None and batch is not None:
                cache.last_batch = batch
            self._last_op = time.monotonic()
            return apply(self.replica, header, batch, hidden if send_hidden else None)

    def _broadcast(self, header: Header, batch: ForwardBatch | None, hidden: Tensor | None) -> None:
        dist.broadcast_object_list([header], LEADER, group=self.group, device=self._object_device())
        if batch is not None:
            for tensor in pack_batch(batch, self.device):
                dist.broadcast(tensor, LEADER, group=self.group)
        if hidden is not None:
            dist.broadcast(hidden.to(self.device).contiguous(), LEADER, group=self.group)

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def _beat(self) -> None:
        while not self._stopping.wait(self._heartbeat_seconds / 2):
            if time.monotonic() - self._last_op >= self._heartbeat_seconds:
                try:
                    self.run(Op.NOOP, None)
                except RuntimeError:  # stopped meanwhile
                    return

    def stop(self) -> None:
        """Send the stop op (the followers exit); later calls raise. Idempotent."""
        self._stopping.set()
        with self._lock:
            if self._stopped:
                return
            dist.broadcast_object_list([Header(op=Op.STOP)], LEADER, group=self.group,
                                       device=self._object_device())
            self._stopped = True
        self._heartbeat.join()


# ---------------------------------------------------------------------------------- the other ranks
def follow(model: nn.Module, group=None) -> int:
    """Apply rank 0's ops to this rank's shard until the stop op; returns the number of ops."""
    device = next(model.parameters()).device
    object_device = device if device.type == "cuda" else None
    replica = Replica(model)
    num_ops = 0
    while True:
        received: list[Any] = [None]
        dist.broadcast_object_list(received, LEADER, group=group, device=object_device)
        header: Header = received[0]
        replica.release(header.released)
        if header.op == Op.STOP:
            return num_ops
        batch = None
        if header.batch is not None:
            batch = receive_batch(header.batch, device, group)
        elif header.same_batch:
            batch = replica.last_batch[header.cache]
        hidden = None
        if header.hidden is not None:
            shape, dtype = header.hidden
            hidden = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(hidden, LEADER, group=group)
        apply(replica, header, batch, hidden)
        num_ops += 1


# ---------------------------------------------------------------------------------- launching
@dataclass(frozen=True, slots=True)
class Ranks:
    rank: int
    world_size: int
    device: torch.device


def launch_command(size: int) -> str:
    return f"torchrun --nproc-per-node {size} -m services.verifier --tensor-parallel {size} ..."


def init_ranks(size: int, device: str) -> Ranks:
    """The process group of a ``--tensor-parallel size`` verifier launched by torchrun: NCCL for a
    CUDA ``device`` (each rank on ``cuda:LOCAL_RANK``), gloo for the CPU."""
    world_size = os.environ.get("WORLD_SIZE")
    if world_size != str(size):
        found = "WORLD_SIZE is not set" if world_size is None else f"WORLD_SIZE is {world_size}"
        raise RuntimeError(f"--tensor-parallel {size} needs {size} processes, one per rank, but {found}: "
                           f"launch it as `{launch_command(size)}`")
    kind = torch.device(device).type
    if kind == "cuda":
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(where)
    elif kind == "cpu":
        where = torch.device("cpu")
    else:
        raise RuntimeError(f"--tensor-parallel runs on cpu (gloo) or cuda (NCCL), not {device!r}")
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return Ranks(rank=dist.get_rank(), world_size=dist.get_world_size(), device=where)


def run_follower(model: nn.Module, ranks: Ranks) -> None:
    """A follower's whole life: ignore SIGTERM/SIGINT (rank 0 drains, then says stop), replay, leave."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    logger.info("rank %d of %d: replaying rank 0's target calls", ranks.rank, ranks.world_size)
    num_ops = follow(model)
    logger.info("rank %d: stop op after %d ops; exiting", ranks.rank, num_ops)
    dist.destroy_process_group()
