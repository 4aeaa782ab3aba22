"""The verifier's OpenAI-compatible HTTP API, end to end: the official `openai` client against
`services.verifier.http` served by uvicorn, over a `ServingEngine` (with a prompt-lookup drafter,
so deltas carry several tokens) and a tiny random Qwen3 target with its own trained tokenizer.

Decoding is lossless, so the greedy text the API returns must be exactly the decoded output of
plain greedy decoding (`specd.engine.autoregressive`) of the same prompt ids, stop token left
out; streamed deltas must add up to the same text. The random target's greedy output is full of
multi-byte characters split across tokens, stray bytes and special tokens, which is what the
incremental detokenisation has to get right. Bad requests must get the right status and OpenAI's
error body, and leave the server serving.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import prometheus_client
import pytest
import torch

from services.verifier.http import build_app, serve_http
from specd.data.tokenizer import ENDOFTEXT, IM_END, format_chat, train_tokenizer
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, autoregressive
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.sampling import SamplingParams
from specd.serving import ServingEngine

MODEL = "tiny-http"
TOKEN = "test-token"
MAX_MODEL_LEN = 4096
VOCAB_SIZE = 300

PROMPTS = ["the red fox", "big owl 12", "café 日本", "hello world", "x", "green dog"]
CHATS = [
    [{"role": "user", "content": "the red fox"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "big owl?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "café"}, {"role": "user", "content": "日本"}],
]


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer():
    words = ["red", "green", "blue", "big"], ["fox", "dog", "cat", "owl"], ["walls", "logs", "hills", "stars"]
    texts = [
        f"the {a} {b} jumps over the {c} {i} times, café 日本"
        for i, (a, b, c) in enumerate((a, b, c) for a in words[0] for b in words[1] for c in words[2])
    ]
    return train_tokenizer(texts * 4, vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def stop_token_ids(tokenizer):
    return (tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT))


@pytest.fixture(scope="module")
def target(tokenizer):
    torch.manual_seed(0)
    # Untied embeddings: a tied random model just repeats its last token.
    config = dataclasses.replace(FLAVOURS["debug"], vocab_size=tokenizer.get_vocab_size(), tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def engine(target):
    engine = ServingEngine(
        target, NgramDrafter(vocab_size=target.config.vocab_size),
        EngineConfig(max_num_seqs=4, block_size=4, mode="sync"), max_model_len=MAX_MODEL_LEN,
    )
    yield engine
    engine.shutdown(drain=False)


@pytest.fixture(scope="module")
def ready():
    ready = threading.Event()
    ready.set()
    return ready


@pytest.fixture(scope="module")
def registry():
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("specd_http_test_marker", "a metric /metrics must expose", registry=registry).inc()
    return registry


@pytest.fixture(scope="module")
def base_url(engine, tokenizer, ready, registry, stop_token_ids):
    app = build_app(
        engine, tokenizer, model_name=MODEL, auth_token=TOKEN, is_ready=ready.is_set, registry=registry,
        default_stop_token_ids=stop_token_ids,
    )
    server, thread = serve_http(app, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join()


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=TOKEN, max_retries=0, timeout=60)


# ---------------------------------------------------------------------------- helpers
def reference(target, tokenizer, prompt_ids, max_tokens, stop_token_ids):
    """(text, finish_reason, completion tokens) of plain greedy decoding, as the API must report it."""
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids)
    (generation,) = autoregressive(target, [prompt_ids], params)
    ids = generation.token_ids[:-1] if generation.finish_reason == "stop" else generation.token_ids
    return tokenizer.decode(ids, skip_special_tokens=True), generation.finish_reason, len(generation.token_ids)


def raw_request(base_url, method, path, body: bytes | None = None, token: str | None = TOKEN):
    """(status, parsed JSON or text) of one plain HTTP request, for what the openai client cannot send."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{base_url}{path}", data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, content = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, content = error.code, error.read().decode()
    try:
        return status, json.loads(content)
    except json.JSONDecodeError:
        return status, content


def assert_openai_error(body, error_type, code=None):
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == error_type and body["error"]["code"] == code, body
    assert len(body["error"]["message"]) > 20, body


def assert_still_serving(client):
    completion = client.completions.create(model=MODEL, prompt="the", max_tokens=2, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length")


def complete(client, prompt, stream, **kwargs):
    """(text, finish_reason, usage) of one completion, streamed or not."""
    if not stream:
        completion = client.completions.create(model=MODEL, prompt=prompt, **kwargs)
        assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
        return completion.choices[0].text, completion.choices[0].finish_reason, completion.usage
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **kwargs
    ))
    *with_text, last = chunks
    assert last.choices == [] and all(len(c.choices) == 1 and c.usage is None for c in with_text)
    assert all(c.choices[0].finish_reason is None for c in with_text[:-1])
    assert len({c.id for c in chunks}) == 1
    return "".join(c.choices[0].text for c in with_text), with_text[-1].choices[0].finish_reason, last.usage


