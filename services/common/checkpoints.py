"""Versioned drafter checkpoints moving from the trainer to the drafters over gRPC.

A checkpoint is a flat directory (``model.safetensors``, ``config.json``, ...). The trainer's
``GetCheckpoint`` streams it with `stream_checkpoint`: each regular file in name order, in chunks
at increasing offsets; a file's last chunk carries the hex sha256 and size of the whole file (an
empty file is one empty last chunk). A drafter pulls it with `fetch_checkpoint`, which writes into
a hidden temporary sibling of the destination, checks every file (offsets contiguous, size, sha256
against the chunk's and, when given, against the expected map), fsyncs, and only then renames the
directory into place: a reader of ``destination`` sees a whole verified checkpoint or none.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator, Mapping

from specd._proto.v1 import trainer_pb2, trainer_pb2_grpc


class CheckpointError(ValueError):
    """A transferred checkpoint failed a check (sha256, size, order, names); nothing was installed."""


def stream_checkpoint(
    directory: Path, version: str, chunk_bytes: int = 1 << 20
) -> Iterator[trainer_pb2.CheckpointChunk]:
    """Every regular file of ``directory`` (subdirectories are not part of a checkpoint) as chunks
    of at most ``chunk_bytes``; the last chunk of each file carries its sha256 and total_bytes.

    FileNotFoundError when the directory is missing or holds no file; ValueError on a chunk size
    below 1. Both are raised on the first ``next()``, before anything is sent.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint {version!r}: no directory {directory}")
    files = sorted(path for path in directory.iterdir() if path.is_file())
    if not files:
        raise FileNotFoundError(f"checkpoint {version!r}: directory {directory} holds no file")
    for path in files:
        digest = hashlib.sha256()
        offset = 0
        with open(path, "rb") as handle:
            data = handle.read(chunk_bytes)
            while True:
                # Read one chunk ahead to know which chunk is the last (and so carries the sha256).
                following = handle.read(chunk_bytes) if data else b""
                digest.update(data)
                chunk = trainer_pb2.CheckpointChunk(version=version, file=path.name, offset=offset, data=data)
                offset += len(data)
                if not following:
                    chunk.sha256, chunk.total_bytes = digest.hexdigest(), offset
                    yield chunk
                    break
                yield chunk
                data = following


def fetch_checkpoint(
    stub: trainer_pb2_grpc.TrainerStub,
    version: str,
    destination: Path,
    *,
    expected_sha256: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> Path:
    """Download checkpoint ``version`` ("" = the trainer's live one) into ``destination`` (which
    must not exist yet) and return it.

    ``expected_sha256`` (file name -> hex digest, e.g. from the version's record in Redis) must
    name exactly the files received. CheckpointError on any mismatch and FileExistsError when
    ``destination`` exists, grpc.RpcError when the call fails; in every case ``destination`` is
    left untouched and the temporary directory removed.
    """
    destination = Path(destination)
    if destination.exists():
        raise FileExistsError(
            f"checkpoint destination {destination} already exists: fetch each version into a new directory"
        )
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        chunks = stub.GetCheckpoint(trainer_pb2.GetCheckpointRequest(version=version), timeout=timeout)
        received = _receive(chunks, version, staging)
        if expected_sha256 is not None:
            for name in sorted(set(expected_sha256) | set(received)):
                if expected_sha256.get(name) != received.get(name):
                    raise CheckpointError(
                        f"checkpoint {version!r} file {name!r}: sha256 {received.get(name, '(not received)')} "
                        f"but expected {expected_sha256.get(name, '(not expected)')}; refusing to install it"
                    )
        os.rename(staging, destination)
        fsync_directory(destination.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return destination


@dataclass
class _IncomingFile:
    """One file being received into the staging directory."""

    name: str
    handle: BinaryIO
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    size: int = 0

    def write(self, chunk: trainer_pb2.CheckpointChunk) -> None:
        if chunk.offset != self.size:
            raise CheckpointError(
                f"file {self.name!r}: chunk at offset {chunk.offset}, expected {self.size} "
                "(chunks lost or reordered)"
            )
        self.handle.write(chunk.data)
        self.digest.update(chunk.data)
        self.size += len(chunk.data)

    def finish(self, chunk: trainer_pb2.CheckpointChunk) -> None:
        """Close (durably) and check size and sha256 against the file's last chunk."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        if self.size != chunk.total_bytes or self.digest.hexdigest() != chunk.sha256:
            raise CheckpointError(
                f"file {self.name!r}: received {self.size} bytes with sha256 {self.digest.hexdigest()}, "
                f"but the trainer says {chunk.total_bytes} bytes with sha256 {chunk.sha256}: "
                "corrupted in transit"
            )


def _receive(chunks: Iterator[trainer_pb2.CheckpointChunk], version: str, staging: Path) -> dict[str, str]:
    """Write the chunk stream into ``staging``, checking it as it comes; returns name -> sha256."""
    received: dict[str, str] = {}
    incoming: _IncomingFile | None = None
    served_version = version
    try:
        for chunk in chunks:
            served_version = served_version or chunk.version  # "" asked: the first chunk says which
            if chunk.version != served_version:
                raise CheckpointError(
                    f"asked for checkpoint {served_version!r} but a chunk belongs to {chunk.version!r}"
                )
            if incoming is None:
                _check_name(chunk.file, received)
                incoming = _IncomingFile(chunk.file, open(staging / chunk.file, "wb"))
            elif incoming.name != chunk.file:
                raise CheckpointError(
                    f"file {incoming.name!r} ended without its sha256 (its last chunk is missing)"
                )
            incoming.write(chunk)
            if chunk.sha256:
                incoming.finish(chunk)
                received[incoming.name] = chunk.sha256
                incoming = None
    finally:
        if incoming is not None:
            incoming.handle.close()
    if incoming is not None:
        raise CheckpointError(f"file {incoming.name!r} ended without its sha256 (the stream was cut short)")
    if not received:
        raise CheckpointError(f"checkpoint {version!r}: the trainer sent no file")
    return received


def _check_name(name: str, received: Mapping[str, str]) -> None:
    # The name becomes a path here: refuse anything but a plain file name (no "../", no "a/b").
    if not name or name in (".", "..") or Path(name).name != name or "\\" in name:
        raise CheckpointError(
            f"refusing checkpoint file name {name!r}: a checkpoint is a flat directory of plain names"
        )
    if name in received:
        raise CheckpointError(f"file {name!r} was sent twice")


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
