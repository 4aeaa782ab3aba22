"""Randomised bad and edge requests at a running verifier, with a well-formed stream beside them.

Hypothesis draws request bodies over the OpenAI schema (numbers at and beyond float limits, NaN
and infinities, huge and negative ints, wrong types, lone surrogates and other odd unicode,
unknown and refused fields) and sends them through HTTP and the same values through gRPC. For
every one: no 5xx (no INTERNAL/UNKNOWN over gRPC), and every HTTP error body is OpenAI's shape.
Meanwhile a well-formed greedy stream runs again and again beside them and must equal plain
greedy decoding each time, and ``/health`` is polled throughout and must say 200 while the
engine is alive (which it must stay). Examples are derandomised, so a CI run is repeatable; the
budget is bounded by the number of examples.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_http_api import raw_request, stop_token_ids, target, tokenizer  # noqa: F401 (fixtures)
from test_robustness import MODEL, base_url, engine, grpc_stub  # noqa: F401 (fixtures)

from specd._proto.v1 import common_pb2, verifier_pb2
from specd.engine import autoregressive
from specd.sampling import SamplingParams

EXAMPLES = 250

# ---------------------------------------------------------------------------- strategies
odd_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-45, 5e-324, 1e-40, 1e-5, 0.99999, 1.0, 2.0, 2.0000001, 100.0, 1e38, 1e308,
                     -1e-40, -2.0, -100.0]),
)
odd_ints = st.one_of(
    st.integers(min_value=-5, max_value=12),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -2**63, -2**70, 10**30]),
)
odd_text = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=st.characters(categories=["Cs", "Co", "Cn", "Zs", "Mn", "So"]), max_size=6),
    st.sampled_from(["", "\ud800", "\udfff x", "a\x00b", "<|im_end|>", "<|im_start|>user", "\u202e", "日本" * 3]),
)
scalars = st.one_of(st.none(), st.booleans(), odd_ints, odd_floats, odd_text)
anything = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(odd_text, scalars, max_size=3))

# max_tokens and max_completion_tokens stay small when they are valid: the point is bad input.
small_max_tokens = st.one_of(st.integers(min_value=1, max_value=6), st.sampled_from([0, -1, 2**70, 1.5, "4", None]))
def edge_or_odd(valid: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values (edges included) as often as odd ones: a request must get past the door for
    the engine to be tried, and most random values would not."""
    return st.one_of(valid, odd)


unit = st.floats(min_value=0.0, max_value=1.0)
FIELDS = {
    "temperature": edge_or_odd(st.floats(0.0, 2.0) | st.sampled_from([1e-40, 1e-30, 5e-6, 1e-5]), odd_floats),
    "top_p": edge_or_odd(unit.filter(lambda v: v > 0), odd_floats),
    "top_k": edge_or_odd(st.integers(-1, 400), odd_ints), "min_p": edge_or_odd(unit, odd_floats),
    "seed": edge_or_odd(st.integers(0, 2**64 - 1), scalars),
    "presence_penalty": edge_or_odd(st.floats(-2.0, 2.0), odd_floats),
    "frequency_penalty": edge_or_odd(st.floats(-2.0, 2.0), odd_floats),
    "repetition_penalty": edge_or_odd(st.floats(0.01, 2.0), odd_floats),
    "min_tokens": edge_or_odd(st.integers(0, 4), odd_ints),
    "stop": edge_or_odd(st.lists(st.text(min_size=1, max_size=4), max_size=3), st.one_of(odd_text, scalars,
                                                                                           st.lists(odd_text, max_size=20))),
    "stop_token_ids": edge_or_odd(st.lists(st.integers(0, 299), max_size=3), st.one_of(st.lists(odd_ints, max_size=3),
                                                                                       scalars)),
    "logit_bias": edge_or_odd(st.dictionaries(st.integers(0, 299).map(str), st.floats(-100.0, 100.0), max_size=3),
                              st.one_of(st.dictionaries(st.one_of(odd_text, odd_ints.map(str)), odd_floats,
                                                        max_size=3), scalars)),
    "ignore_eos": edge_or_odd(st.booleans(), anything), "stream": st.booleans(), "stream_options": anything,
    "n": edge_or_odd(st.just(1), st.one_of(odd_ints, scalars)), "response_format": anything, "tools": anything,
    "tool_choice": anything, "logprobs": anything, "echo": anything, "best_of": anything, "user": anything,
    "guided_json": anything, "unknown_field": anything,
}
prompts = st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 299), min_size=1, max_size=8),
                    odd_text, st.lists(odd_ints, min_size=0, max_size=5), st.lists(odd_text, max_size=2),
                    st.lists(st.lists(odd_ints, max_size=3), max_size=2), scalars)
contents = st.one_of(odd_text, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""])},
                                                                optional={"text": odd_text}), max_size=2), scalars)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "tool"]),
                                    "content": st.text(max_size=20)}), min_size=1, max_size=3),
    st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot", ""])},
        optional={"content": contents, "tool_call_id": anything}), max_size=3),
    scalars,
)


