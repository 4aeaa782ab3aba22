"""One bad request must never take specd down: regression tests for what a probe of the running
services found (each test is named after its defect), over HTTP and gRPC where both apply.

The target is the tiny random Qwen3 of `test_http_api` (with its trained tokenizer) behind a
`ServingEngine` with a prompt-lookup drafter, so blocks of several tokens are verified and the
penalties' per-row history is exercised. Greedy output must stay exactly plain greedy decoding
of the same (processed) distribution, whatever else happens beside it.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import prometheus_client
import pytest
import torch
from test_http_api import (  # noqa: F401 (fixtures)
    MAX_MODEL_LEN,
    assert_openai_error,
    raw_request,
    stop_token_ids,
    target,
    tokenizer,
)

from services.common.config import ServiceConfig
from services.common.server import GrpcServer, open_channel
from services.common.wire import params_to_proto
from services.verifier.http import MAX_STOP_CHARS, MAX_STOP_STRINGS, build_app, serve_http
from services.verifier.score import ScoreHandler
from services.verifier.server import VerifierServicer
from specd import engine as engine_module
from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, autoregressive
from specd.sampling import SamplingParams, process_logits
from specd.serving import MAX_WHOLE_STEP_FAILURES, EngineStopped, QueueFull, ServingEngine

MODEL = "tiny-robust"


# ---------------------------------------------------------------------------- fixtures
def make_engine(target, *, max_num_seqs: int = 4, max_model_len: int = MAX_MODEL_LEN, **kwargs) -> ServingEngine:
    return ServingEngine(
        target, NgramDrafter(vocab_size=target.config.vocab_size),
        EngineConfig(max_num_seqs=max_num_seqs, block_size=4, mode="sync"), max_model_len=max_model_len, **kwargs,
    )


def serve(engine, tokenizer, stop_token_ids, **kwargs):
    app = build_app(engine, tokenizer, model_name=MODEL, registry=prometheus_client.CollectorRegistry(),
                    default_stop_token_ids=stop_token_ids, **kwargs)
    server, thread = serve_http(app, "127.0.0.1", 0)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture(scope="module")
def engine(target):
    engine = make_engine(target)
    yield engine
    engine.shutdown(drain=False)


@pytest.fixture(scope="module")
def base_url(engine, tokenizer, stop_token_ids):
    server, thread, url = serve(engine, tokenizer, stop_token_ids, max_request_bytes=1 << 20)
    yield url
    server.should_exit = True
    thread.join()


@pytest.fixture(scope="module")
def grpc_stub(engine, target, stop_token_ids):
    server = GrpcServer("verifier-test", ServiceConfig(host="127.0.0.1", port=0))
    servicer = VerifierServicer(engine, ScoreHandler(target, engine.target_lock), tuple(stop_token_ids))
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server.server)
    port = server.start(["specd.v1.Verifier"])
    server.set_serving()
    with open_channel(f"127.0.0.1:{port}", ServiceConfig()) as channel:
        yield verifier_pb2_grpc.VerifierStub(channel)
    server.stop(0)


def post(base_url, body: dict, path="/v1/completions"):
    return raw_request(base_url, "POST", path, json.dumps(body).encode(), token=None)


def completion(base_url, prompt="the red fox", **fields):
    return post(base_url, {"model": MODEL, "prompt": prompt, "max_tokens": 8, **fields})


def greedy_text(target, tokenizer, stop_token_ids, prompt, max_tokens=8, **params):
    ids = tokenizer.encode(prompt).ids
    generation, = autoregressive(target, [ids], SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                                                                **params))
    out = generation.token_ids[:-1] if generation.finish_reason == "stop" else generation.token_ids
    return tokenizer.decode(out, skip_special_tokens=True)


def assert_healthy(base_url, engine):
    assert engine.alive
    status, _ = raw_request(base_url, "GET", "/health", token=None)
    assert status == 200


def generate_grpc(stub, prompt_ids, **params):
    request = verifier_pb2.GenerateRequest(prompt_token_ids=prompt_ids, params=common_pb2.SamplingParams(**params))
    return [t for message in stub.Generate(request, timeout=60) for t in message.token_ids]


# ---------------------------------------------------------------------------- 1. poisoned engine
@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 5e-6])
def test_temperature_that_underflows_decodes_greedy_and_the_engine_survives(
        base_url, engine, target, tokenizer, stop_token_ids, temperature):
    status, body = completion(base_url, temperature=temperature)
    assert status == 200, body
    assert body["choices"][0]["text"] == greedy_text(target, tokenizer, stop_token_ids, "the red fox")
    assert_healthy(base_url, engine)


def test_temperature_that_underflows_over_grpc(grpc_stub, engine, target, stop_token_ids):
    ids = [5, 9, 17, 33]
    generation, = autoregressive(target, [ids], SamplingParams(max_tokens=6, stop_token_ids=stop_token_ids))
    assert generate_grpc(grpc_stub, ids, temperature=1e-40, max_tokens=6) == generation.token_ids
    assert engine.alive


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", -0.5])
def test_non_finite_temperature_is_refused_over_http(base_url, engine, value):
    status, body = completion(base_url, temperature=value)
    assert status == 400, body
    assert_openai_error(body, "invalid_request_error")
    assert "temperature" in body["error"]["message"]
    assert_healthy(base_url, engine)


def test_non_finite_temperature_is_refused_over_grpc(grpc_stub, engine):
    for value in (float("nan"), float("inf")):
        with pytest.raises(grpc.RpcError) as error:
            generate_grpc(grpc_stub, [5, 6], temperature=value, max_tokens=2)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.value.details()
    assert engine.alive


@pytest.mark.parametrize("seed", [2**70, 2**64, -1])
def test_seed_out_of_range_is_refused_at_the_door(base_url, engine, seed):
    status, body = completion(base_url, seed=seed, temperature=1.0)
    assert status == 400, body
    assert_openai_error(body, "invalid_request_error")
    assert body["error"]["param"] == "seed"
    assert_healthy(base_url, engine)
    status, body = completion(base_url, seed=2**64 - 1, temperature=1.0)  # the edge of the range runs
    assert status == 200, body


def test_a_request_that_fails_in_the_engine_fails_alone(target, monkeypatch):
    """Beneath validation: a request whose sampling fails inside a step ends with its error,
    and a request running beside it completes exactly."""
    real = engine_module.target_probs

    def failing(logits, params):  # one request's sampling fails, as a bug in a processor would
        if params.seed == 666:
            raise ValueError("cannot sample from a distribution with no mass (injected)")
        return real(logits, params)

    monkeypatch.setattr(engine_module, "target_probs", failing)
    engine = make_engine(target)
    try:
        good = SamplingParams(max_tokens=24, stop_token_ids=())
        good_stream = engine.submit([5, 9, 17, 33], good)
        bad_stream = engine.submit([7, 8, 9], SamplingParams(max_tokens=24, temperature=1.0, seed=666))
        deltas = list(bad_stream)
        assert deltas[-1].finish_reason == "error" and "distribution" in deltas[-1].error
        generation, = autoregressive(target, [[5, 9, 17, 33]], good)
        assert [t for d in good_stream for t in d.token_ids] == generation.token_ids
        assert engine.alive
        assert engine.generate([5, 6], SamplingParams(max_tokens=3)) == \
            autoregressive(target, [[5, 6]], SamplingParams(max_tokens=3))[0].token_ids
    finally:
        engine.shutdown(drain=False)


def test_a_step_that_fails_as_a_whole_fails_only_the_culprit(target, monkeypatch):
    engine = make_engine(target)
    step = engine.engine.step
    poison = [7, 7, 7, 7]

    def flaky(running):  # fails whenever the poisoned prompt is in the batch, as a bad kernel input would
        if any(seq.context[: len(poison)] == poison for seq in running):
            raise RuntimeError("kernel failed on this input")
        return step(running)

    monkeypatch.setattr(engine.engine, "step", flaky)
    try:
        good = SamplingParams(max_tokens=16)
        streams = [engine.submit([5, 9, 17, 33], good), engine.submit(poison, good)]
        good_out = [t for d in streams[0] for t in d.token_ids]
        bad_last = list(streams[1])[-1]
        assert bad_last.finish_reason == "error" and "kernel failed" in bad_last.error
        assert good_out == autoregressive(target, [[5, 9, 17, 33]], good)[0].token_ids
        assert engine.alive
    finally:
        engine.shutdown(drain=False)


def test_an_engine_that_dies_reports_it_and_refuses_instead_of_hanging(target, tokenizer, stop_token_ids, monkeypatch):
    deaths = []
    engine = make_engine(target, on_death=deaths.append)
    server, thread, url = serve(engine, tokenizer, stop_token_ids)
    try:
        def broken(running):
            raise RuntimeError("the target cannot run any pass")

        monkeypatch.setattr(engine.engine, "step", broken)
        for _ in range(MAX_WHOLE_STEP_FAILURES):  # each stream gets the error: none hangs
            status, body = completion(url)
            assert status == 500 and body["error"]["type"] == "server_error", body
        deadline = time.monotonic() + 10
        # The loop declares itself dead right after the last failed step (alive turns False),
        # ends the open streams, then tells the server (on_death): wait for both.
        while engine.alive or not deaths:
            assert time.monotonic() < deadline, f"alive={engine.alive}, deaths={deaths}"
            time.sleep(0.01)
        status, body = raw_request(url, "GET", "/health", token=None)
        assert status == 503, "a dead engine must not look healthy"
        status, body = completion(url)
        assert status == 503, body
        assert_openai_error(body, "server_error", "service_unavailable")
        with pytest.raises(EngineStopped):
            engine.submit([5], SamplingParams(max_tokens=1))
    finally:
        server.should_exit = True
        thread.join()
        engine.shutdown(drain=False)


# ---------------------------------------------------------------------------- 2. drain
def test_shutdown_ends_every_stream_even_when_the_engine_hangs(target, monkeypatch):
    engine = make_engine(target, max_num_seqs=1)
    release = threading.Event()
    entered = threading.Event()

    def hung(running):
        entered.set()
        release.wait(30)

    monkeypatch.setattr(engine.engine, "step", hung)
    running = engine.submit([5, 6], SamplingParams(max_tokens=4))
    queued = engine.submit([7, 8], SamplingParams(max_tokens=4))
    assert entered.wait(10)
    ended = []
    consumers = [threading.Thread(target=lambda s=s: ended.append(list(s)[-1].finish_reason)) for s in (running, queued)]
    for consumer in consumers:
        consumer.start()
    start = time.monotonic()
    engine.shutdown(drain=True, timeout=0.5, abort_timeout=0.5)
    assert time.monotonic() - start < 5
    for consumer in consumers:
        consumer.join(5)
    assert sorted(ended) == ["abort", "abort"]
    release.set()


# ---------------------------------------------------------------------------- 5. frozen event loop
def test_a_body_above_the_limit_is_413_before_it_is_parsed(base_url, engine):
    status, body = completion(base_url, prompt="x" * (2 << 20))
    assert status == 413, body
    assert_openai_error(body, "invalid_request_error", "request_too_large")
    assert_healthy(base_url, engine)


def test_a_prompt_too_long_for_any_tokenisation_is_refused_before_it(base_url, engine):
    prompt = "the red fox jumps 12 " * 45000  # ~1 MB: more characters than 4096 of the longest tokens
    start = time.perf_counter()
    status, body = completion(base_url, prompt)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "characters" in body["error"]["message"]  # refused by its length, not after tokenising it
    assert time.perf_counter() - start < 1.0
    assert_healthy(base_url, engine)


def test_a_long_prompt_does_not_stall_health(target, tokenizer, stop_token_ids):
    """Tokenisation runs off the event loop and lets go of the GIL: /health answers while a ~1 MB
    prompt is encoded (a context this long passes the length guard; max_tokens then overflows it)."""
    engine = make_engine(target, max_model_len=10**6)
    server, thread, url = serve(engine, tokenizer, stop_token_ids)
    prompt = "the red fox jumps 12 " * 45000
    try:
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(completion, url, prompt, max_tokens=10**6)
            latencies = []
            while True:  # at least one check, however fast the big request is answered
                start = time.perf_counter()
                status, _ = raw_request(url, "GET", "/health", token=None)
                latencies.append(time.perf_counter() - start)
                assert status == 200
                if big.done():
                    break
            status, body = big.result()
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert "asks for" in body["error"]["message"]  # refused after tokenising (the engine's check)
        assert len(latencies) >= 3, "the prompt was answered before /health could be asked while it was encoded"
        assert max(latencies) < 1.0, f"/health took {max(latencies):.2f}s while a long prompt was encoded"
    finally:
        server.should_exit = True
        thread.join()
        engine.shutdown(drain=False)


@pytest.mark.parametrize("stop", [["a"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_CHARS + 1)],
                                  ["y" * 100_000] * 4])
def test_stop_strings_are_bounded(base_url, engine, stop):
    start = time.perf_counter()
    status, body = completion(base_url, stop=stop)
    assert status == 400 and body["error"]["param"] == "stop", body
    assert time.perf_counter() - start < 2.0
    assert_healthy(base_url, engine)


def test_stop_strings_at_the_limit_run_and_cut(base_url, target, tokenizer, stop_token_ids):
    text = greedy_text(target, tokenizer, stop_token_ids, "the red fox", max_tokens=16)
    stop = [text[3:6] or "zz"] + ["q" * MAX_STOP_CHARS] * (MAX_STOP_STRINGS - 1)
    status, body = post(base_url, {"model": MODEL, "prompt": "the red fox", "max_tokens": 16, "stop": stop,
                                   "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == text[: text.find(stop[0])]


# ---------------------------------------------------------------------------- 6. surrogates
@pytest.mark.parametrize("where", ["prompt", "chat", "chat parts", "stop"])
def test_lone_surrogates_are_a_400_with_an_openai_body(base_url, engine, where):
    raw = '"\\ud800x"'
    bodies = {
        "prompt": f'{{"model": "{MODEL}", "prompt": {raw}}}',
        "chat": f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {raw}}}]}}',
        "chat parts": f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": '
                      f'[{{"type": "text", "text": {raw}}}]}}]}}',
        "stop": f'{{"model": "{MODEL}", "prompt": "hi", "stop": [{raw}]}}',
    }
    path = "/v1/completions" if where in ("prompt", "stop") else "/v1/chat/completions"
    status, body = raw_request(base_url, "POST", path, bodies[where].encode(), token=None)
    assert status == 400, body
    assert_openai_error(body, "invalid_request_error")
    assert "surrogate" in body["error"]["message"]
    assert_healthy(base_url, engine)


def test_an_unexpected_error_is_a_500_with_an_openai_body(base_url, engine, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr(engine, "submit", broken)
    status, body = completion(base_url)
    assert status == 500, body
    assert_openai_error(body, "server_error")


# ---------------------------------------------------------------------------- 8. smaller ones
def test_docs_and_openapi_are_not_served_without_auth_when_a_token_is_set(target, tokenizer, stop_token_ids):
    engine = make_engine(target)
    server, thread, url = serve(engine, tokenizer, stop_token_ids, auth_token="s3cret")
    try:
        for path in ("/docs", "/openapi.json", "/redoc"):
            status, body = raw_request(url, "GET", path, token=None)
            assert status == 404, (path, status)
            assert set(body["error"]) == {"message", "type", "param", "code"}
    finally:
        server.should_exit = True
        thread.join()
        engine.shutdown(drain=False)


@pytest.mark.parametrize("field", [{"stop_token_ids": [10**6]}, {"logit_bias": {"999999": 5}},
                                   {"logit_bias": {"abc": 5}}, {"logit_bias": {"5": 1000}}])
def test_out_of_vocabulary_token_ids_are_refused(base_url, engine, field):
    status, body = completion(base_url, **field)
    assert status == 400, body
    assert_openai_error(body, "invalid_request_error")
    assert_healthy(base_url, engine)


def test_out_of_vocabulary_stop_token_ids_are_refused_over_grpc(grpc_stub):
    with pytest.raises(grpc.RpcError) as error:
        generate_grpc(grpc_stub, [5, 6], max_tokens=2, stop_token_ids=[10**6])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in error.value.details()


# ---------------------------------------------------------------------------- parameters
def test_processed_logits_match_a_row_by_row_reference():
    torch.manual_seed(1)
    vocab = 12
    logits = torch.randn(4, vocab)
    prompt, output, block = [1, 2, 3], [3, 4, 4], [4, 5, 6]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.5,
                            logit_bias={7: 2.0}, min_tokens=5, max_tokens=9, stop_token_ids=(0,))
    got = process_logits(logits, params, prompt, output, block)
    for r in range(4):
        history = output + block[:r]
        want = logits[r].clone()
        want[7] += 2.0
        if len(history) < 5:
            want[0] = float("-inf")
        for t in range(vocab):
            if t in history or t in prompt:
                want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
            want[t] -= 0.3 * history.count(t) + 0.5 * (t in history)
        torch.testing.assert_close(got[r], want)


@pytest.mark.parametrize("params", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.8},
    {"logit_bias": {"40": 7.0, "41": -100}}, {"min_tokens": 6, "logit_bias": {"2": 9.0}},
], ids=lambda p: next(iter(p)))
def test_penalties_bias_and_min_tokens_are_applied_and_stay_lossless(base_url, target, tokenizer, stop_token_ids, params):
    """Speculative greedy output with the processors == plain greedy decoding with them, and
    they change the output (a server that ignored them would return the baseline)."""
    library = {**params}
    if "logit_bias" in library:
        library["logit_bias"] = {int(k): v for k, v in library["logit_bias"].items()}
    changed = False
    for prompt in ("the red fox", "big owl 12", "green dog"):
        status, body = post(base_url, {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                       **params})
        assert status == 200, body
        expected = greedy_text(target, tokenizer, stop_token_ids, prompt, max_tokens=16, **library)
        assert body["choices"][0]["text"] == expected
        # min_tokens is seen against the same bias without it (the bias makes the stop token likely).
        without = {k: v for k, v in library.items() if k != "min_tokens"} if "min_tokens" in library else {}
        changed |= expected != greedy_text(target, tokenizer, stop_token_ids, prompt, max_tokens=16, **without)
        if "min_tokens" in library:
            assert body["usage"]["completion_tokens"] >= library["min_tokens"]
    assert changed, f"{params} did not change any output: the test cannot tell it was applied"


def test_penalties_over_grpc_equal_plain_decoding(grpc_stub, target, stop_token_ids):
    params = SamplingParams(max_tokens=12, frequency_penalty=1.5, logit_bias={40: 3.0}, min_tokens=4)
    ids = [5, 9, 17, 33]
    wire = params_to_proto(params)
    got = [t for m in grpc_stub.Generate(verifier_pb2.GenerateRequest(prompt_token_ids=ids, params=wire), timeout=60)
           for t in m.token_ids]
    params.stop_token_ids = tuple(stop_token_ids)
    assert got == autoregressive(target, [ids], params)[0].token_ids


@pytest.mark.parametrize("field", [
    {"response_format": {"type": "json_object"}}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"tool_choice": "required"}, {"guided_json": {"type": "object"}}, {"use_beam_search": True},
])
def test_parameters_that_cannot_be_honoured_are_refused_by_name(base_url, field):
    (name,) = field
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, answer = post(base_url, {"model": MODEL, **body, **field}, path)
        assert status == 400, answer
        assert answer["error"]["param"] == name and name in answer["error"]["message"]


def test_parameters_that_ask_for_nothing_are_accepted(base_url):
    status, body = post(base_url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                   "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                                   "user": "someone"}, "/v1/chat/completions")
    assert status == 200, body


def test_chat_content_parts_and_developer_and_tool_roles(base_url, target, tokenizer, stop_token_ids):
    as_string = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the red fox"},
                 {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "42"}]
    as_parts = [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "user", "content": [{"type": "text", "text": "the red fox"}]},
                {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    texts = []
    for messages in (as_string, as_parts):
        status, body = post(base_url, {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0},
                            "/v1/chat/completions")
        assert status == 200, body
        texts.append(body["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]
    status, body = post(base_url, {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "/v1/chat/completions")
    assert status == 400 and "image_url" in body["error"]["message"], body


def test_a_full_queue_answers_429_not_an_unbounded_wait(target, tokenizer, stop_token_ids, monkeypatch):
    engine = make_engine(target, max_num_seqs=1, max_waiting=1)
    release = threading.Event()
    step = engine.engine.step

    def slow(running):
        release.wait(30)
        return step(running)

    monkeypatch.setattr(engine.engine, "step", slow)
    server, thread, url = serve(engine, tokenizer, stop_token_ids)
    try:
        engine.submit([5, 6], SamplingParams(max_tokens=2))  # runs (held)
        deadline = time.monotonic() + 10
        while engine.num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.submit([5, 7], SamplingParams(max_tokens=2))  # waits: the queue is now full
        status, body = completion(url)
        assert status == 429, body
        assert body["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(QueueFull):
            engine.submit([5, 8], SamplingParams(max_tokens=2))
        request = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": MODEL, "prompt": "x"}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 429 and refused.value.headers["Retry-After"] == "1"
    finally:
        release.set()
        server.should_exit = True
        thread.join()
        engine.shutdown(drain=False)


@pytest.mark.parametrize("field", [{"repetition_penalty": 1e-45}, {"repetition_penalty": 0}, {"presence_penalty": 3},
                                   {"min_tokens": 99}, {"min_p": 1.5}, {"top_k": 2**31}])
def test_processor_values_out_of_range_are_refused(base_url, engine, field):
    # Found by the fuzz test: repetition_penalty 1e-45 divided a logit to +inf, and sampling failed.
    status, body = completion(base_url, temperature=1.0, **field)
    assert status == 400 and body["error"]["param"] == next(iter(field)), body
    assert_healthy(base_url, engine)


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-300])
def test_a_top_p_that_is_zero_in_float32_keeps_the_most_likely_token(base_url, engine, top_p):
    # Found by the fuzz test: 5e-324 is 0.0 in float32, and every token was dropped.
    status, body = completion(base_url, temperature=1.0, top_p=top_p, seed=1)
    assert status == 200, body
    assert_healthy(base_url, engine)


def test_a_tiny_temperature_over_large_logits_still_samples(base_url, engine):
    # logit_bias 100 over T = 1e-5 is 1e7 per logit: finite, but on the way to +inf for some rows.
    status, body = completion(base_url, temperature=1e-5, logit_bias={"40": 100, "41": 100}, seed=3)
    assert status == 200, body
