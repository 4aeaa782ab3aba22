"""The serving loop: requests arrive and leave while the target keeps stepping.

`SpeculativeEngine.generate` decodes a fixed batch; a server gets requests one at a time from many
clients and streams tokens back as they are verified. `ServingEngine` runs the engine's step in a
background thread over whatever is running (continuous batching, like vLLM's engine core): each
step admits waiting requests into free cache rows, runs one target pass over every running
sequence, and pushes the tokens each sequence committed to its `RequestStream`. Finished and
cancelled sequences leave at once and free their rows for the next waiting request. Admission and
rows are `specd.scheduler.Scheduler`'s, the same as `generate`'s.

Streams are consumed from plain threads (`for delta in stream`) or from asyncio (`async for`); the
loop thread hands deltas to an event loop with ``call_soon_threadsafe``, so an HTTP server does
not spend a thread per open stream.

Passes run on the loop thread only. The thread that builds the engine (which loaded the weights)
frees its OpenMP pool (`specd.threads.release_pool`): with two pools on a small machine the
loop's OpenMP workers would sleep between ops, and every op of a pass would pay their wake-up
(``bench/thread_cost.py`` measures what that costs).

The lock `target_lock` is held during every step, so other users of the same target (the
verifier's tree scoring for the trainer) interleave between steps instead of racing them. It is a
`FairLock` (FIFO): the loop asks for it again right after each step, and with a plain lock it
would take it straight back while a Score call waited behind it for minutes under load.

One request must never stop the engine for the others (a probe once poisoned it with
``temperature=1e-40``):

- parameters are validated before a request is queued (`SamplingParams`, `check`), and a full
  queue refuses at once (`QueueFull`, HTTP 429) instead of growing without bound;
- a request whose own sampling fails inside a step ends with finish reason "error" and its
  message, while the rest of the batch goes on (`SpeculativeEngine.fail`); a step that fails as
  a whole is retried once per sequence alone, so only the sequences that fail alone fail;
- if the loop thread dies all the same (a bug, repeated whole-step failures) every open stream
  gets the error, `alive` turns False, new requests are refused (`EngineStopped`) and
  ``on_death`` tells the server, which reports NOT_SERVING and exits so that its supervisor
  restarts it: a dead engine behind a green health check is the one outcome ruled out;
- `shutdown` ends every stream within its budget whatever state the loop is in: what it could not
  finish is aborted from the calling thread, so no consumer (an HTTP response, a gRPC handler
  thread) waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator, Sequence

from torch import nn

from specd.drafters.base import Drafter
from specd.engine import EngineConfig, EngineStats, SpeculativeEngine, check_prompt, tau
from specd.sampling import SamplingParams
from specd.scheduler import RunningSequence, Scheduler
from specd.threads import FairLock, release_pool

logger = logging.getLogger(__name__)


class ContextTooLong(ValueError):
    """The prompt plus the tokens asked for do not fit in the model's context."""


class QueueFull(Exception):
    """The waiting queue is at its limit: the client should retry later (HTTP 429)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down or its loop died: send the request to another replica."""


MAX_WHOLE_STEP_FAILURES = 3
"""Consecutive steps that fail as a whole (even sequence by sequence) before the engine is
declared dead: a target that cannot run any pass is not serving."""


