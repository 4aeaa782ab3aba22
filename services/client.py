"""A small client for the verifier's HTTP API and metrics, used by `specd up --demo` and benchmarks.

It speaks the same OpenAI-compatible API any client does (the tests use the official `openai`
package); this one is only the few lines the project's own commands need, on the standard library,
so the runtime does not depend on a test-only package.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families


@dataclass(kw_only=True)
class Completion:
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    seconds: float = 0.0
    ttft: float | None = None
    """Seconds to the first streamed text."""
    chunk_times: list[float] = field(default_factory=list)
    prompt_index: int | None = None
    """Where a load generator sent it: the prompt's index in its pool (`services.bench.run_level`)."""


def _request(url: str, body: dict | None, token: str, timeout: float):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    return urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout)


def stream_completion(base_url: str, path: str, body: dict, *, token: str = "", timeout: float = 600.0,
                      on_text=None) -> Completion:
    """POST a streaming request to ``base_url + path`` and collect its SSE chunks."""
    result = Completion()
    start = time.perf_counter()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with _request(base_url + path, body, token, timeout) as response:
        for chunk in sse_events(response):
            if chunk is None:
                break
            now = time.perf_counter() - start
            usage = chunk.get("usage")
            if usage:
                result.completion_tokens = usage["completion_tokens"]
                result.prompt_tokens = usage["prompt_tokens"]
            for choice in chunk.get("choices", []):
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if text:
                    result.ttft = now if result.ttft is None else result.ttft
                    result.chunk_times.append(now)
                    result.text += text
                    if on_text is not None:
                        on_text(text)
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
    result.seconds = time.perf_counter() - start
    return result


def grpc_completion(stub, prompt: list[int], max_tokens: int, *, temperature: float = 0.0,
                    timeout: float = 600.0) -> Completion:
    """The same measurement over the verifier's gRPC ``Generate`` stream (greedy by default)."""
    from specd._proto.v1 import common_pb2, verifier_pb2

    result = Completion()
    start = time.perf_counter()
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    request = verifier_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)
    for message in stub.Generate(request, timeout=timeout):
        now = time.perf_counter() - start
        if message.token_ids:
            result.ttft = now if result.ttft is None else result.ttft
            result.chunk_times.append(now)
            result.completion_tokens += len(message.token_ids)
        if message.finish_reason:
            result.finish_reason = message.finish_reason
            result.prompt_tokens = message.usage.prompt_tokens
    result.seconds = time.perf_counter() - start
    return result


def sse_events(response) -> Iterator[dict | None]:
    """The JSON events of an OpenAI-style SSE stream, then None once for its ``[DONE]`` (a stream
    that ends without yielding None was cut short)."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            yield None
            return
        yield json.loads(data)


def metrics(base_url: str, *, timeout: float = 10.0) -> dict[str, float]:
    """The verifier's Prometheus samples as {name{labels}: value}."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples
