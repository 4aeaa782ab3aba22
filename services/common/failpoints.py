"""Failpoints: named places in a service where a fault test may hold the process still.

A chaos run needs to kill a service *inside* a window that is otherwise microseconds long (the
trainer between saving its checkpoint and acknowledging the traces in it). A failpoint widens the
window on request, and says when the process is in it, so the run can act there:

    SPECD_FAILPOINTS="trainer.after_checkpoint=sleep(5)"   # comma-separated name=sleep(SECONDS)
    SPECD_FAILPOINT_LOG=/tmp/failpoints.jsonl             # optional: one JSON line per hit

When ``name`` is listed, `failpoint` appends ``{"name", "pid", "time"}`` to the log (written and
closed before the sleep starts, so a reader that sees the line may ``kill -9`` the pid and know it
died inside the window), logs a warning, then sleeps. Unlisted, it is one environment lookup and a
cached dictionary lookup: nothing measurable. A malformed ``SPECD_FAILPOINTS`` raises
`FailpointError` at the first call (`configured` checks it at start-up, so a service refuses to
start rather than fail at its first checkpoint).

Design choices: the only action is ``sleep`` (a kill is the test's job, with the pid the log
gives; a failpoint that killed its own process could not say where it was); the setting is read
from the environment at each call and parsed once per distinct value, so a test may change it
without a reload and a service needs no flag for it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import time

logger = logging.getLogger(__name__)

ENVIRONMENT = "SPECD_FAILPOINTS"
"""Which failpoints are active: ``name=sleep(SECONDS)[,name=sleep(SECONDS)...]``."""
LOG_ENVIRONMENT = "SPECD_FAILPOINT_LOG"
"""A file each hit is appended to as one JSON line (unset: no file)."""

_ITEM = re.compile(r"(?P<name>[A-Za-z0-9_.:-]+)=sleep\((?P<seconds>[^()]*)\)")


class FailpointError(ValueError):
    """``SPECD_FAILPOINTS`` does not parse; the message says which item and the expected form."""


@functools.lru_cache(maxsize=8)
def parse(value: str) -> dict[str, float]:
    """``SPECD_FAILPOINTS``'s text -> {name: seconds to sleep}; FailpointError when malformed."""
    points: dict[str, float] = {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        match = _ITEM.fullmatch(item)
        if match is None:
            raise FailpointError(f"{ENVIRONMENT}: cannot parse {item!r}: each item is name=sleep(SECONDS), e.g. "
                                 f"trainer.after_checkpoint=sleep(2.5), items separated by commas (got {value!r})")
        name = match["name"]
        try:
            seconds = float(match["seconds"])
        except ValueError:
            raise FailpointError(f"{ENVIRONMENT}: {item!r}: SECONDS must be a number, got {match['seconds']!r}") from None
        if not math.isfinite(seconds) or seconds < 0:
            raise FailpointError(f"{ENVIRONMENT}: {item!r}: SECONDS must be finite and >= 0, got {seconds}")
        if name in points:
            raise FailpointError(f"{ENVIRONMENT}: failpoint {name!r} is listed twice (got {value!r})")
        points[name] = seconds
    return points


def configured() -> dict[str, float]:
    """The active failpoints of this process ({} when none); FailpointError when malformed."""
    return parse(os.environ.get(ENVIRONMENT, ""))


def failpoint(name: str) -> None:
    """If ``name`` is an active failpoint: record the hit (log file, warning), then sleep."""
    value = os.environ.get(ENVIRONMENT)
    if not value:
        return
    seconds = parse(value).get(name)
    if seconds is None:
        return
    path = os.environ.get(LOG_ENVIRONMENT)
    if path:
        line = json.dumps({"name": name, "pid": os.getpid(), "time": time.time()}) + "\n"
        with open(path, "a", encoding="utf-8") as log:  # closed (flushed) before the sleep begins
            log.write(line)
    logger.warning("failpoint %s: sleeping %.3fs (%s)", name, seconds, ENVIRONMENT)
    time.sleep(seconds)