@dataclass(kw_only=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    target_passes: int
    tokens_per_pass: float
    """Completion tokens per target pass: this request's τ, from the tokens it output (a stop
    token or max_tokens may cut the last pass's accepted tokens); 0.0 before its first pass."""


@dataclass(kw_only=True, slots=True)
class Delta:
    """What one request committed since its previous delta."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    """None until the last delta: "stop", "length", "abort" or "error"."""
    usage: Usage | None = None
    """On the last delta."""
    accepted_lengths: list[int] | None = None
    """On the last delta: accepted drafted tokens at each of the request's verification passes."""
    drafter_version: str = ""
    """On the last delta: the drafter weight version that drafted for it last ("" without one)."""
    error: str = ""
    """With finish_reason "error": what went wrong with this request."""


class RequestStream:
    """The deltas of one request, in order; iterable from a thread or from asyncio."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.cancelled = threading.Event()
        self._lock = threading.Lock()
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_items: asyncio.Queue | None = None
        self._ended = False

    def _put(self, item) -> None:
        """Called by the loop thread (and by `ServingEngine.shutdown`). After the last item (a
        delta with a finish reason, or an error) nothing more is delivered: one end per stream."""
        with self._lock:
            if self._ended:
                return
            self._ended = isinstance(item, BaseException) or item.finish_reason is not None
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._async_items.put_nowait, item)
            else:
                self._items.put(item)

    def cancel(self) -> None:
        """Ask the engine to drop the request at its next step (its last delta says "abort")."""
        self.cancelled.set()

    def __iter__(self) -> Iterator[Delta]:
        while True:
            delta = _unwrap(self._items.get())
            yield delta
            if delta.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[Delta]:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._async_items = asyncio.Queue()
                while not self._items.empty():
                    self._async_items.put_nowait(self._items.get())
        while True:
            delta = _unwrap(await self._async_items.get())
            yield delta
            if delta.finish_reason is not None:
                return


def _unwrap(item: Delta | BaseException) -> Delta:
    """A queued delta, or the engine's failure raised in the consumer."""
    if isinstance(item, BaseException):
        raise item
    return item


@dataclass(kw_only=True, slots=True)
class FinishedRequest:
    """A finished request as the server records it (its trace, its latency metrics)."""

    request_id: str
    prompt: list[int]
    output: list[int]
    finish_reason: str
    accepted_lengths: list[int]
    drafter_version: str
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    store: bool = True
    """False when the client kept the request out of the trace stream (OpenAI's ``store``)."""


@dataclass(kw_only=True, slots=True)
class _Pending:
    prompt: list[int]
    params: SamplingParams
    stream: RequestStream
    store: bool = True
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None


class ServingEngine:
    """Continuous batching around `SpeculativeEngine` in a background thread (module docstring).

    ``max_waiting`` bounds the queue (`QueueFull` past it; None = unbounded); ``on_death`` is
    called from the loop thread, with the error, if the loop ever dies.
    """

    def __init__(self, target: nn.Module, drafter: Drafter | None = None, config: EngineConfig | None = None, *,
                 max_model_len: int | None = None, drafter_version: Callable[[], str] = lambda: "",
                 on_finish: Callable[[FinishedRequest], None] | None = None, max_waiting: int | None = None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        config = config or EngineConfig(drafter_retry_seconds=5.0)
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (None = unbounded), got {max_waiting}")
        self.engine = SpeculativeEngine(target, drafter, config)
        self.vocab_size = target.config.vocab_size
        self.max_model_len = max_model_len or int(getattr(target.config, "max_position_embeddings", 4096))
        self.max_waiting = max_waiting
        self.target_lock = FairLock()  # FIFO: a Score call waiting between steps is not starved
        self._drafter_version = drafter_version
        self._on_finish = on_finish
        self._on_death = on_death
        self._cond = threading.Condition()  # guards the waiting queue and the stop flags (submit vs the loop)
        self._scheduler: Scheduler[_Pending] = Scheduler(config.max_num_seqs)
        self._streams: dict[int, tuple[_Pending, int]] = {}  # seq_id -> (request, tokens sent)
        self._stopping = False
        self._drain = True
        self.error: BaseException | None = None
        """Why the loop died (None while it runs)."""
        self._ids = random.Random()  # drafter-side sequence ids: unique across verifiers
        release_pool()  # the passes run on the loop's thread from here on (module docstring)
        self._thread = threading.Thread(target=self._loop, name="specd-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests
    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def alive(self) -> bool:
        """The loop runs and takes requests (False once it died or is shutting down)."""
        return self.error is None and not self._stopping and self._thread.is_alive()

    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (ContextTooLong when it does not fit) for a request that cannot run."""
        check_prompt(prompt, self.vocab_size, params)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextTooLong(
                f"the prompt has {len(prompt)} tokens and asks for {params.max_tokens} more, but this "
                f"model's context is {self.max_model_len} tokens: shorten the prompt or lower max_tokens"
            )

    def submit(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
               store: bool = True) -> RequestStream:
        """Queue a request; ValueError for one that cannot run, `QueueFull` when the queue is at
        ``max_waiting``, `EngineStopped` when the engine is shutting down or dead. ``store``
        False: its `FinishedRequest` says so, and the verifier writes no trace of it."""
        self.check(prompt, params)
        stream = RequestStream(request_id or uuid.uuid4().hex)
        with self._cond:
            if self.error is not None:
                raise EngineStopped(f"the engine stopped ({self.error!r}): send the request to another replica")
            if self._stopping:
                raise EngineStopped("the engine is shutting down: send the request to another replica")
            if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
                raise QueueFull(
                    f"the server is at capacity ({self.num_waiting} requests already wait for a free row): "
                    "retry later or on another replica"
                )
            self._scheduler.add(_Pending(prompt=list(map(int, prompt)), params=params, stream=stream, store=store))
            self._cond.notify()
        return stream

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """Submit one request and wait for all of its tokens."""
        return [t for delta in self.submit(prompt, params) for t in delta.token_ids]

    def shutdown(self, drain: bool = True, timeout: float | None = None, *, abort_timeout: float = 10.0) -> None:
        """Stop the loop; with ``drain`` it first finishes every running and queued request, for
        at most ``timeout`` seconds (None: as long as they take), then aborts what is left. A
        loop that does not stop within ``abort_timeout`` more seconds (a step that hangs) is left
        behind: every open stream is ended from here, so shutdown always returns."""
        with self._cond:
            self._stopping, self._drain = True, drain
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                self._drain = False
                self._cond.notify()
            self._thread.join(abort_timeout)
        if self._thread.is_alive():
            logger.error("the engine loop did not stop within %.1f s of its abort: ending its streams", abort_timeout)
            self._end_all(lambda stream: Delta(request_id=stream.request_id, token_ids=[], finish_reason="abort"))
            return  # the engine's pool may be stuck with the loop: not waited for
        self.engine.close()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        failures = 0
        try:
            while True:
                with self._cond:
                    while not self._scheduler.has_work and not self._stopping:
                        self._cond.wait()
                    if self._stopping and (not self._drain or not self._scheduler.has_work):
                        break
                    self._scheduler.admit(self._start)
                self._drop_cancelled()
                if not self._scheduler.running:
                    continue
                start = time.perf_counter()
                try:
                    with self.target_lock:
                        self.engine.step(self._scheduler.running)
                    failures = 0
                except Exception as err:  # the step as a whole: find which sequences fail on their own
                    progressed = self._isolate(err)
                    failures = 0 if progressed else failures + 1
                    if failures >= MAX_WHOLE_STEP_FAILURES:
                        raise
                self._publish()
                self.engine.stats.seconds_total += time.perf_counter() - start  # busy time
        except BaseException as err:  # the loop dies: fail every open stream loudly, never hang them
            self.error = err
            logger.critical("the engine loop died: %r", err, exc_info=err)
            why = f"the engine stopped: {err!r}"
            self._end_all(lambda stream: EngineStopped(why))
            if self._on_death is not None:
                self._on_death(err)
            return
        # Not drained: the rest is aborted.
        self._end_all(lambda stream: Delta(request_id=stream.request_id, token_ids=[], finish_reason="abort"))

    def _end_all(self, last: Callable[[RequestStream], Delta | BaseException]) -> None:
        """Give every open stream (running and queued) its last item."""
        with self._cond:
            streams = [pending.stream for pending, _ in list(self._streams.values())]
            streams += [pending.stream for pending in self._scheduler.waiting]
        for stream in streams:
            stream._put(last(stream))

    def _isolate(self, err: Exception) -> bool:
        """After a step failed as a whole: step each running sequence alone, once. Those that
        fail alone end with their error; the others make one step of progress. Returns whether
        any did (if none can, the target itself is failing)."""
        logger.error("an engine step over %d sequences failed (%r): stepping each alone",
                     self.num_running, err, exc_info=err)
        progressed = False
        for seq in list(self._scheduler.running):
            if seq.done:
                continue
            try:
                with self.target_lock:
                    self.engine.step([seq])
                progressed = True
            except Exception as alone:  # this sequence's own failure: it ends, the others go on
                self.engine.fail(seq, alone)
        return progressed

    def _start(self, pending: _Pending, row: int) -> RunningSequence | None:
        """`Scheduler.admit`'s start of a waiting request in ``row``: its sequence, or None when it
        ends here (cancelled while it waited, or it cannot be seeded)."""
        stream = pending.stream
        if stream.cancelled.is_set():
            stream._put(Delta(request_id=stream.request_id, token_ids=[], finish_reason="abort"))
            return None
        try:
            seq = self.engine.start(self._ids.getrandbits(63), pending.prompt, pending.params, row)
        except (ValueError, RuntimeError, OverflowError) as err:  # validated at the door: a bug if so
            logger.error("request %s cannot be seeded: %r", stream.request_id, err)
            stream._put(Delta(request_id=stream.request_id, token_ids=[], finish_reason="error",
                              error=f"{type(err).__name__}: {err}"))
            return None
        self._streams[seq.seq_id] = (pending, 0)
        return seq

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._scheduler.running if self._streams[s.seq_id][0].stream.cancelled.is_set()]:
            seq.generation.finish_reason = "abort"
            seq.done = True
            self._finish(seq)

    def _publish(self) -> None:
        for seq in list(self._scheduler.running):
            pending, sent = self._streams[seq.seq_id]
            tokens = seq.generation.token_ids[sent:]
            if tokens and pending.first_token_time is None:
                pending.first_token_time = time.monotonic()
            if seq.done:
                self._finish(seq, tokens)
            elif tokens:
                self._streams[seq.seq_id] = (pending, sent + len(tokens))
                pending.stream._put(Delta(request_id=pending.stream.request_id, token_ids=tokens))

    def _finish(self, seq: RunningSequence, tokens: list[int] | None = None) -> None:
        pending, _ = self._streams.pop(seq.seq_id)
        stream = pending.stream
        self._scheduler.finish(seq)
        self.engine.release(seq.seq_id)
        out = seq.generation
        # This request's τ from its output: each pass output the target's token and the drafted
        # tokens it accepted, unless a stop cut them.
        usage = Usage(
            prompt_tokens=seq.num_prompt, completion_tokens=len(out.token_ids), target_passes=out.num_passes,
            tokens_per_pass=tau(len(out.token_ids) - out.num_passes, out.num_passes) if out.num_passes else 0.0,
        )
        version = self._drafter_version()
        if out.finish_reason == "error":
            logger.warning("request %s failed alone: %s", stream.request_id, out.error)
        stream._put(Delta(
            request_id=stream.request_id, token_ids=tokens or [], finish_reason=out.finish_reason, usage=usage,
            accepted_lengths=list(out.accepted_lengths), drafter_version=version, error=out.error,
        ))
        if self._on_finish is not None and out.finish_reason != "error":
            self._report(FinishedRequest(
                request_id=stream.request_id, prompt=pending.prompt, output=list(out.token_ids),
                finish_reason=out.finish_reason, accepted_lengths=list(out.accepted_lengths),
                drafter_version=version, arrival_time=pending.arrival_time,
                first_token_time=pending.first_token_time, finish_time=time.monotonic(), store=pending.store,
            ))

    def _report(self, finished: FinishedRequest) -> None:
        try:
            self._on_finish(finished)
        except Exception:  # a broken observer must not stop the serving loop
            logger.exception("on_finish failed for request %s", finished.request_id)
