"""Drafter weight versions broadcast over ``torch.distributed`` (DESIGN.md, "Real parts").

The pull path (`services.common.checkpoints`) costs the trainer one full upload per replica; a
broadcast sends each byte once to every replica that takes part. Pulling stays the fallback for
everything that goes wrong here, so a broadcast only ever saves time: it never fails a request
and never leaves a replica without the live version.

Design choices:

- **Who takes part.** A drafter replica that accepts broadcasts heartbeats into the sorted set
  ``REGISTRY_KEY`` (member = its replica id, score = Redis ``TIME``, so clocks of different
  machines never matter) every ``HEARTBEAT_SECONDS`` (`heartbeat`); the trainer takes the members
  seen within ``STALE_HEARTBEATS`` heartbeats (`live_members`), sorted, as ranks 1..N. A replica
  leaving cleanly removes itself (`leave`).
- **One update, one process group, one store.** For each version the trainer starts a fresh
  ``TCPStore`` on a free port (`VersionBroadcast`), announces it under ``ANNOUNCEMENT_KEY``
  (`Announcement`: version, every file's sha256 and size, the store's address, world size N + 1,
  the members in rank order, the backend), and builds a process group for this update only,
  shut down afterwards. The group is a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` built on that
  store (`specd.parallel.groups`), **not** the default group of ``init_process_group``: a process can hold only one default
  group, a trainer may need its own for the scoring tensor channel, and a test (or a colocated
  deployment) runs a trainer and a drafter in one process, which two default groups cannot. Our
  own group objects have no process-wide state, so two updates could not clobber each other; they
  still never overlap, because the trainer publishes under its service lock and a drafter
  receives on its one watcher thread.
- **Backend**: ``nccl`` when the trainer trains on CUDA, else ``gloo``; the tensors live on the
  backend's device (the drafter's CUDA device for NCCL). Same code, one branch to build the group.
- **Rendezvous before any collective.** Each member connects to the store and says ``ready/<rank>``
  = ``ok`` (or why it cannot join, e.g. NCCL on a CPU replica); the trainer waits at most
  ``timeout`` for all of them, then says ``go`` = ``ok`` or calls the update off with the reason.
  A member that died or cannot reach the store therefore costs one timeout and no collective is
  started without it. One that dies mid-transfer fails the collective on its timeout; with NCCL,
  run with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` so such a timeout raises here instead of the
  NCCL watchdog ending the process (its default). The NCCL branch is the gloo code with device
  tensors; the tests exercise gloo (CPU) only.
- **Files**: sorted by name, each streamed in ``chunk_bytes`` pieces as ``uint8`` tensors, sizes
  known from the announcement, so memory stays bounded by one chunk. A receiver hashes while it
  writes into a hidden staging sibling of the destination, checks every sha256 against the
  announcement (a mismatch is `CheckpointError`, the same refusal the pull path raises), fsyncs
  and renames the directory into place; it reports ``done/<rank>`` to the trainer either way.
- **Failures** are `BroadcastError` on both sides (timeouts, a dead peer, a store that cannot be
  reached): the trainer still sets the live-version key, and every replica pulls with
  ``GetCheckpoint`` as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, Self

import redis
import torch
import torch.distributed as dist

from services.common.checkpoints import CheckpointError, fsync_directory
from specd.parallel.groups import broadcast_from_rank0, master_store, new_group, seconds_timedelta

logger = logging.getLogger(__name__)

REGISTRY_KEY = "specd:drafters:broadcast"
"""Sorted set of drafter replicas accepting broadcasts: member = replica id, score = last heartbeat (Redis TIME)."""
ANNOUNCEMENT_KEY = "specd:drafter:broadcast"
"""The JSON `Announcement` of the broadcast in progress (deleted when it ends; expires on its own)."""
HEARTBEAT_SECONDS = 2.0
STALE_HEARTBEATS = 3
"""A member whose last heartbeat is older than this many heartbeats is not asked to join."""
CHUNK_BYTES = 64 << 20
"""Bytes per broadcast tensor: bounds the memory a transfer holds on every rank."""
BACKENDS = ("gloo", "nccl")


class BroadcastError(RuntimeError):
    """A broadcast did not complete (a member missing, a timeout, a peer that died); nothing was
    installed. Pull the version with GetCheckpoint instead."""


# ---------------------------------------------------------------------------- membership
def heartbeat(client: redis.Redis, replica_id: str, key: str = REGISTRY_KEY) -> None:
    """Register (or refresh) ``replica_id`` as accepting broadcasts, stamped with Redis's clock."""
    seconds, micros = client.time()
    client.zadd(key, {replica_id: seconds + micros / 1e6})


def leave(client: redis.Redis, replica_id: str, key: str = REGISTRY_KEY) -> None:
    """Stop being asked to join broadcasts (a draining replica)."""
    client.zrem(key, replica_id)


