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
"""

from __future__ import annotations

import asyncio
import hmac
import json
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

from specd.data.tokenizer import format_chat
from specd.sampling import SamplingParams
from specd.serving import ContextTooLong, RequestStream, ServingEngine

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "build_app",
    "serve_http",
]

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""


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
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extension: token ids that end generation, besides the model's own stop tokens."""
    ignore_eos: bool = False
    """Extension: do not stop at the model's own stop tokens."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant"]
    content: str


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


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if "" in strings:
        raise APIError(400, "stop strings must not be empty: remove the empty string from stop", param="stop")
    return strings


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
    held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n], start, end)), default=0)
    return max(start, end - held)


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
        self, engine: ServingEngine, tokenizer: Tokenizer, model_name: str, default_stop_token_ids: Sequence[int]
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_stop_token_ids = tuple(default_stop_token_ids)
        self.created = int(time.time())

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
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise APIError(
                    400, f"one prompt per request, got {len(prompt)}: send one request per prompt "
                    "(the server batches concurrent requests)", param="prompt",
                )
            (prompt,) = prompt
        prompt_ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else prompt
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
        try:
            text = format_chat([{"role": m.role, "content": m.content} for m in body.messages],
                               add_generation_prompt=True)
        except ValueError as error:
            raise APIError(400, f"{error}: remove it from the message content", param="messages") from error
        prompt_ids = self.tokenizer.encode(text).ids
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

    def _submit(self, body: _GenerationRequest, request_id: str, prompt_ids: Sequence[int], max_tokens: int) -> _Run:
        """Build the sampling params and queue the request; 400/503 for what the engine refuses."""
        stop = _stop_strings(body.stop)
        stop_token_ids = (() if body.ignore_eos else self.default_stop_token_ids) + tuple(body.stop_token_ids)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k in (None, -1) else body.top_k,  # -1 = off, vLLM's convention
                seed=body.seed,
                stop_token_ids=tuple(dict.fromkeys(stop_token_ids)),
            )
            stream = self.engine.submit(prompt_ids, params, request_id=request_id)
        except ContextTooLong as error:
            raise APIError(400, str(error), code="context_length_exceeded") from error
        except ValueError as error:
            raise APIError(400, str(error)) from error
        except RuntimeError as error:  # the engine is shutting down
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
) -> FastAPI:
    """The OpenAI-compatible API of ``engine`` (module docstring).

    ``model_name`` is the only model clients may name; ``is_ready`` gates generation and
    ``/health`` (False while loading weights or draining); ``registry`` is what ``/metrics``
    exposes; ``default_stop_token_ids`` are the model's stop tokens (e.g. ``<|im_end|>``).
    """
    server = _OpenAIServer(engine, tokenizer, model_name, default_stop_token_ids)

    async def ready() -> None:
        if not is_ready():
            raise _not_ready()

    app = FastAPI(title="specd verifier", summary="OpenAI-compatible API with lossless speculative decoding")
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorization(auth_token))] if auth_token else [])
    v1.add_api_route("/models", server.models, methods=["GET"])
    v1.add_api_route("/completions", server.completions, methods=["POST"], dependencies=[Depends(ready)])
    v1.add_api_route("/chat/completions", server.chat_completions, methods=["POST"], dependencies=[Depends(ready)])
    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not is_ready():
            return _not_ready().response()
        return Response(status_code=200)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return app


def serve_http(
    app: FastAPI, host: str, port: int, *, startup_timeout_s: float = 30.0
) -> tuple[uvicorn.Server, threading.Thread]:
    """Serve ``app`` with uvicorn in a daemon thread; return once it accepts connections.

    Stop it with ``server.should_exit = True`` and ``thread.join()``: uvicorn then stops
    accepting, lets open responses finish, and returns. With ``port`` 0 the bound port is
    ``server.servers[0].sockets[0].getsockname()[1]``.
    """
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="specd-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        thread.join(timeout=0.01)  # returns at once if the server thread died
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server failed to start on {host}:{port} (is the port taken? see the log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the HTTP server did not start on {host}:{port} within {startup_timeout_s} s")
    return server, thread
