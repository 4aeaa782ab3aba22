"""Traces of finished requests, written to a Redis stream for the trainer.

Live traffic is exactly what SpecOPD trains on: decoding is lossless, so a finished request's
prompt and output are a reference trajectory of the target. One stream entry per request (XADD
with an approximate MAXLEN bound, so the stream never grows without limit):

    trace_id         hex string (the trainer is idempotent by it)
    prompt_ids       JSON list of ints
    output_ids       JSON list of ints
    accepted         JSON list: accepted drafted tokens per verification pass
    drafter_version  the drafter weights that drafted for it
    finish_reason    "stop" | "length" | "abort"

Writing never blocks serving: entries go through a bounded queue to a writer thread, and when
Redis is down (or the queue is full) the entry is dropped and counted; serving goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid

import redis
from prometheus_client import Counter

from specd.serving import FinishedRequest
from specd.train.online import Trace

logger = logging.getLogger(__name__)

TRACES_WRITTEN = Counter("specd:traces_written", "Request traces written to the Redis stream")
TRACES_DROPPED = Counter("specd:traces_dropped", "Request traces dropped (Redis unreachable or queue full)", ["reason"])


def trace_fields(finished: FinishedRequest) -> dict[str, str]:
    """The stream entry of a finished request (the format is `specd.train.online.Trace`'s)."""
    return Trace(
        trace_id=uuid.uuid4().hex, prompt_ids=finished.prompt, output_ids=finished.output,
        accepted=finished.accepted_lengths, drafter_version=finished.drafter_version,
        finish_reason=finished.finish_reason,
    ).to_fields()


class TraceWriter:
    """Writes finished requests to a Redis stream from a background thread (module docstring)."""

    def __init__(self, redis_url: str, stream: str = "specd:traces", *, maxlen: int = 100_000,
                 queue_size: int = 10_000, timeout_seconds: float = 1.0) -> None:
        self.stream = stream
        self.maxlen = maxlen
        self.client = redis.Redis.from_url(redis_url, socket_timeout=timeout_seconds,
                                           socket_connect_timeout=timeout_seconds)
        self.written = 0
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="specd-traces", daemon=True)
        self._thread.start()

    def __call__(self, finished: FinishedRequest) -> None:
        """Queue one trace (called from the serving loop: never blocks)."""
        if finished.finish_reason == "abort" or not finished.output:
            return  # a cancelled request is not a reference trajectory
        try:
            self._queue.put_nowait(trace_fields(finished))
        except queue.Full:
            self._drop("queue_full")

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        TRACES_DROPPED.labels(reason).inc()

    def _run(self) -> None:
        while True:
            fields = self._queue.get()
            if fields is None:
                return
            try:
                self.client.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
                self.written += 1
                TRACES_WRITTEN.inc()
            except redis.RedisError as err:
                if self.dropped == 0 or self.dropped % 100 == 0:
                    logger.warning("trace dropped, Redis unreachable (%s); serving continues", err)
                self._drop("redis_unavailable")

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (as far as Redis allows), then stop."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # Redis is too slow to take the backlog: what is queued is dropped with the process
        self._thread.join(timeout)