@st.composite
def bodies(draw):
    """(path, raw JSON body) of one request."""
    chat = draw(st.booleans())
    body = {"model": MODEL if draw(st.integers(0, 9)) else draw(scalars)}
    if chat:
        body["messages"] = draw(messages)
        body["max_tokens"] = draw(small_max_tokens)  # absent: the rest of the context (slow, and not the point)
    else:
        body["prompt"] = draw(prompts)
        if draw(st.booleans()):
            body["max_tokens"] = draw(small_max_tokens)
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        body[name] = draw(FIELDS[name])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, json.dumps(body, allow_nan=True).encode()  # NaN, Infinity as JSON's lax literals


# ---------------------------------------------------------------------------- the server under test
# engine, base_url and grpc_stub: the robustness tests' verifier (a tiny target, HTTP and gRPC).


class Beside:
    """A well-formed greedy stream, sent again and again, and a /health poller, in threads."""

    def __init__(self, base_url: str, expected: str) -> None:
        self.base_url, self.expected = base_url, expected
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.rounds = 0
        self.health_checks = 0
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._health)]

    def _stream(self) -> None:
        body = json.dumps({"model": MODEL, "prompt": "the red fox", "max_tokens": 12, "temperature": 0,
                           "stream": True}).encode()
        while not self.stop.is_set():
            status, content = raw_request(self.base_url, "POST", "/v1/completions", body, token=None)
            events = [line.removeprefix("data: ") for line in str(content).splitlines() if line.startswith("data: ")]
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))
            if status != 200 or events[-1] != "[DONE]" or text != self.expected:
                self.problems.append(f"the well-formed stream got {status}: {text!r} (want {self.expected!r})")
            self.rounds += 1

    def _health(self) -> None:
        while not self.stop.is_set():
            status, _ = raw_request(self.base_url, "GET", "/health", token=None)
            if status != 200:
                self.problems.append(f"/health said {status} while the engine served")
            self.health_checks += 1
            time.sleep(0.05)

    def __enter__(self) -> "Beside":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def expected_text(target, tokenizer, stop_token_ids) -> str:
    generation, = autoregressive(target, [tokenizer.encode("the red fox").ids],
                                 SamplingParams(max_tokens=12, stop_token_ids=stop_token_ids))
    ids = generation.token_ids[:-1] if generation.finish_reason == "stop" else generation.token_ids
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_random_bad_requests_never_get_a_5xx_and_never_disturb_a_good_stream(
        base_url, engine, target, tokenizer, stop_token_ids):
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies())
    @example(("/v1/completions", b'{"model": "%s", "prompt": "0", "top_p": 5e-324}' % MODEL.encode()))
    @example(("/v1/completions", b'{"model": "%s", "prompt": "0", "repetition_penalty": 1e-45}' % MODEL.encode()))
    def one(request):
        path, body = request
        status, answer = raw_request(base_url, "POST", path, body, token=None)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, f"{status} for {body[:300]!r}: {answer}"
        if status >= 400:
            assert isinstance(answer, dict) and set(answer.get("error", {})) == {"message", "type", "param", "code"}, \
                f"{status} without OpenAI's error body for {body[:300]!r}: {answer!r}"

    with Beside(base_url, expected_text(target, tokenizer, stop_token_ids)) as beside:
        one()
    print(f"statuses {dict(sorted(seen.items()))}; the good stream ran {beside.rounds} times beside them; "
          f"{beside.health_checks} health checks")
    assert not beside.problems, beside.problems[:5]
    assert beside.rounds >= 1 and beside.health_checks >= 1
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # both kinds were exercised
    assert engine.alive


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(temperature=odd_floats, top_p=odd_floats, min_p=odd_floats, penalty=odd_floats,
       top_k=st.integers(-2**31, 2**31 - 1), seed=st.integers(0, 2**64 - 1),
       max_tokens=st.integers(-2**31, 2**31 - 1), min_tokens=st.integers(-2**31, 2**31 - 1),
       stop=st.lists(st.integers(-2**31, 2**31 - 1), max_size=3),
       bias=st.dictionaries(st.integers(-2**31, 2**31 - 1), odd_floats, max_size=2))
def test_random_grpc_params_are_served_or_invalid_argument(grpc_stub, engine, temperature, top_p, min_p, penalty,
                                                           top_k, seed, max_tokens, min_tokens, stop, bias):
    params = common_pb2.SamplingParams(
        temperature=temperature, top_p=top_p, min_p=min_p, frequency_penalty=penalty, top_k=top_k, seed=seed,
        max_tokens=max_tokens, min_tokens=min_tokens,
        stop_token_ids=stop, logit_bias=bias)
    if 0 < max_tokens and max_tokens > 6:
        params.max_tokens = 1 + max_tokens % 6  # valid ones stay small
    request = verifier_pb2.GenerateRequest(prompt_token_ids=[5, 9, 17], params=params)
    try:
        list(grpc_stub.Generate(request, timeout=60))
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details(), params)
    assert engine.alive
