"""The chaos run's clients: N closed-loop streams of mixed requests, and what the run reads from
the services (their /metrics pages, their RSS).

Each stream draws its next request from its own seeded generator: a held-out zoo prompt, as
chat messages (the server renders them with the model's chat template) or as token ids; greedy,
or sampled with a seed (temperature 0.8-1.0, some with top-k or top-p); 16-48 new tokens;
through the OpenAI-compatible HTTP API (one JSON answer or an SSE stream) or gRPC ``Generate``.
Every request is recorded as its client saw it (`services.chaos.records.RequestRecord`). The
same `Client` sends the fault injector's requests: ones whose client goes away mid-stream, and
bursts of bad ones.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from services.chaos.records import BAD, CANCEL, GREEDY, OK, SAMPLED, RequestRecord
from services.client import metrics, sse_events
from services.common.config import ServiceConfig
from services.common.server import open_channel
from services.up import Service
from specd import zoo
from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.data import load_tokenizer
from specd.data.chat import ChatTemplate

TRANSPORTS = ("http", "http-stream", "grpc")
MIN_NEW_TOKENS, MAX_NEW_TOKENS = 16, 48
WRONG_TOKEN = "not-the-token"


class PromptPool:
    """The zoo's held-out prompts, every domain interleaved, each as token ids and as a chat
    message, tokenised with the target's own tokenizer and chat template (as the verifier does)."""

    def __init__(self, target: str | Path, max_prompt_tokens: int = 96, max_chat_chars: int = 300) -> None:
        self.tokenizer = load_tokenizer(target)
        self.template = ChatTemplate.from_dir(target)
        per_domain = [[item.prompt for item in items] for items in zoo.heldout().values()]
        texts = [text for group in zip(*per_domain) for text in group]
        if not texts:
            raise ValueError("the zoo has no held-out prompts: run `specd zoo build`")
        self.ids = [self.tokenizer.encode(text).ids[-max_prompt_tokens:] for text in texts]
        # A dialogue prompt that already holds chat markers is no user message: it goes as ids only.
        self.chats, self.chat_ids = [], []
        for text in texts:
            try:
                ids = self.render(text[-max_chat_chars:])
            except ValueError:
                continue
            self.chats.append(text[-max_chat_chars:])
            self.chat_ids.append(ids)

    def render(self, text: str) -> list[int]:
        """The ids the verifier's chat endpoint feeds the target for one user message."""
        rendered = self.template.render([{"role": "user", "content": text}], add_generation_prompt=True)
        return self.tokenizer.encode_batch([rendered])[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def draw(rng: random.Random, pool: PromptPool, sampled_fraction: float, stream: int) -> RequestRecord:
    """One well-formed request (module docstring), not sent yet."""
    chat = rng.random() < 0.5 and bool(pool.chats)
    i = rng.randrange(len(pool.chats if chat else pool.ids))
    transport = rng.choice(TRANSPORTS)
    params = {"max_tokens": rng.randint(MIN_NEW_TOKENS, MAX_NEW_TOKENS), "temperature": 0.0, "top_k": 0,
              "top_p": 1.0, "seed": None}
    kind = GREEDY
    if rng.random() < sampled_fraction:
        kind = SAMPLED
        params |= {"temperature": round(rng.uniform(0.8, 1.0), 2), "seed": rng.randrange(2**31),
                   "top_k": rng.choice((0, 0, 20, 50)), "top_p": rng.choice((1.0, 1.0, 0.9, 0.95))}
    return RequestRecord(stream=stream, kind=kind, transport=transport, prompt="chat" if chat else "ids",
                         message=pool.chats[i] if chat else "", prompt_ids=list(pool.chat_ids[i] if chat else pool.ids[i]),
                         params=params)


def as_float32(value: float) -> float:
    """What a proto ``float`` field carries for ``value``."""
    return float(np.float32(value))


class Recorder:
    """Every request of the run, in the order they were sent (thread-safe)."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self._lock = threading.Lock()

    def add(self, record: RequestRecord) -> RequestRecord:
        with self._lock:
            record.index = len(self.records)
            self.records.append(record)
        return record

    def snapshot(self) -> list[RequestRecord]:
        with self._lock:
            return list(self.records)


class Client:
    """Sends `RequestRecord`s to one verifier over HTTP or gRPC and fills in what came back."""

    def __init__(self, http: str, grpc_address: str, *, token: str, model: str, origin: float,
                 timeout: float = 120.0) -> None:
        self.http, self.token, self.model, self.origin, self.timeout = http, token, model, origin, timeout
        self.channel = open_channel(grpc_address, ServiceConfig(auth_token=token))
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self.wrong_channel = open_channel(grpc_address, ServiceConfig(auth_token=WRONG_TOKEN))
        self.wrong_stub = verifier_pb2_grpc.VerifierStub(self.wrong_channel)

    def close(self) -> None:
        self.channel.close()
        self.wrong_channel.close()

    def now(self) -> float:
        return time.monotonic() - self.origin

    def send(self, record: RequestRecord, *, cancel_after: int = 0, wrong_token: bool = False) -> RequestRecord:
        """Send ``record`` and record the outcome; ``cancel_after`` > 0: go away after that many
        streamed chunks (if it has not finished by then)."""
        if record.transport == "grpc":
            for name in ("temperature", "top_p"):  # the proto's float32, as the server sees it
                record.params[name] = as_float32(record.params[name])
        record.start = self.now()
        try:
            if record.transport == "grpc":
                self._grpc(record, cancel_after, self.wrong_stub if wrong_token else self.stub)
            else:
                self._http(record, cancel_after, WRONG_TOKEN if wrong_token else self.token)
        finally:
            record.end = self.now()
        return record

    # ------------------------------------------------------------------ HTTP
    def _body(self, record: RequestRecord) -> dict:
        p = record.params
        body = {"model": self.model, "max_tokens": p["max_tokens"], "temperature": p["temperature"],
                "top_k": p["top_k"], "top_p": p["top_p"]}
        if p["seed"] is not None:
            body["seed"] = p["seed"]
        if record.prompt == "chat":
            body["messages"] = [{"role": "user", "content": record.message}]
        else:
            body["prompt"] = record.prompt_ids
        if record.transport == "http-stream":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    def _http(self, record: RequestRecord, cancel_after: int, token: str) -> None:
        path = "/v1/chat/completions" if record.prompt == "chat" else "/v1/completions"
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(self._body(record)).encode()
        try:
            response = urllib.request.urlopen(urllib.request.Request(self.http + path, data=data, headers=headers),
                                              timeout=self.timeout)
        except urllib.error.HTTPError as error:
            record.status, record.error = str(error.code), error.read().decode(errors="replace")[:300]
            return
        except OSError as error:  # refused, reset, timed out
            record.status, record.error = "connection", str(error)
            return
        # Leaving the block closes the connection: a cancelled stream's server sees its client go.
        with response:
            try:
                if record.transport == "http":
                    self._answer(record, json.load(response))
                else:
                    self._events(record, response, cancel_after)
            except (OSError, ValueError) as error:  # cut off mid-answer, or not JSON
                record.status, record.error = "connection", str(error)

    @staticmethod
    def _answer(record: RequestRecord, answer: dict) -> None:
        choice = answer["choices"][0]
        record.text = choice["message"]["content"] if "message" in choice else choice["text"]
        record.finish_reason = choice.get("finish_reason") or ""
        record.completion_tokens = answer["usage"]["completion_tokens"]
        record.prompt_tokens = answer["usage"]["prompt_tokens"]

    @staticmethod
    def _events(record: RequestRecord, response, cancel_after: int) -> None:
        chunks = 0
        for event in sse_events(response):
            if event is None:  # [DONE]
                return
            if "error" in event:  # an error after the stream began: its last event
                record.status, record.error = "stream_error", json.dumps(event["error"])[:300]
                return
            if event.get("usage"):
                record.completion_tokens = event["usage"]["completion_tokens"]
                record.prompt_tokens = event["usage"]["prompt_tokens"]
            for choice in event.get("choices", []):
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                record.text += text
                chunks += bool(text)
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
            if cancel_after and chunks >= cancel_after and not record.finish_reason:
                record.cancelled = True
                return
        record.status, record.error = "connection", "the stream ended without [DONE]"

    # ------------------------------------------------------------------ gRPC
    def _grpc(self, record: RequestRecord, cancel_after: int, stub) -> None:
        p = record.params
        params = common_pb2.SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"])
        if p["top_k"]:
            params.top_k = p["top_k"]
        if p["top_p"] < 1.0:
            params.top_p = p["top_p"]
        if p["seed"] is not None:
            params.seed = p["seed"]
        call = stub.Generate(verifier_pb2.GenerateRequest(prompt_token_ids=record.prompt_ids, params=params),
                             timeout=self.timeout)
        messages = 0
        try:
            for message in call:
                record.tokens += message.token_ids
                messages += 1
                if message.finish_reason:
                    record.finish_reason = message.finish_reason
                    record.prompt_tokens = message.usage.prompt_tokens
                    record.completion_tokens = message.usage.completion_tokens
                if cancel_after and messages >= cancel_after and not record.finish_reason:
                    record.cancelled = True
                    call.cancel()
                    return
        except grpc.RpcError as error:
            record.status, record.error = error.code().name, (error.details() or "")[:300]
            return
        if not record.finish_reason:
            record.status, record.error = "incomplete", "the Generate stream ended without a finish reason"
        else:
            record.completion_tokens = record.completion_tokens or len(record.tokens)

    # ------------------------------------------------------------------ the fault injector's requests
    def cancelled(self, pool: PromptPool, rng: random.Random) -> list[RequestRecord]:
        """One HTTP stream and one gRPC stream (greedy, the longest) whose clients go away after
        two chunks; not sent yet."""
        out = []
        for transport in ("http-stream", "grpc"):
            record = draw(rng, pool, 0.0, -1)
            record.kind, record.transport = CANCEL, transport
            record.params["max_tokens"] = MAX_NEW_TOKENS
            out.append(record)
        return out

    def bad(self, vocab_size: int, max_model_len: int) -> list[tuple[RequestRecord, bool]]:
        """A burst of bad requests on both transports, each with its documented status, and
        whether it is sent with a wrong bearer token; not sent yet."""
        out = []
        for transport in ("http", "grpc"):
            invalid = ("INVALID_ARGUMENT",) if transport == "grpc" else ("400",)
            unauthenticated = ("UNAUTHENTICATED",) if transport == "grpc" else ("401",)
            base = {"max_tokens": 8, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None}
            for bad, ids, params, expected, wrong in (
                ("vocab", [1, 2, vocab_size + 7], base, invalid, False),
                ("max_tokens", [1, 2, 3], {**base, "max_tokens": 0}, invalid, False),
                ("max_tokens", [1, 2, 3], {**base, "max_tokens": -1}, invalid, False),
                ("oversized", [1] * (max_model_len + 1), base, invalid, False),
                ("token", [1, 2, 3], base, unauthenticated, True),
            ):
                record = RequestRecord(stream=-1, kind=BAD, transport=transport, prompt="ids", prompt_ids=list(ids),
                                       params=dict(params), bad=bad, expected=expected)
                out.append((record, wrong))
        return out


class Load:
    """``streams`` closed-loop clients sending drawn requests until `stop` (module docstring)."""

    def __init__(self, client: Client, pool: PromptPool, recorder: Recorder, *, streams: int, seed: int,
                 sampled_fraction: float) -> None:
        self.client, self.pool, self.recorder = client, pool, recorder
        self.seed, self.sampled_fraction = seed, sampled_fraction
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._stream, args=(i,), name=f"chaos-stream-{i}", daemon=True)
                         for i in range(streams)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Ask every stream to end after its current request, and wait for them."""
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _stream(self, i: int) -> None:
        rng = random.Random(self.seed * 1_000_003 + i)
        while not self._stop.is_set():
            record = draw(rng, self.pool, self.sampled_fraction, i)
            self.client.send(record)
            self.recorder.add(record)


def completed_latencies(records: Sequence[RequestRecord], since: float = float("-inf")) -> list[float]:
    return [r.latency for r in records if r.well_formed and not r.cancelled and r.status == OK and r.end >= since]


# ---------------------------------------------------------------------- what the run reads from services
_METRICS_LINE = re.compile(r"metrics on :(\d+)/metrics")


def metrics_url(service: Service) -> str:
    """The /metrics base URL a service started with ``--metrics-port 0`` logged (its latest
    start's); "" when it has not logged one yet."""
    found = _METRICS_LINE.findall(service.log.read_text(errors="replace")) if service.log else []
    return f"http://127.0.0.1:{found[-1]}" if found else ""


def read_metrics(base_url: str) -> dict[str, float] | None:
    """A /metrics page's samples, None when it cannot be read (the service is down or restarting)."""
    if not base_url:
        return None
    try:
        return metrics(base_url, timeout=5.0)
    except (OSError, ValueError):
        return None


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