def live_members(client: redis.Redis, key: str = REGISTRY_KEY, heartbeat_seconds: float = HEARTBEAT_SECONDS) -> list[str]:
    """The replica ids with a heartbeat in the last ``STALE_HEARTBEATS`` heartbeats, sorted (rank
    order); staler entries are removed from the set."""
    seconds, micros = client.time()
    cutoff = seconds + micros / 1e6 - STALE_HEARTBEATS * heartbeat_seconds
    client.zremrangebyscore(key, "-inf", f"({cutoff}")
    members = client.zrangebyscore(key, cutoff, "+inf")
    return sorted(m.decode() if isinstance(m, bytes) else m for m in members)


def default_replica_id() -> str:
    """hostname-pid-random: unique even when a pod restarts under the same name."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"


def backend_for(device: str | torch.device) -> str:
    """NCCL when the trainer's tensors are on CUDA (and CUDA is there), else gloo."""
    return "nccl" if torch.device(device).type == "cuda" and torch.cuda.is_available() else "gloo"


@dataclass(frozen=True, slots=True)
class Membership:
    """How one drafter replica takes part in broadcasts (the watcher's side)."""

    replica_id: str
    device: str = "cpu"
    """Where received tensors land for NCCL (a CUDA device); gloo always receives on the CPU."""
    registry_key: str = REGISTRY_KEY
    announcement_key: str = ANNOUNCEMENT_KEY
    heartbeat_seconds: float = HEARTBEAT_SECONDS


# ---------------------------------------------------------------------------- the announcement
@dataclass(frozen=True, slots=True)
class Announcement:
    """The value of ``ANNOUNCEMENT_KEY``: everything a member needs to join one update."""

    version: str
    sha256: dict[str, str]  # file name -> hex digest
    files: dict[str, int]  # file name -> size in bytes
    master_addr: str
    master_port: int
    world_size: int  # len(members) + 1: the trainer is rank 0
    members: list[str]  # replica ids; members[i] is rank i + 1
    backend: str  # "gloo" or "nccl"
    timeout: float  # seconds any one wait may take
    chunk_bytes: int = CHUNK_BYTES

    def rank_of(self, replica_id: str) -> int | None:
        """This replica's rank in the update, None when it is not a member."""
        return self.members.index(replica_id) + 1 if replica_id in self.members else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def parse(raw: bytes | str) -> Announcement:
        """ValueError, saying what is wrong, when ``raw`` is not a well-formed announcement."""
        try:
            announcement = Announcement(**json.loads(raw))
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"the broadcast announcement is not the JSON of an Announcement ({err}): {raw!r:.200}") from None
        announcement._check()
        return announcement

    def _check(self) -> None:
        """ValueError unless every field has the type and range a member relies on."""
        _check_name(self.version, "version")
        where = f"announcement of {self.version}"
        if not isinstance(self.sha256, dict) or not isinstance(self.files, dict) or not self.files:
            raise ValueError(f"{where}: sha256 and files must be non-empty maps of file name -> hex digest / size")
        if set(self.sha256) != set(self.files):
            raise ValueError(f"{where}: sha256 names {sorted(self.sha256)} but files are {sorted(self.files)}")
        for name, size in self.files.items():
            _check_name(name, "file")
            if not isinstance(size, int) or size < 0 or not isinstance(self.sha256[name], str):
                raise ValueError(f"{where}: file {name!r} has size {size!r} and sha256 {self.sha256[name]!r}")
        if not isinstance(self.master_addr, str) or not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"{where}: store address {self.master_addr!r}:{self.master_port!r} is not a host and a port")
        if self.backend not in BACKENDS:
            raise ValueError(f"{where}: backend {self.backend!r} is not one of {BACKENDS}")
        if (not isinstance(self.members, list) or not all(isinstance(m, str) for m in self.members)
                or len(set(self.members)) != len(self.members) or self.world_size != len(self.members) + 1):
            raise ValueError(f"{where}: world_size {self.world_size!r} for members {self.members!r} (distinct replica ids)")
        if not isinstance(self.timeout, (int, float)) or not isinstance(self.chunk_bytes, int) \
                or self.timeout <= 0 or self.chunk_bytes < 1:
            raise ValueError(f"{where}: timeout {self.timeout!r} and chunk_bytes {self.chunk_bytes!r} must be positive numbers")


def _check_name(name: object, what: str) -> None:
    # Both names become paths on the drafter: plain names only (no "../", no "a/b").
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name or name.startswith("."):
        raise ValueError(f"the broadcast names {what} {name!r}: expected a plain name (no '/', not hidden, not '.' or '..')")