def chat(client, messages, stream, **kwargs):
    """(text, finish_reason, usage) of one chat completion, streamed or not."""
    if not stream:
        completion = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
        assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
        message = completion.choices[0].message
        assert message.role == "assistant"
        return message.content, completion.choices[0].finish_reason, completion.usage
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
    ))
    first, *middle, finish, usage = chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert all(c.choices[0].delta.content and c.choices[0].finish_reason is None for c in middle)
    assert finish.choices[0].delta.content is None and usage.choices == []
    return "".join(c.choices[0].delta.content for c in middle), finish.choices[0].finish_reason, usage.usage


def wait_until_idle(engine, timeout_seconds=10.0):
    deadline = time.monotonic() + timeout_seconds
    while engine.num_running or engine.num_waiting:
        assert time.monotonic() < deadline, "the engine still runs the request the client abandoned"
        time.sleep(0.01)


# ---------------------------------------------------------------------------- generation
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_greedy_decoding(client, target, tokenizer, stop_token_ids, stream):
    max_tokens = 40
    prompt_ids = [tokenizer.encode(p).ids for p in PROMPTS]
    expected = [reference(target, tokenizer, ids, max_tokens, stop_token_ids) for ids in prompt_ids]
    # The fixture must exercise both ends: a stop token and max_tokens.
    assert {finish for _, finish, _ in expected} == {"stop", "length"}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: complete(client, p, stream, max_tokens=max_tokens, temperature=0), PROMPTS))
    for ids, (text, finish, num_tokens), (got_text, got_finish, usage) in zip(prompt_ids, expected, results):
        assert (got_text, got_finish) == (text, finish)
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), num_tokens)
        assert usage.total_tokens == len(ids) + num_tokens


def test_completion_of_token_ids(client, target, tokenizer, stop_token_ids):
    ids = [1, *tokenizer.encode("green dog").ids, 2, 9]  # special ids are fine in a prompt
    text, finish, _ = reference(target, tokenizer, ids, 30, stop_token_ids)
    assert complete(client, ids, stream=False, max_tokens=30, temperature=0)[:2] == (text, finish)
    # A list holding one prompt is that prompt.
    assert complete(client, [ids], stream=True, max_tokens=30, temperature=0)[:2] == (text, finish)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_completions_equal_greedy_decoding(client, target, tokenizer, stop_token_ids, stream):
    max_tokens = 32
    expected = [
        reference(target, tokenizer, tokenizer.encode(format_chat(m, add_generation_prompt=True)).ids, max_tokens,
                  stop_token_ids)
        for m in CHATS
    ]
    with ThreadPoolExecutor(len(CHATS)) as pool:
        results = list(pool.map(
            lambda m: chat(client, m, stream, max_completion_tokens=max_tokens, temperature=0), CHATS
        ))
    for (text, finish, num_tokens), (got_text, got_finish, usage) in zip(expected, results):
        assert (got_text, got_finish, usage.completion_tokens) == (text, finish, num_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_token_ids_and_stop_strings(client, target, tokenizer, stream):
    prompt = "the red fox"
    (generation,) = autoregressive(target, [tokenizer.encode(prompt).ids], SamplingParams(max_tokens=40))
    ids = generation.token_ids
    # A stop token that is plain text: the first non-special token that has not occurred before.
    position = next(i for i in range(5, len(ids)) if ids[i] > 6 and ids[i] not in ids[:i])
    text, finish, usage = complete(
        client, prompt, stream, max_tokens=40, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ids[position]]},
    )
    assert (text, finish) == (tokenizer.decode(ids[:position], skip_special_tokens=True), "stop")
    assert usage.completion_tokens == position + 1  # the stop token counts, but is not text

    # A stop string (a few characters of the output) is cut from the text, with what follows;
    # several, so some of them arrive split across deltas.
    full = tokenizer.decode(ids, skip_special_tokens=True)
    starts = [i for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert len(starts) >= 4
    for start in starts[:: len(starts) // 4]:
        stop = full[start : start + 2]
        text, finish, _ = complete(
            client, prompt, stream, max_tokens=40, temperature=0, stop=["never seen", stop],
            extra_body={"ignore_eos": True},
        )
        assert (text, finish) == (full[: full.index(stop)], "stop")


# ---------------------------------------------------------------------------- the other routes
def test_models_health_and_metrics(client, base_url, ready):
    (model,) = client.models.list().data
    assert (model.id, model.owned_by, model.model_extra["max_model_len"]) == (MODEL, "specd", MAX_MODEL_LEN)
    # Probes and scrapers carry no token.
    assert raw_request(base_url, "GET", "/health", token=None)[0] == 200
    status, metrics = raw_request(base_url, "GET", "/metrics", token=None)
    assert status == 200 and "specd_http_test_marker_total 1.0" in metrics

    ready.clear()  # loading weights, or draining
    try:
        status, body = raw_request(base_url, "GET", "/health", token=None)
        assert status == 503
        assert_openai_error(body, "server_error", "service_unavailable")
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt="the", max_tokens=2)
        assert refused.value.status_code == 503
    finally:
        ready.set()
    assert raw_request(base_url, "GET", "/health", token=None)[0] == 200
    assert_still_serving(client)


# ---------------------------------------------------------------------------- bad requests
BAD_COMPLETIONS = {
    "unknown model": ({"model": "gpt-4", "prompt": "the"}, "model_not_found"),
    "max_tokens 0": ({"prompt": "the", "max_tokens": 0}, None),
    "empty prompt": ({"prompt": ""}, None),
    "no prompt ids": ({"prompt": []}, None),
    "id outside the vocabulary": ({"prompt": [5, VOCAB_SIZE + 10]}, None),
    "negative id": ({"prompt": [5, -1]}, None),
    "prompt beyond the context": ({"prompt": [9] * MAX_MODEL_LEN, "max_tokens": 1}, "context_length_exceeded"),
    "max_tokens beyond the context": ({"prompt": "the", "max_tokens": MAX_MODEL_LEN}, "context_length_exceeded"),
    "several prompts": ({"prompt": ["the", "a"]}, None),
    "n 2": ({"prompt": "the", "n": 2}, None),
    "echo": ({"prompt": "the", "echo": True}, None),
    "logprobs": ({"prompt": "the", "logprobs": 1}, None),
    "negative temperature": ({"prompt": "the", "temperature": -1}, None),
    "top_p 0": ({"prompt": "the", "top_p": 0}, None),
    "empty stop string": ({"prompt": "the", "stop": [""]}, None),
}


@pytest.mark.parametrize("case", sorted(BAD_COMPLETIONS))
def test_bad_completion_requests(client, case):
    kwargs, code = BAD_COMPLETIONS[case]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**{"model": MODEL, **kwargs})
    assert refused.value.status_code == 400
    assert_openai_error({"error": refused.value.body}, "invalid_request_error", code)
    assert_still_serving(client)


