"""The trace stream as the trainer consumes it: a Redis consumer group with at-least-once delivery.

Where entries come from, in order of preference on each `TraceStream.read`:

1. **Reclaimed** (``XAUTOCLAIM``, every ``claim_idle_ms``): entries another consumer of the group
   took and left unacknowledged for that long — a trainer that died (a restarted pod has a new
   consumer name). Before claiming, the entries this consumer still holds (queued or trained
   but not yet checkpointed) are re-claimed to itself with ``JUSTID`` (which leaves their delivery
   count alone), so their idle time restarts and nobody, this consumer included, reclaims them.
2. **Its own backlog** (``XREADGROUP`` from id 0), once after a start: entries this consumer name
   was given before a restart and never acknowledged.
3. **New** entries (``XREADGROUP >``), blocking up to ``block_ms``.

An entry delivered more than ``max_deliveries`` times (it keeps coming back: it may be what kills
the trainer) goes to the dead-letter stream with the reason and is acknowledged; so does an entry
that cannot be parsed (`dead_letter`). An entry the stream has trimmed away while it was pending
comes back without fields and is acknowledged (there is nothing left to train on). Everything
else is acknowledged by the caller (`ack`), only once its effect is in a saved checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

import redis

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Entry:
    """One stream entry as delivered to this consumer."""

    id: str
    fields: dict[str, str]
    deliveries: int
    """How many times the group has delivered it (1 for a new entry)."""


class TraceStream:
    """A consumer of ``stream`` in ``group`` as ``consumer`` (see the module docstring)."""

    def __init__(self, client: redis.Redis, *, stream: str, group: str, consumer: str, claim_idle_ms: int,
                 max_deliveries: int, dead_stream: str, dead_maxlen: int = 100_000) -> None:
        if client.get_connection_kwargs().get("decode_responses") is not True:
            raise ValueError("TraceStream needs a Redis client made with decode_responses=True")
        self.client = client
        self.stream, self.group, self.consumer = stream, group, consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.dead_stream, self.dead_maxlen = dead_stream, dead_maxlen
        self._backlog_cursor: str | None = "0"  # None once the own backlog has been read through
        self._next_claim = 0.0  # monotonic seconds: claim at the first read

    def ensure_group(self) -> None:
        """Create the consumer group (and the stream) when missing; it starts at the stream's beginning."""
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    def read(self, count: int, block_ms: int, held: Collection[str] = ()) -> list[Entry]:
        """Up to ``count`` entries (reclaimed, own backlog or new; module docstring); ``held`` are
        the ids this consumer holds unacknowledged. Dead letters are handled here and not returned."""
        if time.monotonic() >= self._next_claim:
            self._next_claim = time.monotonic() + self.claim_idle_ms / 1000
            entries = self._claim(count, held)
            if entries:
                return self._screen(entries, counted=True)
        if self._backlog_cursor is not None:
            reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: self._backlog_cursor}, count=count)
            raw = reply[0][1] if reply else []
            if raw:
                self._backlog_cursor = raw[-1][0]
                return self._screen([(i, f) for i, f in raw if i not in held], counted=True)
            self._backlog_cursor = None
            logger.info("trace stream: own backlog read through; reading new traces")
        reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        raw = reply[0][1] if reply else []
        return self._screen(raw, counted=False)

    def ack(self, ids: Collection[str]) -> None:
        if ids:
            self.client.xack(self.stream, self.group, *ids)

    def dead_letter(self, entry: Entry, reason: str) -> None:
        """Copy ``entry`` to the dead-letter stream with why and from where, then acknowledge it."""
        logger.warning("trace entry %s to %s: %s", entry.id, self.dead_stream, reason)
        fields = {**entry.fields, "dead_reason": reason, "dead_source_id": entry.id,
                  "dead_deliveries": str(entry.deliveries)}
        self.client.xadd(self.dead_stream, fields, maxlen=self.dead_maxlen, approximate=True)
        self.client.xack(self.stream, self.group, entry.id)

    # ------------------------------------------------------------------ internals
    def _claim(self, count: int, held: Collection[str]) -> list[tuple[str, dict | None]]:
        if held:
            self.client.xclaim(self.stream, self.group, self.consumer, 0, list(held), justid=True)
        entries: list[tuple[str, dict | None]] = []
        start = "0-0"
        while len(entries) < count:
            cursor, claimed, _deleted = self.client.xautoclaim(
                self.stream, self.group, self.consumer, self.claim_idle_ms, start, count=count - len(entries))
            entries.extend((i, f) for i, f in claimed if i not in held)
            if cursor == "0-0":
                break
            start = cursor
        if entries:
            logger.info("trace stream: reclaimed %d entries idle for over %d ms", len(entries), self.claim_idle_ms)
        return entries

    def _screen(self, raw: list[tuple[str, dict | None]], *, counted: bool) -> list[Entry]:
        """Entries with their delivery counts; trimmed ones acknowledged, over-delivered ones dead-lettered."""
        deliveries = self._deliveries([i for i, _ in raw]) if counted else {}
        out = []
        for entry_id, fields in raw:
            if not fields:
                logger.warning("trace entry %s was trimmed from %s while pending: acknowledged", entry_id, self.stream)
                self.ack([entry_id])
                continue
            entry = Entry(id=entry_id, fields=dict(fields), deliveries=deliveries.get(entry_id, 1))
            if entry.deliveries > self.max_deliveries:
                self.dead_letter(entry, f"delivered {entry.deliveries} times (max_deliveries {self.max_deliveries}): "
                                        "it keeps coming back unacknowledged and may be what stops the trainer")
                continue
            out.append(entry)
        return out

    def _deliveries(self, ids: list[str]) -> dict[str, int]:
        """Delivery count of each id (one pipelined XPENDING per id: only reclaimed and backlog entries)."""
        pipeline = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipeline.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        return {p["message_id"]: int(p["times_delivered"]) for reply in pipeline.execute() for p in reply}