@dataclass(frozen=True, slots=True)
class BroadcastResult:
    """What the members reported after the transfer."""

    received: list[str] = field(default_factory=list)  # replica ids that verified and installed the files
    refused: dict[str, str] = field(default_factory=dict)  # replica id -> why (sha256 mismatch, no report)


# ---------------------------------------------------------------------------- both sides
# The store, the one-update group and the broadcast itself are plain torch.distributed: they live in
# `specd.parallel.groups` (imported above; the Score tensor channel takes them from here too).


def transfer_device(backend: str, device: str | torch.device) -> torch.device:
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


def cannot_join(backend: str, device: str | torch.device) -> str | None:
    """Why this rank cannot take part in a ``backend`` broadcast on ``device``, None when it can."""
    if backend == "nccl" and (torch.device(device).type != "cuda" or not torch.cuda.is_available()):
        return f"an NCCL broadcast needs a CUDA device, but this replica runs on {device}"
    return None


def _chunks(size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece of a ``size``-byte file (none for an empty file)."""
    return [(offset, min(chunk_bytes, size - offset)) for offset in range(0, size, chunk_bytes)]


# ---------------------------------------------------------------------------- the trainer's side
class VersionBroadcast:
    """One update, trainer side (rank 0): a store on a free port, then every file to every member.

    Use it as a context manager: enter, publish ``announcement`` (Redis), `send`, exit (the
    store goes away). ``sha256`` is the published map (file name -> hex) of ``directory``.
    """

    def __init__(self, directory: Path, version: str, sha256: Mapping[str, str], members: Sequence[str], *,
                 host: str, timeout: float, device: str | torch.device = "cpu", chunk_bytes: int = CHUNK_BYTES) -> None:
        if not members:
            raise ValueError("a broadcast needs at least one member; with none, drafters pull")
        self.directory = Path(directory)
        self.backend = backend_for(device)
        self.device = transfer_device(self.backend, device)
        files = {name: (self.directory / name).stat().st_size for name in sorted(sha256)}
        try:
            self.store: dist.TCPStore | None = master_store(host, timeout)
        except RuntimeError as err:
            raise BroadcastError(f"cannot start the broadcast store on {host} (is --broadcast-host an address of "
                                 f"this machine?): {err}") from None
        self.announcement = Announcement(
            version=version, sha256=dict(sha256), files=files, master_addr=host, master_port=self.store.port,
            world_size=len(members) + 1, members=sorted(members), backend=self.backend, timeout=timeout,
            chunk_bytes=chunk_bytes,
        )
        self.announcement._check()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.store = None  # the last reference: the store's server stops

    def send(self) -> BroadcastResult:
        """Wait for every member to join, broadcast the files, collect their reports.

        BroadcastError when a member does not join within the timeout, declines, or the
        transfer fails; members that joined are told to give up at once (they pull).
        """
        if self.store is None:
            raise RuntimeError("this VersionBroadcast is closed: make a new one per update")
        store, announcement = self.store, self.announcement
        self._rendezvous(store)
        group = None
        try:
            group = new_group(announcement.backend, dist.PrefixStore("group", store), 0, announcement.world_size,
                               announcement.timeout)
            buffer = bytearray(min(announcement.chunk_bytes, max(announcement.files.values(), default=0)))
            for name, size in announcement.files.items():  # sorted by name
                with open(self.directory / name, "rb") as handle:
                    for _, length in _chunks(size, announcement.chunk_bytes):
                        view = memoryview(buffer)[:length]
                        if handle.readinto(view) != length:
                            raise BroadcastError(f"{self.directory / name} is shorter than its announced {size} bytes")
                        chunk = torch.frombuffer(view, dtype=torch.uint8).to(self.device)
                        broadcast_from_rank0(group, chunk, announcement.timeout)
        except RuntimeError as err:
            if group is not None:
                group.abort()
            raise BroadcastError(f"broadcasting version {announcement.version} failed: {err}") from None
        group.shutdown()
        return self._reports(store)

    def _rendezvous(self, store: dist.TCPStore) -> None:
        announcement = self.announcement
        keys = [f"ready/{rank}" for rank in range(1, announcement.world_size)]
        try:
            store.wait(keys, seconds_timedelta(announcement.timeout))
        except RuntimeError:
            missing = [m for m, key in zip(announcement.members, keys) if not store.check([key])]
            reason = (f"drafter replica(s) {missing} did not join the broadcast of {announcement.version} within "
                      f"{announcement.timeout:g}s: dead, not watching the announcements, or unable to reach the store at "
                      f"{announcement.master_addr}:{announcement.master_port} (set --broadcast-host to an address they can reach)")
            store.set("go", f"abort: {reason}")
            raise BroadcastError(reason) from None
        declined = {m: store.get(key).decode() for m, key in zip(announcement.members, keys)}
        declined = {m: answer for m, answer in declined.items() if answer != "ok"}
        if declined:
            reason = f"drafter replica(s) cannot join the broadcast of {announcement.version}: {declined}"
            store.set("go", f"abort: {reason}")
            raise BroadcastError(reason)
        store.set("go", "ok")

    def _reports(self, store: dist.TCPStore) -> BroadcastResult:
        announcement = self.announcement
        keys = [f"done/{rank}" for rank in range(1, announcement.world_size)]
        try:
            store.wait(keys, seconds_timedelta(announcement.timeout))
        except RuntimeError:
            pass  # a member that received everything and then died: reported below as "no report"
        result = BroadcastResult()
        for member, key in zip(announcement.members, keys):
            report = store.get(key).decode() if store.check([key]) else "no report (died after the transfer?)"
            if report == "ok":
                result.received.append(member)
            else:
                result.refused[member] = report
        return result


# ---------------------------------------------------------------------------- a drafter's side
def receive_version(announcement: Announcement, replica_id: str, destination: Path, *, device: str | torch.device = "cpu") -> Path:
    """Join ``announcement``'s update as ``replica_id``; write the verified files to ``destination``
    (which must not exist yet) and return it.

    BroadcastError when the update cannot complete (the store unreachable, called off, a timeout);
    CheckpointError when a received file's sha256 differs from the announced one. Either way
    ``destination`` is left untouched (the caller pulls instead). ValueError when ``replica_id``
    is not a member.
    """
    rank = announcement.rank_of(replica_id)
    if rank is None:
        raise ValueError(f"replica {replica_id!r} is not a member of the broadcast of {announcement.version}: pull it instead")
    destination = Path(destination)
    if destination.exists():
        raise FileExistsError(f"broadcast destination {destination} already exists: receive each version into a new directory")
    where = f"the trainer's store at {announcement.master_addr}:{announcement.master_port}"
    # Members wait out the trainer's own wait for the slowest member (one timeout), and then some.
    patience = seconds_timedelta(2 * announcement.timeout + 5)
    try:
        store = dist.TCPStore(announcement.master_addr, announcement.master_port, None, False, timeout=patience)
        problem = cannot_join(announcement.backend, device)
        store.set(f"ready/{rank}", problem or "ok")
        if problem:
            raise BroadcastError(problem)
        store.wait(["go"], patience)
        go = store.get("go").decode()
    except RuntimeError as err:
        if isinstance(err, BroadcastError):
            raise
        raise BroadcastError(f"cannot join the broadcast of {announcement.version} through {where}: {err}") from None
    if go != "ok":
        raise BroadcastError(f"the trainer called off the broadcast of {announcement.version}: {go}")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        digests = _receive_files(announcement, rank, store, staging, transfer_device(announcement.backend, device))
        wrong = {name: digest for name, digest in digests.items() if digest != announcement.sha256[name]}
        report = "ok" if not wrong else "sha256 mismatch: " + ", ".join(
            f"{name} is {digest}, announced {announcement.sha256[name]}" for name, digest in sorted(wrong.items()))
        try:
            store.set(f"done/{rank}", report)
        except RuntimeError as err:  # the trainer gave up on reports: the files are what counts
            logger.warning("could not report the broadcast of %s to %s: %s", announcement.version, where, err)
        if wrong:
            raise CheckpointError(f"broadcast version {announcement.version!r}: {report}; refusing to install it")
        os.rename(staging, destination)
        fsync_directory(destination.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return destination


def _receive_files(announcement: Announcement, rank: int, store: dist.TCPStore, staging: Path, device: torch.device) -> dict[str, str]:
    """Every announced file into ``staging``, fsynced; returns name -> sha256 of what arrived."""
    group = None
    digests: dict[str, str] = {}
    try:
        group = new_group(announcement.backend, dist.PrefixStore("group", store), rank, announcement.world_size,
                           announcement.timeout)
        for name, size in announcement.files.items():
            with open(staging / name, "wb") as handle:
                digests[name] = _receive_file(group, handle, size, announcement, device)
    except RuntimeError as err:
        if group is not None:
            group.abort()
        raise BroadcastError(f"receiving version {announcement.version} failed: {err}") from None
    group.shutdown()
    return digests


def _receive_file(group: dist.Backend, handle: BinaryIO, size: int, announcement: Announcement, device: torch.device) -> str:
    digest = hashlib.sha256()
    for _, length in _chunks(size, announcement.chunk_bytes):
        tensor = torch.empty(length, dtype=torch.uint8, device=device)
        broadcast_from_rank0(group, tensor, announcement.timeout)
        data = tensor.cpu().numpy()
        digest.update(data)
        handle.write(data)
    handle.flush()
    os.fsync(handle.fileno())
    return digest.hexdigest()