BAD_CHATS = {
    "unknown model": ({"model": "gpt-4"}, "model_not_found"),
    "no messages": ({"messages": []}, None),
    "unknown role": ({"messages": [{"role": "robot", "content": "x"}]}, None),
    "turn marker in content": ({"messages": [{"role": "user", "content": "a<|im_end|>b"}]}, None),
    "prompt beyond the context": ({"messages": [{"role": "user", "content": "the fox " * MAX_MODEL_LEN}]},
                                  "context_length_exceeded"),
    "max_completion_tokens 0": ({"max_completion_tokens": 0}, None),
    "logprobs": ({"logprobs": True}, None),
}


@pytest.mark.parametrize("case", sorted(BAD_CHATS))
def test_bad_chat_requests(client, case):
    kwargs, code = BAD_CHATS[case]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kwargs})
    assert_openai_error({"error": refused.value.body}, "invalid_request_error", code)
    assert_still_serving(client)


def test_malformed_json_and_unknown_routes(client, base_url):
    for body, param in [(b"{not json", None), (b'{"prompt": "the"}', "model"), (b"[1, 2]", None)]:
        status, error = raw_request(base_url, "POST", "/v1/completions", body)
        assert status == 400, error  # not FastAPI's 422
        assert_openai_error(error, "invalid_request_error")
        if param:
            assert error["error"]["param"] == param
    status, error = raw_request(base_url, "GET", "/v1/engines")
    assert status == 404
    assert_openai_error(error, "invalid_request_error")
    assert_still_serving(client)


def test_missing_or_wrong_token_is_refused(client, base_url):
    body = json.dumps({"model": MODEL, "prompt": "the", "max_tokens": 2}).encode()
    for token in (None, "not-the-token"):
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, error = raw_request(base_url, "POST", path, body, token=token)
            assert status == 401
            assert_openai_error(error, "authentication_error", "invalid_api_key")
    stranger = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    assert_still_serving(client)


# ---------------------------------------------------------------------------- disconnects
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_client_that_goes_away_cancels_its_request(client, engine, stream):
    """A request for thousands of tokens (seconds of work) ends soon after its client leaves."""
    prompt_ids = [9, 10, 11]
    max_tokens = MAX_MODEL_LEN - len(prompt_ids)
    emitted_before = engine.stats.num_emitted_tokens
    request = {
        "model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        chunks = client.completions.create(stream=True, **request)
        next(iter(chunks))
        chunks.close()
    else:
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.5).completions.create(**request)
    wait_until_idle(engine)
    assert engine.stats.num_emitted_tokens - emitted_before < max_tokens // 2
    assert_still_serving(client)
