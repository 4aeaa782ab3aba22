"""What a chaos run records: each request as its client saw it, each fault as it was injected,
and what the services' own records said at the start and at the end (`Observations`). The
checker (`services.chaos.check`) reads only these, so it runs on synthetic records too.

Times are seconds since the run's load began (`time.monotonic()` relative to one origin).
"""

from __future__ import annotations

from dataclasses import dataclass, field

OK = "ok"
"""A request's status when it completed (HTTP 200, gRPC OK)."""
GREEDY, SAMPLED, BAD, CANCEL = "greedy", "sampled", "bad", "cancel"
"""Request kinds: well-formed greedy or seeded sampled ones, bad ones (a burst), and ones whose
client is told to go away mid-stream."""


@dataclass(kw_only=True, slots=True)
class RequestRecord:
    index: int = 0
    """Its position in the run's list of requests."""
    stream: int
    """The client stream that sent it (-1: the fault injector)."""
    kind: str
    """`GREEDY`, `SAMPLED`, `BAD` or `CANCEL`."""
    transport: str
    """"http" (one JSON answer), "http-stream" (SSE) or "grpc" (Generate)."""
    prompt: str
    """"chat" (messages rendered by the server's chat template) or "ids" (token ids)."""
    message: str = ""
    """A chat prompt's user message (what is sent over HTTP)."""
    prompt_ids: list[int] = field(default_factory=list)
    """The ids the target sees (a chat prompt rendered and tokenised here, as the server does)."""
    params: dict = field(default_factory=dict)
    """max_tokens, temperature, top_k, top_p, seed: the values as the server parses them (gRPC's
    floats are float32)."""
    start: float = 0.0
    end: float = 0.0
    status: str = OK
    """`OK`, the HTTP status ("400") or the gRPC code's name ("INVALID_ARGUMENT")."""
    expected: tuple[str, ...] = (OK,)
    """The statuses it may end with: a bad request's documented status."""
    bad: str = ""
    """For a bad request: what is wrong with it ("vocab", "max_tokens", "oversized", "token")."""
    tokens: list[int] = field(default_factory=list)
    """The output ids (gRPC)."""
    text: str = ""
    """The output text (HTTP)."""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = ""
    cancelled: bool = False
    """Its client went away before the end (a `CANCEL` request that had not finished yet)."""
    error: str = ""

    @property
    def well_formed(self) -> bool:
        return self.kind != BAD

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass(kw_only=True, slots=True)
class FaultRecord:
    kind: str
    target: str = ""
    """The service it hit ("" for the client-side faults)."""
    at: float = 0.0
    end: float = 0.0
    detail: dict = field(default_factory=dict)
    """What happened, in figures (e.g. ``refused_by``, ``window_seconds``, the statuses of a burst)."""
    skipped: str = ""
    """Why it could not be injected ("" when it was)."""


@dataclass(kw_only=True, slots=True)
class Reference:
    """What in-process plain decoding produced for one request."""

    tokens: list[int]
    text: str
    """``tokenizer.decode`` of the tokens the API shows (a final stop token is not text)."""


@dataclass(kw_only=True, slots=True)
class Ledger:
    """One checkpoint's trace ids (`specd.train.online.LedgerEntry`'s fields the checker reads)."""

    checkpoint: int
    trained: list[str]
    heldout: list[str]


@dataclass(kw_only=True)
class Observations:
    """The services' own records at the start of the load and after it drained."""

    kills: dict[str, int] = field(default_factory=dict)
    """Service name -> times the run killed it (kill -9)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Service name -> ``Service.restarts`` at the end."""
    verifier_before: dict[str, float] = field(default_factory=dict)
    verifier_after: dict[str, float] = field(default_factory=dict)
    drafters_before: dict[str, dict[str, float]] = field(default_factory=dict)
    drafters_after: dict[str, dict[str, float]] = field(default_factory=dict)
    stream_length_before: int = 0
    stream_entries: list[tuple[str, str]] = field(default_factory=list)
    """Every entry of the trace stream at the end: (entry id, trace id)."""
    last_delivered: str = "0-0"
    """The consumer group's last delivered entry id."""
    pending: list[str] = field(default_factory=list)
    """Entry ids delivered to the group and not acknowledged."""
    dead_sources: list[str] = field(default_factory=list)
    """Entry ids the trainer sent to the dead-letter stream."""
    ledger: list[Ledger] = field(default_factory=list)
    rss_start: dict[str, int] = field(default_factory=dict)
    """Service name -> VmRSS in bytes when the load began."""
    rss_end: dict[str, int] = field(default_factory=dict)
    rss_samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    """(seconds, service name -> VmRSS) after each fault: the trend between start and end."""
