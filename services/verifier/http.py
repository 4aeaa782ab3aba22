"""The verifier's OpenAI-compatible HTTP API over a `specd.serving.ServingEngine`.

What a vLLM user expects, on FastAPI + uvicorn:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, with SSE streaming
  (``text/event-stream``, one ``data: <json>`` event per chunk, then ``data: [DONE]``);
- ``GET /v1/models`` (one model, ``owned_by`` "specd", with ``max_model_len``);
- ``GET /health`` (200 when ``is_ready()``, else 503) and ``GET /metrics`` (Prometheus exposition).

Design choices:

- **One prompt, one choice per request.** ``n`` must be 1 and a batch of prompts is refused: the
  engine batches concurrent requests itself, so a client sends N requests instead. A list holding
  a single prompt is that prompt.
- **Defaults as in OpenAI / vLLM**: temperature 1.0; ``max_tokens`` 16 for completions and the rest
  of the context for chat. ``top_k`` (0 or -1 = off), ``stop_token_ids`` and ``ignore_eos`` are
  vLLM's extensions, with vLLM's meaning.
- **Stopping.** The model's stop tokens (``default_stop_token_ids``, e.g. ``<|im_end|>`` and
  ``<|endoftext|>``) end every request unless ``ignore_eos``; ``stop_token_ids`` adds more. The stop
  token is counted in ``usage`` but is not part of the text. A stop string is cut from the text
  (it is not included) and the engine request is cancelled as soon as the string is seen.
- **Text** is ``tokenizer.decode(output, skip_special_tokens=True)`` of the whole output so far;
  a stream sends the new suffix each time, holding back a trailing U+FFFD (an incomplete UTF-8
  sequence the next token may complete) and any tail that may still grow into a stop string. So
  the concatenated stream is always exactly the non-streamed text.
- **Errors** have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: bad input
  (including malformed JSON and schema violations, which FastAPI would answer with 422) is 400
  ``invalid_request_error`` (``model_not_found``, ``context_length_exceeded`` codes where they
  apply); a missing or wrong bearer token is 401 ``authentication_error`` (``/health`` and
  ``/metrics`` are exempt: probes and scrapers carry no token); a server that is not ready or is
  draining answers 503. An error after a stream has started is sent as a last ``data:`` event with
  that body (the OpenAI client raises it), then ``[DONE]``.
- **A client that goes away cancels its request**, streaming or not, so the engine's rows are not
  spent on output nobody reads.
- **Parameters a client sends are applied or refused, never silently ignored.** The penalties
  (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``), ``logit_bias``,
  ``min_tokens`` and ``min_p`` shape the target distribution before verification, so speculation
  stays lossless with respect to the processed distribution (as in vLLM). Fields that would change
  the output in ways this server cannot honour (``tools``, ``response_format`` other than text,
  vLLM's ``guided_*``, ``logprobs``, ``echo``, ...) are refused with a 400 that names them. Other
  unknown fields (``user``, ``metadata``, ...) are accepted and ignored, as vLLM does. Every value
  goes through `SamplingParams`: one rule set for HTTP and gRPC.
- **Chat content** is a string or a list of ``{"type": "text"}`` parts (joined); roles are
  ``system``, ``developer`` (rendered as ``system``, as OpenAI maps it for models without a
  developer role), ``user``, ``assistant`` and ``tool``.
- **Hostile input costs its sender, not the server**: a body above ``max_request_bytes`` is 413
  before it is parsed; stop strings are bounded in count and length; text that is not valid
  Unicode (a lone UTF-16 surrogate) is a 400; tokenisation runs off the event loop, so a long
  prompt never stalls ``/health`` or other streams; a full queue is 429 with ``Retry-After``; an
  unexpected failure is a 500 with OpenAI's body, never plain text. With an auth token set, the
  interactive docs and ``/openapi.json`` are not served (they describe the API to anyone).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import prometheus_client
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from specd.data.chat import ChatTemplate
from specd.sampling import SamplingParams
from specd.serving import ContextTooLong, EngineStopped, QueueFull, RequestStream, ServingEngine

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "build_app",
    "serve_http",
]

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""

DEFAULT_MAX_REQUEST_BYTES = 2 << 20
"""Largest request body: a prompt that fills a 32k-token context is a few hundred KB of JSON."""

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024

REFUSED_FIELDS: dict[str, str] = {
    "tools": "tool calling", "tool_choice": "tool calling", "functions": "function calling",
    "function_call": "function calling", "parallel_tool_calls": "tool calling",
    "guided_json": "guided decoding", "guided_regex": "guided decoding", "guided_choice": "guided decoding",
    "guided_grammar": "guided decoding", "structured_outputs": "structured outputs",
    "use_beam_search": "beam search", "prompt_logprobs": "prompt log-probabilities",
    "bad_words": "bad_words", "allowed_token_ids": "allowed_token_ids",
    "truncate_prompt_tokens": "prompt truncation", "logits_processors": "custom logits processors",
    "audio": "audio output", "include_stop_str_in_output": "stop strings in the output",
}
"""Fields that change the output and that this server cannot honour, with what they ask for.
A value that asks for nothing (null, false, an empty list, ``tool_choice`` "none") is accepted."""


# ---------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error the client gets as OpenAI's error body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _not_ready() -> APIError:
    return APIError(
        503,
        "the server is not ready (loading weights) or is draining: retry later or on another replica",
        type="server_error", code="service_unavailable", headers={"Retry-After": "1"},
    )


async def _api_error_handler(request: Request, error: APIError) -> JSONResponse:
    return error.response()


async def _validation_error_handler(request: Request, error: RequestValidationError) -> JSONResponse:
    # FastAPI answers these with 422 and its own body; OpenAI clients expect 400 and OpenAI's.
    problems, params = [], []
    for item in error.errors():
        if item["type"] == "json_invalid":  # its loc is a character offset, not a field
            problems.append(f"the body is not valid JSON ({(item.get('ctx') or {}).get('error', item['msg'])})")
            continue
        field = ".".join(str(part) for part in item["loc"][1:])  # loc[0] is "body"
        params.append(field)
        problems.append(f"{field or 'body'}: {item['msg']}")
    message = f"invalid request: {'; '.join(problems)}; see the OpenAI API reference for this endpoint"
    return APIError(400, message, param=params[0] if params else None).response()


async def _unexpected_error_handler(request: Request, error: Exception) -> JSONResponse:
    # A bug, not the client's doing: OpenAI's body (clients parse it), the traceback in the log.
    logger.error("unexpected error in %s %s", request.method, request.url.path, exc_info=error)
    return APIError(500, f"internal error ({type(error).__name__}): the server goes on serving; retry the request, "
                         "and report it if it fails again", type="server_error").response()


class _BodyLimit:
    """ASGI middleware: a request body above ``max_bytes`` is answered 413 before it is parsed,
    whether it announces its length (Content-Length) or streams it (chunked).

    The rest of the body is read and dropped before answering, up to ``drain_bytes``: a client
    that writes its whole body before reading (most do) would otherwise see a broken pipe instead
    of the 413. Past that (or announced past it) the answer comes at once and the connection
    closes.
    """

    def __init__(self, app, max_bytes: int, drain_bytes: int = 64 << 20) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= self.drain_bytes:
                await self._drain(receive, 0)
            return await self._refuse(send)
        seen, refused = 0, False

        async def limited():
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Answer now; the app then sees a client that went away, and what it would
                    # send is dropped (FastAPI turns any error raised while reading into a 400).
                    refused = True
                    if message.get("more_body", False):
                        await self._drain(receive, seen)
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited, guarded_send)

    async def _drain(self, receive, seen: int) -> None:
        while seen <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _refuse(self, send) -> None:
        error = APIError(413, f"the request body is above the limit of {self.max_bytes} bytes: send a shorter "
                              "prompt (the model's context bounds it anyway)", code="request_too_large")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def _http_error_handler(request: Request, error: StarletteHTTPException) -> JSONResponse:
    message = (
        f"{error.detail}: {request.method} {request.url.path}; this server answers POST /v1/completions, "
        "POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics"
    )
    return APIError(error.status_code, message, headers=error.headers).response()


# ---------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    """Send a last chunk with ``usage`` (and ``"usage": null`` on every other chunk)."""


class _GenerationRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are accepted and ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """Extension: keep the k most likely tokens (0 or -1 = all)."""
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    """Extension (vLLM's): CTRL's penalty on tokens of the prompt and output (1 = off)."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, as JSON keys are) -> bias added to its logit, in [-100, 100]."""
    min_tokens: int | None = None
    """Extension (vLLM's): stop tokens are not emitted before this many tokens."""
    min_p: float | None = None
    """Extension (vLLM's): drop tokens below min_p times the most likely one's probability."""
    response_format: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extension: token ids that end generation, besides the model's own stop tokens."""
    ignore_eos: bool = False
    """Extension: do not stop at the model's own stop tokens."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    store: bool | None = None
    """OpenAI's field, read as the trainer's consent: false keeps this request out of the trace
    stream the drafter is distilled from (evaluations, private traffic); absent or true, it is
    traced like all live traffic (this server's default, unlike OpenAI's)."""


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    """Text, or text parts (joined); None only where OpenAI allows it (an assistant turn)."""

    def text(self, index: int) -> str:
        """The message's text; 400 for content this text-only model cannot read."""
        where = f"messages.{index}.content"
        if self.content is None:
            if self.role != "assistant":
                raise APIError(400, f"{where} is missing: a {self.role} message needs content", param=where)
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise APIError(400, f"{where}.{j}: content parts of type {part.type!r} are not supported: this "
                                    "model reads text only (send {\"type\": \"text\", \"text\": ...} parts)",
                               param=f"{where}.{j}")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    """OpenAI's newer name for ``max_tokens``; wins when both are given."""
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _reject_unsupported(unsupported: dict[str, bool]) -> None:
    """400 for the first field whose value this server cannot honour (``{name: is_set}``)."""
    for name, is_set in unsupported.items():
        if is_set:
            raise APIError(400, f"{name} is not supported by this server: remove it from the request", param=name)


def _check_n(n: int | None) -> None:
    if n not in (None, 1):
        raise APIError(
            400, f"n must be 1 (one choice per request), got {n}: send {n} requests instead", param="n"
        )


def _reject_refused(body: BaseModel) -> None:
    """400 for a field in `REFUSED_FIELDS` (among the request's unknown fields) that asks for
    something, and for a ``response_format`` other than text."""
    extra = body.model_extra or {}
    for name, what in REFUSED_FIELDS.items():
        value = extra.get(name)
        if value in (None, False, [], {}, "none") :
            continue
        raise APIError(400, f"{name}: {what} is not supported by this server: remove {name} from the request",
                       param=name)
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.get("type", "text") != "text":
        raise APIError(400, f"response_format {response_format.get('type')!r} is not supported by this server "
                            "(structured output is not implemented): remove response_format or use {\"type\": \"text\"}",
                       param="response_format")


def _check_text(text: str, param: str) -> None:
    """400 for text that is not valid Unicode (a lone UTF-16 surrogate, which JSON can carry as
    an escape but no tokenizer can read)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = ord(text[error.start])
        raise APIError(400, f"{param} is not valid Unicode: a lone surrogate U+{bad:04X} at character "
                            f"{error.start} (send UTF-8 text; surrogates must come in pairs)", param=param) from None


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if "" in strings:
        raise APIError(400, "stop strings must not be empty: remove the empty string from stop", param="stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise APIError(400, f"{len(strings)} stop strings, above the limit of {MAX_STOP_STRINGS}: send fewer",
                       param="stop")
    for string in strings:
        if len(string) > MAX_STOP_CHARS:
            raise APIError(400, f"a stop string of {len(string)} characters is above the limit of {MAX_STOP_CHARS}: "
                                "send shorter stop strings", param="stop")
        _check_text(string, "stop")
    return strings


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON's string keys -> token ids; 400 for a key that is not one."""
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        try:
            parsed[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                           param="logit_bias") from None
    return parsed


# ---------------------------------------------------------------------------- one request
@dataclass(kw_only=True, slots=True)
class _Run:
    """One submitted request as this API sees it."""

    id: str
    created: int
    model: str
    num_prompt_tokens: int
    stream: RequestStream
    stop: tuple[str, ...]
    include_usage: bool
    num_completion_tokens: int = 0

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
        }

    def chunk(self, object: str, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        chunk = {"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return chunk


def _find_stop(text: str, stop: Sequence[str], start: int) -> int | None:
    """Where the first stop string in ``text[start:]`` begins, or None."""
    return min((i for i in (text.find(s, start) for s in stop) if i >= 0), default=None)


def _stable_end(text: str, stop: Sequence[str], start: int) -> int:
    """How much of an unfinished output's ``text`` may be sent (``text[:start]`` was).

    Not a trailing U+FFFD: it stands for an incomplete UTF-8 sequence that the next token may
    complete into another character. Not a tail that is the beginning of a stop string either:
    the next token may complete the string, which must then never have been sent.
    """
    end = len(text.rstrip("\ufffd"))
    return max(start, end - max((_held(text, s, start, end) for s in stop), default=0))


def _held(text: str, stop: str, start: int, end: int) -> int:
    """The length of the longest tail of ``text[start:end]`` that is a proper prefix of ``stop``.

    Only the places where ``stop``'s first character occurs are tried (leftmost first, so the
    first match is the longest): linear in the tail, not quadratic in the stop string.
    """
    lo = max(start, end - len(stop) + 1)
    i = text.find(stop[0], lo, end)
    while i >= 0:
        if stop.startswith(text[i:end]):
            return end - i
        i = text.find(stop[0], i + 1, end)
    return 0


async def _wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events of ``chunks``; an error mid-stream becomes a last ``error`` event."""
    try:
        async for chunk in chunks:
            yield format_sse_event(data_str=json.dumps(chunk))
    except APIError as error:
        yield format_sse_event(data_str=json.dumps(error.body()))
    yield format_sse_event(data_str="[DONE]")


class _OpenAIServer:
    """The route handlers; `build_app` wires them up."""

    def __init__(
        self, engine: ServingEngine, tokenizer: Tokenizer, model_name: str, default_stop_token_ids: Sequence[int],
        chat_template: ChatTemplate,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_name = model_name
        self.default_stop_token_ids = tuple(default_stop_token_ids)
        self.created = int(time.time())
        # The most characters one token stands for: a bound on how long a prompt that fits can be.
        self.max_token_chars = max(len(token) for token in tokenizer.get_vocab())

    # ------------------------------------------------------------------ routes
    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "specd",
            "max_model_len": self.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        _check_n(body.n)
        _reject_unsupported({
            "echo": bool(body.echo), "logprobs": body.logprobs is not None,
            "best_of": body.best_of not in (None, 1), "suffix": body.suffix is not None,
        })
        _reject_refused(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise APIError(
                    400, f"one prompt per request, got {len(prompt)}: send one request per prompt "
                    "(the server batches concurrent requests)", param="prompt",
                )
            (prompt,) = prompt
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            prompt_ids = await self._encode(prompt)
        else:
            prompt_ids = prompt
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        run = self._submit(body, f"cmpl-{uuid.uuid4().hex}", prompt_ids, max_tokens)
        if body.stream:
            return EventSourceResponse(_sse(self._completion_chunks(run)))
        text, finish_reason = await self._collect(request, run)
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return JSONResponse({
            "id": run.id, "object": "text_completion", "created": run.created, "model": run.model,
            "choices": [choice], "usage": run.usage(),
        })

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        _check_n(body.n)
        _reject_unsupported({"logprobs": bool(body.logprobs), "top_logprobs": body.top_logprobs is not None})
        _reject_refused(body)
        messages = []
        for i, message in enumerate(body.messages):
            content = message.text(i)
            _check_text(content, f"messages.{i}.content")
            messages.append({"role": "system" if message.role == "developer" else message.role, "content": content})
        try:
            text = self.chat_template.render(messages, add_generation_prompt=True)
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error
        prompt_ids = await self._encode(text)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            # As vLLM: the rest of the context (at least 1, so a prompt that fills it all is refused
            # as too long rather than for asking for no tokens).
            max_tokens = max(1, self.engine.max_model_len - len(prompt_ids))
        run = self._submit(body, f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, max_tokens)
        if body.stream:
            return EventSourceResponse(_sse(self._chat_chunks(run)))
        text, finish_reason = await self._collect(request, run)
        choice = {
            "index": 0, "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason, "logprobs": None,
        }
        return JSONResponse({
            "id": run.id, "object": "chat.completion", "created": run.created, "model": run.model,
            "choices": [choice], "usage": run.usage(),
        })

    # ------------------------------------------------------------------ shared steps
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                400, f"the model {model!r} does not exist: this server serves {self.model_name!r} (GET /v1/models)",
                code="model_not_found", param="model",
            )

    async def _encode(self, text: str) -> list[int]:
        """Token ids of ``text``, on a worker thread: a long prompt must not stall the event loop.

        ``encode_batch`` rather than ``encode``: only the batch call lets go of the GIL while it
        works. A text so long that even the longest tokens could not fit it into the context is
        refused before it is tokenised at all.
        """
        if len(text) > self.max_token_chars * self.engine.max_model_len:
            raise APIError(400, f"the prompt has {len(text)} characters: it cannot fit in this model's context of "
                                f"{self.engine.max_model_len} tokens; shorten it", code="context_length_exceeded")
        return (await asyncio.to_thread(self.tokenizer.encode_batch, [text]))[0].ids

    def _params(self, body: _GenerationRequest, max_tokens: int) -> SamplingParams:
        """The request's `SamplingParams` (the one rule set HTTP and gRPC share); 400 naming the
        field for a value out of range."""
        stop_token_ids = (() if body.ignore_eos else self.default_stop_token_ids) + tuple(body.stop_token_ids)
        optional = lambda value, default: default if value is None else value  # noqa: E731
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=optional(body.temperature, 1.0),
                top_p=optional(body.top_p, 1.0),
                top_k=0 if body.top_k in (None, -1) else body.top_k,  # -1 = off, vLLM's convention
                min_p=optional(body.min_p, 0.0),
                seed=body.seed,
                stop_token_ids=tuple(dict.fromkeys(stop_token_ids)),
                min_tokens=optional(body.min_tokens, 0),
                presence_penalty=optional(body.presence_penalty, 0.0),
                frequency_penalty=optional(body.frequency_penalty, 0.0),
                repetition_penalty=optional(body.repetition_penalty, 1.0),
                logit_bias=_logit_bias(body.logit_bias),
            )
        except ValueError as error:
            raise APIError(400, str(error), param=str(error).split(" ", 1)[0]) from error

    def _submit(self, body: _GenerationRequest, request_id: str, prompt_ids: Sequence[int], max_tokens: int) -> _Run:
        """Build the sampling params and queue the request; 400/429/503 for what the engine refuses."""
        stop = _stop_strings(body.stop)
        params = self._params(body, max_tokens)
        try:
            stream = self.engine.submit(prompt_ids, params, request_id=request_id, store=body.store is not False)
        except ContextTooLong as error:
            raise APIError(400, str(error), code="context_length_exceeded") from error
        except ValueError as error:
            raise APIError(400, str(error)) from error
        except QueueFull as error:
            raise APIError(429, str(error), type="server_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from error
        except EngineStopped as error:  # shutting down, or the engine died
            raise _not_ready() from error
        return _Run(
            id=request_id, created=int(time.time()), model=self.model_name, num_prompt_tokens=len(prompt_ids),
            stream=stream, stop=stop,
            include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        )

    async def _texts(self, run: _Run) -> AsyncIterator[tuple[str, str | None]]:
        """``(new text, finish_reason)`` per engine delta; finish_reason is None until the last.

        Stopping early (a stop string, or the consumer going away) cancels the engine request.
        """
        token_ids: list[int] = []
        num_sent = 0  # characters of the text already yielded
        try:
            async for delta in run.stream:
                if delta.finish_reason == "abort":  # not ours: we stop reading once we cancel
                    raise _not_ready()
                if delta.finish_reason == "error":  # this request alone failed in the engine
                    raise APIError(500, f"the request failed in the engine: {delta.error}; the server goes on "
                                        "serving: retry it, and report it if it fails again", type="server_error")
                token_ids += delta.token_ids
                run.num_completion_tokens = len(token_ids)
                finish_reason = delta.finish_reason
                # "stop" means the last token is a stop token: counted, but not text.
                visible = token_ids[:-1] if finish_reason == "stop" else token_ids
                text = self.tokenizer.decode(visible, skip_special_tokens=True)
                cut = _find_stop(text, run.stop, num_sent)
                if cut is not None:
                    text, finish_reason = text[:cut], "stop"
                end = len(text) if finish_reason else _stable_end(text, run.stop, num_sent)
                yield text[num_sent:end], finish_reason
                num_sent = end
                if finish_reason:
                    return
        except RuntimeError as error:  # the engine loop failed while this request was open
            raise APIError(500, f"{error}: retry the request", type="server_error") from error
        finally:
            run.stream.cancel()  # a no-op once the engine has finished the request

    async def _collect(self, request: Request, run: _Run) -> tuple[str, str]:
        """The whole text and finish reason, unless the client goes away first (then cancelled)."""

        async def collect() -> tuple[str, str]:
            parts, finish_reason = [], ""
            async for text, finish_reason in self._texts(run):
                parts.append(text)
            return "".join(parts), finish_reason

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():
            run.stream.cancel()
            work.cancel()
            # Nobody reads the answer; 499 is nginx's "client closed request", for the access log.
            raise APIError(499, "the client closed the connection before the response was ready")
        return work.result()

    async def _completion_chunks(self, run: _Run) -> AsyncIterator[dict]:
        async for text, finish_reason in self._texts(run):
            if text or finish_reason:
                choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
                yield run.chunk("text_completion", [choice])
        if run.include_usage:
            yield run.chunk("text_completion", [], usage=run.usage())

    async def _chat_chunks(self, run: _Run) -> AsyncIterator[dict]:
        def choice(delta: dict, finish_reason: str | None = None) -> list[dict]:
            return [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]

        yield run.chunk("chat.completion.chunk", choice({"role": "assistant", "content": ""}))
        async for text, finish_reason in self._texts(run):
            if text:
                yield run.chunk("chat.completion.chunk", choice({"content": text}))
            if finish_reason:
                yield run.chunk("chat.completion.chunk", choice({}, finish_reason))
        if run.include_usage:
            yield run.chunk("chat.completion.chunk", [], usage=run.usage())


# ---------------------------------------------------------------------------- the app
_bearer = HTTPBearer(auto_error=False)


def _authorization(auth_token: str) -> Callable:
    """A dependency that refuses requests without ``Authorization: Bearer <auth_token>``."""
    expected = auth_token.encode()

    async def authorize(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        if credentials is None:
            problem = (
                "missing bearer token: send the header 'Authorization: Bearer <token>' (the OpenAI client's api_key)"
            )
        elif not hmac.compare_digest(credentials.credentials.encode(), expected):
            problem = "wrong bearer token: 'Authorization: Bearer <token>' must carry this server's auth token"
        else:
            return
        raise APIError(
            401, problem, type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )

    return authorize


def build_app(
    engine: ServingEngine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    auth_token: str = "",
    is_ready: Callable[[], bool] = lambda: True,
    registry: prometheus_client.CollectorRegistry = prometheus_client.REGISTRY,
    default_stop_token_ids: Sequence[int] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    chat_template: ChatTemplate | None = None,
) -> FastAPI:
    """The OpenAI-compatible API of ``engine`` (module docstring).

    ``model_name`` is the only model clients may name; ``is_ready`` gates generation and
    ``/health`` (False while loading weights or draining; a dead engine is never ready);
    ``registry`` is what ``/metrics`` exposes; ``default_stop_token_ids`` are the model's stop
    tokens (e.g. ``<|im_end|>``); ``max_request_bytes`` bounds a request body; ``chat_template``
    renders chat messages (default: the zoo's format).
    """
    server = _OpenAIServer(engine, tokenizer, model_name, default_stop_token_ids, chat_template or ChatTemplate())

    def serving() -> bool:
        return engine.alive and is_ready()

    async def ready() -> None:
        if not serving():
            raise _not_ready()

    # The docs describe every route to whoever asks: not without the token that guards them.
    docs = {} if not auth_token else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="specd verifier", summary="OpenAI-compatible API with lossless speculative decoding", **docs)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorization(auth_token))] if auth_token else [])
    v1.add_api_route("/models", server.models, methods=["GET"])
    v1.add_api_route("/completions", server.completions, methods=["POST"], dependencies=[Depends(ready)])
    v1.add_api_route("/chat/completions", server.chat_completions, methods=["POST"], dependencies=[Depends(ready)])
    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not serving():
            return _not_ready().response()
        return Response(status_code=200)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return app


def serve_http(
    app: FastAPI, host: str, port: int, *, startup_timeout_seconds: float = 30.0
) -> tuple[uvicorn.Server, threading.Thread]:
    """Serve ``app`` with uvicorn in a daemon thread; return once it accepts connections.

    Stop it with ``server.should_exit = True`` and ``thread.join()``: uvicorn then stops
    accepting, lets open responses finish, and returns. With ``port`` 0 the bound port is
    ``server.servers[0].sockets[0].getsockname()[1]``.
    """
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="specd-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_seconds
    while not server.started:
        thread.join(timeout=0.01)  # returns at once if the server thread died
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server failed to start on {host}:{port} (is the port taken? see the log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the HTTP server did not start on {host}:{port} within {startup_timeout_seconds} s")
    return server, thread
