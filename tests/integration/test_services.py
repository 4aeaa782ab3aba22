"""The services as deployed: real processes (Redis, drafters, verifier) on loopback.

Models are tiny random ones saved to disk (a sharpened Qwen3 target with its own tokenizer, a D3D
drafter): decoding is lossless whatever the drafter guesses, so every output through the services
must equal plain greedy decoding in this process, token for token — under concurrency, with a
drafter killed mid-run, and with Redis gone.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import redis
import torch

from services.client import metrics, stream_completion
from services.common.config import ServiceConfig
from services.common.server import open_channel
from services.up import Stack, StackConfig, stack_ports
from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.data.tokenizer import save_tokenizer, train_tokenizer
from specd.engine import autoregressive
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.loading import save_model
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.sampling import SamplingParams

TOKEN = "integration-token"
MODEL = "target"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target module, target directory, drafter directory, tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    words = ["red", "green", "blue", "big"], ["fox", "dog", "cat", "owl"], ["walls", "logs", "hills", "stars"]
    texts = [f"the {a} {b} jumps over the {c} {i} times" for i, (a, b, c) in
             enumerate((a, b, c) for a in words[0] for b in words[1] for c in words[2])]
    tokenizer = train_tokenizer(texts * 4, vocab_size=300)
    vocab = tokenizer.get_vocab_size()
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(dataclasses.replace(FLAVOURS["debug"], vocab_size=vocab, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # greedy text with structure a drafter can sometimes guess
    save_model(target, root / MODEL)
    save_tokenizer(tokenizer, root / MODEL)
    torch.manual_seed(1)
    save_model(D3DModel(dataclasses.replace(D3D_FLAVOURS["debug"], vocab_size=vocab)).eval(), root / "drafter")
    return target, str(root / MODEL), str(root / "drafter"), tokenizer


def stack_config(models, **overrides) -> StackConfig:
    _, target, drafter, _ = models
    defaults = dict(**stack_ports(), trainer=False, auth_token=TOKEN, block_size=4, max_num_seqs=8)
    return StackConfig(target=target, drafter=drafter, **{**defaults, **overrides})


def prompts(num: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(num)
    return [torch.randint(7, vocab, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 16, (num,), generator=generator)]


def expected(models, batch, max_tokens):
    target = models[0]
    return [g.token_ids for g in autoregressive(target, batch, SamplingParams(max_tokens=max_tokens))]


def generate(stub, prompt, max_tokens, *, metadata=(("authorization", f"Bearer {TOKEN}"),), first=None):
    request = verifier_pb2.GenerateRequest(prompt_token_ids=prompt,
                                           params=common_pb2.SamplingParams(max_tokens=max_tokens))
    tokens = []
    for message in stub.Generate(request, metadata=metadata, timeout=120):
        tokens.extend(message.token_ids)
        if first is not None and tokens:
            first.set()
    return tokens


@pytest.fixture(scope="module")
def stack(models):
    with Stack(stack_config(models, drafters=2)) as running:
        running.wait_drafting()
        yield running


@pytest.fixture(scope="module")
def stub(stack):
    channel = open_channel(stack.verifiers[0].grpc, ServiceConfig())
    yield verifier_pb2_grpc.VerifierStub(channel)
    channel.close()


# ---------------------------------------------------------------------------- lossless
def test_grpc_generate_equals_plain_greedy(models, stack, stub):
    batch = prompts(12, models[0].config.vocab_size)
    with ThreadPoolExecutor(12) as pool:
        outputs = list(pool.map(lambda p: generate(stub, p, 20), batch))
    assert outputs == expected(models, batch, 20)
    samples = metrics(stack.verifiers[0].http)
    assert samples["specd:spec_decode_num_draft_tokens_total"] > 0  # the drafters really drafted


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_equals_plain_greedy(models, stack, stream):
    tokenizer = models[3]
    batch = prompts(6, models[0].config.vocab_size)
    client = openai.OpenAI(base_url=f"{stack.verifiers[0].http}/v1", api_key=TOKEN, max_retries=0)

    def complete(prompt):
        if not stream:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(complete, batch))
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected(models, batch, 16)]


def test_a_request_with_store_false_leaves_no_trace_for_the_trainer(models, stack, stub):
    """OpenAI's ``store: false`` (HTTP) and ``store = false`` (gRPC) keep a request out of the
    trace stream the trainer distils from; the same requests without it are traced."""
    generator = torch.Generator().manual_seed(99)
    unique = [torch.randint(7, models[0].config.vocab_size, (21,), generator=generator).tolist() for _ in range(4)]
    skipped_http, skipped_grpc, kept_http, kept_grpc = unique
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    base = stack.verifiers[0].http
    stream_completion(base, "/v1/completions", {**body, "prompt": skipped_http, "store": False}, token=TOKEN)
    request = verifier_pb2.GenerateRequest(prompt_token_ids=skipped_grpc, store=False,
                                           params=common_pb2.SamplingParams(max_tokens=4))
    list(stub.Generate(request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=120))
    stream_completion(base, "/v1/completions", {**body, "prompt": kept_http}, token=TOKEN)
    generate(stub, kept_grpc, 4)
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    deadline = time.monotonic() + 30
    while True:  # one writer thread, in order: once the kept ones are in, the skipped ones would be too
        traced = [json.loads(fields["prompt_ids"]) for _, fields in client.xrange("specd:traces")]
        if (kept_http in traced and kept_grpc in traced) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert kept_http in traced and kept_grpc in traced
    assert skipped_http not in traced and skipped_grpc not in traced


def test_bench_online_measures_the_live_drafter_per_domain_and_records_every_gate_decision(models, tmp_path):
    """`specd bench online`'s mechanics on tiny models: an evaluation of every domain at the start
    and after each period of traffic, no failed request, and one record per gate decision the
    trainer made (whether distillation raises τ is what the bench measures on SmolLM2)."""
    from services.online_bench import OnlineSettings, bench_online, format_table, plot
    from specd.data import DOMAINS

    vocab = models[0].config.vocab_size
    heldout = {domain: prompts(2 + i, vocab)[:2] for i, domain in enumerate(DOMAINS)}
    settings = OnlineSettings(minutes=0.4, eval_minutes=0.2, max_tokens=16, eval_max_tokens=12, block=4,
                              steps_per_version=1, status_every=0.5,
                              trainer_args=("--batch-size", "1", "--heldout-every", "2", "--min-heldout", "1",
                                            "--anchors-per-seq", "2", "--branches-per-anchor", "2",
                                            "--block-ms", "200"))
    result = bench_online(settings, models[1], models[2], str(tmp_path), heldout=heldout, pool=prompts(16, vocab))
    assert result.failed_requests == 0, result.errors
    assert [m.domain for m in result.tau] == list(DOMAINS) * 3
    seconds = sorted({m.seconds for m in result.tau})
    assert len(seconds) == 3 and seconds[0] == 0 and seconds[-1] >= 24
    assert all(m.requests == 2 and m.tau >= 1 for m in result.tau)
    assert result.traffic_requests > 0 and result.trainer_steps >= 1 and result.supervised_tokens > 0
    assert len(result.versions) == result.versions_published + result.versions_refused >= 1
    assert sum(r.passed for r in result.versions) == result.versions_published
    published = {r.version for r in result.versions if r.passed}
    assert {m.version for m in result.tau} <= published | {"initial"}
    offer = result.worse_offer  # refused or not between two random drafters: SmolLM2's run shows the refusal
    assert offer is not None and offer.reason and offer.live_before and offer.live_after
    assert "τ code (new)" in format_table(result) and plot(result, tmp_path / "online.png").stat().st_size > 0


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("prompt, max_tokens, message", [
    ([10**6], 4, "outside the vocabulary"),
    ([], 4, "empty"),
    ([9, 10], 0, "max_tokens"),
    ([9] * 5000, 4, "context"),
])
def test_bad_grpc_input_is_invalid_argument(stub, prompt, max_tokens, message):
    with pytest.raises(grpc.RpcError) as caught:
        generate(stub, prompt, max_tokens)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    assert len(generate(stub, [9, 10, 11], 3)) == 3  # still serving


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),)])
def test_grpc_without_the_token_is_unauthenticated(stub, metadata):
    with pytest.raises(grpc.RpcError) as caught:
        generate(stub, [9, 10], 2, metadata=metadata)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_http_errors_are_openai_style(stack):
    client = openai.OpenAI(base_url=f"{stack.verifiers[0].http}/v1", api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="no-such-model", prompt="the red fox", max_tokens=4)
    assert caught.value.status_code == 400 and caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="the red fox", max_tokens=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.verifiers[0].http}/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL, prompt="the", max_tokens=2)
    assert client.completions.create(model=MODEL, prompt="the red fox", max_tokens=3).usage.completion_tokens >= 1


# ---------------------------------------------------------------------------- faults
def test_drafter_killed_and_redis_stopped_mid_run(models):
    """kill -9 of one drafter replica, then of Redis, during 32 concurrent streams: every request
    completes with exactly the plain greedy output, and the verifier counts the traces it dropped."""
    batch = prompts(32, models[0].config.vocab_size)
    want = expected(models, batch, 24)
    with Stack(stack_config(models, drafters=2, max_num_seqs=16)) as stack:
        stack.wait_drafting()  # the kill must hit drafters in use
        channel = open_channel(stack.verifiers[0].grpc, ServiceConfig())
        stub = verifier_pb2_grpc.VerifierStub(channel)
        started = [threading.Event() for _ in batch]
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(generate, stub, p, 24, first=e) for p, e in zip(batch, started)]
            started[0].wait(60)
            stack.kill("drafter-0")
            started[-1].wait(60)
            stack.kill("redis")
            outputs = [f.result() for f in futures]
        assert outputs == want
        # A new request after both faults: still served, still exact.
        assert generate(stub, batch[0], 24) == want[0]
        samples = metrics(stack.verifiers[0].http)
        assert samples.get("specd:traces_dropped_total{reason=redis_unavailable}", 0) >= 1
        events = {k: v for k, v in samples.items() if k.startswith("specd:drafter_pool_events")}
        assert events["specd:drafter_pool_events_total{event=replica_failures}"] >= 1, events  # it noticed
        channel.close()


def test_sigterm_drains_in_flight_requests(models):
    """A verifier told to stop finishes what it is decoding, refuses new work, and exits 0."""
    batch = prompts(4, models[0].config.vocab_size)
    stack = Stack(stack_config(models, drafters=1)).start()
    try:
        channel = open_channel(stack.verifiers[0].grpc, ServiceConfig())
        stub = verifier_pb2_grpc.VerifierStub(channel)
        started = [threading.Event() for _ in batch]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(generate, stub, p, 40, first=event) for p, event in zip(batch, started)]
            # Every request is in flight (has streamed a token) before the stop: one the engine has
            # not admitted yet is rightly refused with UNAVAILABLE, which a loaded host can cause.
            assert all(event.wait(60) for event in started)
            verifier = stack.verifiers[0].process
            verifier.terminate()
            outputs = [f.result() for f in futures]
        assert outputs == expected(models, batch, 40)
        assert verifier.wait(30) == 0
        channel.close()
    finally:
        stack.stop()


def test_bench_profile_times_the_drafter_through_a_replica_and_the_verifier_in_service(models):
    """`specd bench profile`'s service part: the drafter tables become round trips through a real
    replica (the bare passes kept beside them), and a verifier under closed-loop HTTP load, plain
    and speculating, reports its rows, pass and overhead per level — a profile the simulator loads."""
    from services.calibrate import measure_services
    from specd.bench.profile import ProfileSettings, measure_profile
    from specd.models.loading import load_model
    from specd.plan.profile import parse_profile

    target, target_dir, drafter_dir, tokenizer = models
    drafter = load_model(drafter_dir)
    settings = ProfileSettings(batches=(1, 2), tokens=(1, 5), budgets=(1,), tails=(2, 8), context=8, repeats=1,
                               block_size=4, extra_blocks=(), acceptance_batches=(2,), max_tokens=6)
    pool = prompts(6, tokenizer.get_vocab_size())
    profile = measure_profile(target, drafter, pool, settings)
    bare = {"drafter": profile.drafter, "speculate": profile.speculate}
    measure_services(profile, settings, target_dir, drafter_dir, drafter, pool, levels=(1, 4))

    loaded = parse_profile(profile.to_json())  # what `specd bench profile` writes, read back
    assert loaded.to_json() == profile.to_json() and loaded.serving.drafter_round_trips
    for table, passes, before in ((profile.drafter, profile.drafter_pass, bare["drafter"]),
                                  (profile.speculate, profile.speculate_pass, bare["speculate"])):
        assert passes.seconds == before.seconds  # the bare passes stay, beside
        assert [len(row) for row in table.seconds] == [len(row) for row in before.seconds]
        assert table.seconds != before.seconds  # ... the round trips, measured anew
    verifier = profile.serving.verifier
    assert verifier.concurrency == [1, 4] and verifier.requests == [16, 16]
    assert [len(t) for t in verifier.trace] == [16, 16]  # (prompt, output) per request, replayed by the sim
    # ... with the prompt's index in the pool, which names its verified blocks in the samples.
    assert [entry[2] for entry in verifier.trace[0]] == [i % len(pool) for i in range(16)]
    assert set(profile.block_samples.prompt) <= set(range(len(pool)))
    # One client: every pass has exactly one row. Four: never more than four.
    assert verifier.rows[0] == pytest.approx(1.0) and 1.0 < verifier.rows[1] <= 4.0
    assert all(s > 0 for s in verifier.target_scale) and all(s >= 0 for s in verifier.overhead_seconds)
    assert loaded.serving.verifier.overhead(1) == pytest.approx(verifier.overhead_seconds[0])
    # The same verifier speculating with one drafter replica: rows counted by drafts, the pass's
    # shape (1 + the mean verified block), its ratio to the table at that shape.
    speculative = profile.serving.speculative
    assert speculative.concurrency == [1, 4] and speculative.rows[0] == pytest.approx(1.0)
    assert all(1.0 <= t <= 1 + settings.block_size for t in speculative.tokens_per_row)
    assert all(s > 0 for s in speculative.target_scale) and all(s >= 0 for s in speculative.overhead_seconds)
    assert loaded.serving.speculative.overhead(1) == pytest.approx(speculative.overhead_seconds[0])
    # ... and drafting synchronously: every step waits for a Draft round trip, outside its overhead.
    synchronous = profile.serving.speculative_sync
    assert synchronous.concurrency == [1, 4] and synchronous.rows[0] == pytest.approx(1.0)
    assert all(s > 0 for s in synchronous.target_scale) and all(s >= 0 for s in synchronous.overhead_seconds)
    assert loaded.serving.speculative_sync.scale(1) == pytest.approx(synchronous.target_scale[0])
    # Every sync step waits for a Draft: its measured wait over the simulator's is a ratio too.
    assert all(d > 0 for d in synchronous.draft_seconds) and all(s > 0 for s in synchronous.draft_scale)
    assert loaded.serving.speculative_sync.draft(1) == pytest.approx(synchronous.draft_scale[0])
