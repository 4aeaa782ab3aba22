"""A drafter in its own process: the local form of "the drafter is another service".

`ProcessDrafter` starts a child process that loads a drafter directory and answers `draft`,
`speculate` and `release` over a pipe (token ids and, when sampling, the drafter's q — never
hidden states). Its point is compute isolation: the child has its own intra-op thread pool,
so the drafter really runs *beside* the target pass instead of fighting it for the same
threads, which is what D3D's drafting-during-verification needs. On a 2-core CPU, target and
drafter each get one thread.

If the child dies or stops answering, calls raise `DrafterUnavailable` and the engine carries
on with plain decoding: a request never fails for speed's sake.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

import torch

from specd.drafters.base import (
    DraftBlock,
    Drafter,
    DrafterUnavailable,
    DraftRequest,
    Outcome,
    SpeculateRequest,
)
from specd.drafters.d3d import D3DDrafter
from specd.models.loading import load_model


def _serve(directory: str, max_num_seqs: int, threads: int, connection: Connection) -> None:
    """The child: load the drafter, then answer requests until told to stop."""
    torch.set_num_threads(threads)
    model = load_model(directory)
    drafter = D3DDrafter(model, max_num_seqs=max_num_seqs)
    connection.send(("ready", {"vocab_size": drafter.vocab_size, "max_block": drafter.max_block}))
    while True:
        try:
            verb, payload = connection.recv()
        except EOFError:
            return
        if verb == "stop":
            return
        try:
            if verb == "draft":
                connection.send(("ok", drafter.draft(payload)))
            elif verb == "speculate":
                connection.send(("ok", drafter.speculate(payload)))
            elif verb == "release":
                drafter.release(payload)
                connection.send(("ok", None))
            else:
                connection.send(("error", f"unknown verb {verb!r}"))
        except (ValueError, RuntimeError) as err:
            connection.send(("error", str(err)))


class ProcessDrafter(Drafter):
    """Proxy to a D3D drafter running in a child process (see the module docstring)."""

    name = "d3d-process"
    can_speculate = True

    def __init__(self, directory: str, *, max_num_seqs: int = 16, threads: int = 1,
                 timeout_seconds: float = 60.0) -> None:
        context = mp.get_context("spawn")  # a fresh interpreter: no inherited thread pools
        self._connection, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(str(directory), max_num_seqs, threads, child), daemon=True
        )
        self._process.start()
        child.close()
        self.timeout_seconds = timeout_seconds
        status, info = self._receive()
        if status != "ready":
            raise DrafterUnavailable(f"drafter process failed to start: {info}")
        self.vocab_size, self.max_block = info["vocab_size"], info["max_block"]

    def _receive(self):
        if not self._connection.poll(self.timeout_seconds):
            raise DrafterUnavailable(f"drafter process gave no answer in {self.timeout_seconds} s")
        try:
            return self._connection.recv()
        except (EOFError, ConnectionResetError) as err:
            raise DrafterUnavailable(f"drafter process is gone: {err}") from err

    def _call(self, verb: str, payload):
        if not self._process.is_alive():
            raise DrafterUnavailable("drafter process is not running")
        try:
            self._connection.send((verb, payload))
        except (BrokenPipeError, OSError) as err:
            raise DrafterUnavailable(f"drafter process is gone: {err}") from err
        status, result = self._receive()
        if status == "error":
            raise ValueError(result)
        return result

    def draft(self, requests: list[DraftRequest]) -> list[DraftBlock]:
        return self._call("draft", requests)

    def speculate(self, requests: list[SpeculateRequest]) -> list[dict[Outcome, DraftBlock]]:
        return self._call("speculate", requests)

    def release(self, seq_id: int) -> None:
        if self._process.is_alive():
            self._call("release", seq_id)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._connection.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()

    def kill(self) -> None:
        """For fault tests: the drafter disappears without a word."""
        self._process.kill()
        self._process.join()
