"""Follow the live drafter version in Redis and swap it in (DESIGN.md, "Real parts").

The trainer publishes a version by writing the Redis key ``version_key`` as JSON
``{"version": "v7", "sha256": {"model.safetensors": "<hex>", "config.json": "<hex>"}}`` and then
publishing on ``version_channel``. A publish is only a hint: the watcher re-reads the key on every
message *and* every ``poll_seconds``, so a lost message (pub/sub has no delivery guarantee, and a
replica that starts later never saw it) delays an update by at most one poll.

On a new version the watcher pulls the checkpoint from the trainer's ``GetCheckpoint`` with
`fetch_checkpoint` (each file checked against the sha256 in the key), then hands the directory to
the servicer's ``swap_weights``. A checkpoint that fails verification or loading is refused (logged,
counted, not retried until the key changes) and the old weights keep serving; a trainer that cannot
be reached is retried at the next poll.

With a `Membership` (``--weight-transport broadcast``) the watcher also heartbeats the replica into
the broadcast registry (every ``heartbeat_seconds``, from this thread) and, on every read, looks
at the broadcast announcement first (`services.common.broadcast`): when it names this replica and
a version not served yet, the watcher joins the update, receives the files (sha256-verified), and
installs them through the same swap as a pull. Any failure there (a timeout, a dead peer, a
sha256 mismatch) is logged and counted, nothing is installed, and the live-version key, which the
trainer sets after every broadcast, makes the watcher pull the version as before. A version
received by broadcast is already served when the key names it, so it is not pulled again.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import redis
from prometheus_client import Counter

from services.common.broadcast import Announcement, BroadcastError, Membership, heartbeat, leave, receive_version
from services.common.checkpoints import CheckpointError, fetch_checkpoint
from specd._proto.v1 import trainer_pb2_grpc
from specd.models.loading import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VersionRecord:
    """The value of the live-version key."""

    version: str
    sha256: dict[str, str]  # file name -> hex digest

    @staticmethod
    def parse(raw: bytes | str) -> VersionRecord:
        """ValueError, saying what is expected, when ``raw`` is not a version record."""
        expected = 'expected JSON {"version": "<name>", "sha256": {"<file>": "<hex>", ...}}'
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"the live-version record is not JSON ({err}); {expected}") from None
        version = value.get("version") if isinstance(value, dict) else None
        sha256 = value.get("sha256") if isinstance(value, dict) else None
        if not isinstance(version, str) or not isinstance(sha256, dict) or not sha256:
            raise ValueError(f"the live-version record {value!r} is malformed; {expected}")
        # The version becomes a directory name: a plain name only.
        if version in ("", ".", "..") or Path(version).name != version or "\\" in version or version.startswith("."):
            raise ValueError(f"version name {version!r} is not a plain name (no '/', not '.' or '..')")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in sha256.items()):
            raise ValueError(f"the sha256 map {sha256!r} must map file names to hex strings; {expected}")
        return VersionRecord(version=version, sha256=dict(sha256))


class Swappable(Protocol):
    """What the watcher updates: the servicer."""

    version: str

    def swap_weights(self, directory: Path, version: str) -> None: ...


class WeightWatcher:
    """A thread that keeps ``target`` on the live drafter version (see the module docstring).

    Fetched versions go to ``directory/<version>``; after a swap the other version directories
    there are deleted (the loaded weights no longer need their files).
    """

    def __init__(
        self,
        target: Swappable,
        redis_client: redis.Redis,
        trainer: trainer_pb2_grpc.TrainerStub,
        *,
        directory: Path,
        key: str,
        channel: str,
        poll_seconds: float,
        refused: Counter | None = None,
        fetch_timeout: float = 120.0,
        broadcast: Membership | None = None,
        pulls: Counter | None = None,
        broadcasts: Counter | None = None,
        broadcast_failures: Counter | None = None,
    ) -> None:
        self.target = target
        self.redis = redis_client
        self.trainer = trainer
        self.directory = Path(directory)
        self.key, self.channel, self.poll_seconds = key, channel, poll_seconds
        self.refused = refused
        self.fetch_timeout = fetch_timeout
        self.broadcast = broadcast  # None: pull only
        self.pulls, self.broadcasts = pulls, broadcasts  # versions installed each way
        self.broadcast_failures = broadcast_failures  # labelled by reason: "sha256" or "transfer"
        self._last_raw: bytes | str | None = None  # the key's value last acted on
        self._last_announcement: bytes | str | None = None  # the announcement last acted on
        self._outcomes: dict[str, str] = {}  # version -> "installed" | "refused"
        self._settled = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drafter-weights", daemon=True)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (returns within about a second, or once a transfer in progress ends);
        leave the broadcast registry so the trainer stops counting on this replica."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.fetch_timeout)
        if self.broadcast is not None:
            try:
                leave(self.redis, self.broadcast.replica_id, self.broadcast.registry_key)
            except redis.RedisError as err:  # its heartbeat goes stale on its own
                logger.warning("could not leave the broadcast registry %s: %s", self.broadcast.registry_key, err)

    def wait_for(self, version: str, timeout: float) -> str | None:
        """Block until the watcher has acted on ``version``: "installed", "refused", or None on timeout."""
        with self._settled:
            self._settled.wait_for(lambda: version in self._outcomes, timeout)
            return self._outcomes.get(version)

    # ------------------------------------------------------------------ work
    def check(self) -> str | None:
        """Read the live-version key once; install a new version. Returns the outcome, or None
        when there was nothing to do (or the trainer could not be reached: retried next time).

        Raises redis.RedisError when Redis cannot be reached.
        """
        if self.broadcast is not None:
            self._check_announcement(self.broadcast)
        raw = self.redis.get(self.key)
        if raw is None or raw == self._last_raw:
            return None
        try:
            record = VersionRecord.parse(raw)
        except ValueError as err:
            logger.error("ignoring Redis key %s: %s", self.key, err)
            self._last_raw = raw
            return None
        if record.version == self.target.version:
            self._last_raw = raw
            return None
        destination = self.directory / record.version
        shutil.rmtree(destination, ignore_errors=True)  # a leftover of an earlier refused attempt
        try:
            fetch_checkpoint(self.trainer, record.version, destination, expected_sha256=record.sha256, timeout=self.fetch_timeout)
        except CheckpointError as err:
            if self.refused is not None:
                self.refused.inc()
            logger.error("refusing drafter version %r: %s; still serving %r", record.version, err, self.target.version)
            return self._settle(raw, record.version, "refused")
        except grpc.RpcError as err:
            logger.warning(
                "cannot fetch drafter version %r from the trainer (%s: %s); retrying in %.1fs",
                record.version, err.code().name, err.details(), self.poll_seconds,
            )
            return None
        if self.pulls is not None:
            self.pulls.inc()
        return self._settle(raw, record.version, self._install(destination, record.version))

    def _check_announcement(self, membership: Membership) -> None:
        """Join the broadcast the announcement describes when it names this replica (module docstring)."""
        raw = self.redis.get(membership.announcement_key)
        if raw is None or raw == self._last_announcement:
            return
        self._last_announcement = raw
        try:
            announcement = Announcement.parse(raw)
        except ValueError as err:
            logger.error("ignoring Redis key %s: %s", membership.announcement_key, err)
            return
        if announcement.rank_of(membership.replica_id) is None:
            return  # not asked (registered after it began): the live key makes us pull
        # A member must take part even in a version it already serves, or the trainer waits for
        # it and calls the update off for everyone: receive it to a hidden directory and drop it.
        served = announcement.version == self.target.version
        destination = self.directory / (f".served-{announcement.version}" if served else announcement.version)
        shutil.rmtree(destination, ignore_errors=True)  # a leftover of an earlier refused attempt
        try:
            receive_version(announcement, membership.replica_id, destination, device=membership.device)
        except (BroadcastError, CheckpointError, OSError) as err:  # OSError: the directory cannot be written
            if self.broadcast_failures is not None:
                self.broadcast_failures.labels(reason="sha256" if isinstance(err, CheckpointError) else "transfer").inc()
            logger.warning("broadcast of drafter version %r failed: %s; pulling it with GetCheckpoint instead, "
                           "still serving %r meanwhile", announcement.version, err, self.target.version)
            return
        finally:
            heartbeat(self.redis, membership.replica_id, membership.registry_key)  # a long transfer kept us silent
        if served:
            shutil.rmtree(destination, ignore_errors=True)
            return
        if self.broadcasts is not None:
            self.broadcasts.inc()
        outcome = self._install(destination, announcement.version)
        with self._settled:
            self._outcomes[announcement.version] = outcome
            self._settled.notify_all()

    def _install(self, destination: Path, version: str) -> str:
        """Swap in the verified files at ``destination``: "installed", or "refused" (the old
        weights stay); on success, the other version directories go."""
        try:
            self.target.swap_weights(destination, version)  # counts and logs its own refusals
        except ModelLoadError:
            shutil.rmtree(destination, ignore_errors=True)
            return "refused"
        for old in self.directory.iterdir():
            if old.is_dir() and old.name != version and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
        return "installed"

    def _settle(self, raw: bytes | str, version: str, outcome: str) -> str:
        self._last_raw = raw
        with self._settled:
            self._outcomes[version] = outcome
            self._settled.notify_all()
        return outcome

    def _run(self) -> None:
        pubsub = None
        due = 0.0  # monotonic time of the next read of the key
        beat = 0.0  # monotonic time of the next broadcast heartbeat
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self.channel)
                if self.broadcast is not None and time.monotonic() >= beat:
                    heartbeat(self.redis, self.broadcast.replica_id, self.broadcast.registry_key)
                    beat = time.monotonic() + self.broadcast.heartbeat_seconds
                if time.monotonic() >= due:
                    self.check()
                    due = time.monotonic() + self.poll_seconds
                # Wake at least every second to notice stop(); a message means "re-read now".
                wake = min(due, beat) if self.broadcast is not None else due
                wait = min(1.0, max(0.0, wake - time.monotonic()))
                if pubsub.get_message(timeout=wait) is not None:
                    due = 0.0
            except redis.RedisError as err:
                logger.warning("Redis unreachable while watching %s (%s); retrying in %.1fs", self.key, err, self.poll_seconds)
                if pubsub is not None:
                    pubsub.close()
                pubsub = None
                self._stop.wait(self.poll_seconds)
        if pubsub is not None:
            pubsub.close()
