"""Verifier.Score over a real in-process gRPC server: remote supervision == local supervision.

`RemoteScorer` -> gRPC -> `ScoreHandler` -> `LocalScorer` must give the probabilities the trainer
would compute with the target in its own process (full distributions: bit for bit over the wire;
top-k: the same ids and log-probs), refuse bad input with a clear status, fail over between
verifiers, and make one SpecOPD step exactly the local step. The handler keeps to the model's
context and a per-call budget before the model runs, and shares the target with generation: it
scores chunk by chunk, releasing the engine's lock between chunks, with the numbers of one pass.
"""

from __future__ import annotations

import copy
import threading
import time

import grpc
import pytest
import torch

from services.common.config import ServiceConfig
from services.common.server import GrpcServer, open_channel
from services.common.wire import tensor_from_proto, tree_to_proto
from services.trainer.scorer import RemoteScorer, ScorerUnavailable
from services.verifier.score import ScoreHandler
from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.ports import free_port
from specd.threads import FairLock
from specd.train.specopd import (
    LocalScorer,
    SpecOPDConfig,
    SpecOPDTrainer,
    Trajectory,
    proposal_tree,
    sample_branches,
)
from specd.tree import TokenTree

VOCAB = FLAVOURS["debug"].vocab_size


class ScoreOnly(verifier_pb2_grpc.VerifierServicer):
    """A verifier servicer with only Score, as the verifier service wires it."""

    def __init__(self, handler: ScoreHandler) -> None:
        self.handler = handler

    def Score(self, request, context):
        return self.handler(request, context)


def serve(handler: ScoreHandler) -> tuple[GrpcServer, str]:
    server = GrpcServer("verifier-test", ServiceConfig())
    verifier_pb2_grpc.add_VerifierServicer_to_server(ScoreOnly(handler), server.server)
    port = server.start(["specd.v1.Verifier"])
    server.set_serving()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(2)
    model = Qwen3ForCausalLM(FLAVOURS["debug"]).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # peaked p: a wrong row shows up in the numbers
    return model


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(4)
    return D3DModel(D3D_FLAVOURS["debug"]).eval()


@pytest.fixture(scope="module")
def verifier(target):
    server, address = serve(ScoreHandler(target, threading.Lock()))
    yield address
    server.stop(None)


@pytest.fixture(scope="module")
def stub(verifier):
    with open_channel(verifier, ServiceConfig()) as channel:
        yield verifier_pb2_grpc.VerifierStub(channel)


def trajectories(num: int, seed: int = 0) -> list[Trajectory]:
    generator = torch.Generator().manual_seed(seed)
    return [
        Trajectory(prompt=torch.randint(7, VOCAB, (3 + 2 * i,), generator=generator).tolist(),
                   response=torch.randint(7, VOCAB, (10 + 3 * i,), generator=generator).tolist())
        for i in range(num)
    ]


def proposal_trees(drafter) -> tuple[list[list[int]], list, list[list[int]]]:
    """Contexts, proposal trees (sampled branches at several anchors) and anchor - 1 rows."""
    data = trajectories(3)
    anchors = [[3, 6, 9], [5, 8, 12, 14], [7, 10]]
    contexts = [t.tokens[: max(row)] for t, row in zip(data, anchors)]
    branches, _ = sample_branches(drafter, contexts, anchors, 4, 3, torch.Generator().manual_seed(0))
    trees, group = [], 0
    for row in anchors:
        paths = [(a, branches[group + j, k, :3].tolist()) for j, a in enumerate(row) for k in range(3)]
        trees.append(proposal_tree(paths)[0])
        group += len(row)
    return contexts, trees, [[a - 1 for a in row] for row in anchors]


def remote(address: str | list[str], top_k: int = 0, **kwargs) -> RemoteScorer:
    addresses = [address] if isinstance(address, str) else address
    return RemoteScorer(addresses, ServiceConfig(deadline_seconds=10), top_k, vocab_size=VOCAB, **kwargs)


def test_remote_full_distributions_equal_local(target, drafter, verifier):
    contexts, trees, rows = proposal_trees(drafter)
    local = LocalScorer(target).score(contexts, trees, rows)
    # max_response_bytes=1: every sequence in its own request, answers reassembled in order.
    for scorer in (remote(verifier), remote(verifier, max_response_bytes=1)):
        answers = scorer.score(contexts, trees, rows)
        scorer.close()
        assert [a.shape for a in answers] == [(len(r) + t.num_nodes, VOCAB) for r, t in zip(rows, trees)]
        worst = max(float((a - b).abs().max()) for a, b in zip(answers, local))
        print(f"max |p_remote - p_local| = {worst:.2e}")
        assert worst <= 1e-6


def test_top_k_sends_the_top_ids_and_log_probs(target, drafter, verifier, stub):
    contexts, trees, rows = proposal_trees(drafter)
    local = LocalScorer(target).score(contexts, trees, rows)
    k = 5
    request = verifier_pb2.ScoreRequest(top_k=k, sequences=[
        verifier_pb2.ScoreSequence(context=c, tree=tree_to_proto(t), context_rows=r) for c, t, r in zip(contexts, trees, rows)
    ])
    response = stub.Score(request)
    scorer = remote(verifier, top_k=k)
    rebuilt = scorer.score(contexts, trees, rows)
    scorer.close()
    for result, p, q in zip(response.results, local, rebuilt):
        ids = tensor_from_proto(result.top_ids).long()
        logprobs = tensor_from_proto(result.top_logprobs)
        rest = tensor_from_proto(result.rest_logprob)
        top, expected_ids = p.topk(k, dim=-1)
        assert torch.equal(ids, expected_ids)
        assert (logprobs - top.log()).abs().max() < 1e-5
        assert (rest.exp() - (1 - top.sum(-1))).abs().max() < 1e-5
        # The rebuilt distribution: exact on the top k, the rest mass uniform elsewhere, sums to 1.
        assert (q.gather(-1, ids) - top).abs().max() < 1e-6
        others = q.scatter(-1, ids, 0.0)
        assert (others.sum(-1) - rest.exp()).abs().max() < 1e-5
        assert (others.max(-1).values * (VOCAB - k) - rest.exp()).abs().max() < 1e-5
        assert (q.sum(-1) - 1).abs().max() < 1e-5


def test_temperature_scales_the_logits(target, drafter, stub):
    contexts, trees, rows = proposal_trees(drafter)
    request = verifier_pb2.ScoreRequest(temperature=2.0, sequences=[
        verifier_pb2.ScoreSequence(context=contexts[0], tree=tree_to_proto(trees[0]), context_rows=rows[0])
    ])
    probs = tensor_from_proto(stub.Score(request).results[0].probs)
    expected = LocalScorer(target, temperature=2.0).score(contexts[:1], trees[:1], rows[:1])[0]
    assert (probs - expected).abs().max() <= 1e-6
    assert (probs - LocalScorer(target).score(contexts[:1], trees[:1], rows[:1])[0]).abs().max() > 1e-3


def _tree(tokens, parents, anchors) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(tokens=tokens, parents=parents, anchors=anchors)


BAD_REQUESTS = {
    "no sequences": (verifier_pb2.ScoreRequest(), "no sequences"),
    "context id outside the vocabulary": (verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=[5, VOCAB], tree=_tree([9], [-1], [2]))]), "outside the vocabulary"),
    "tree token outside the vocabulary": (verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=[5, 6], tree=_tree([-3], [-1], [2]))]), "outside the vocabulary"),
    "parent not earlier": (verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=[5, 6], tree=_tree([9, 10], [1, -1], [2, 2]))]), "malformed tree"),
    "tree lengths differ": (verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=[5, 6], tree=_tree([9, 10], [-1], [2, 2]))]), "malformed tree"),
    "anchor beyond the context": (verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=[5, 6], tree=_tree([9], [-1], [3]))]), "beyond its context"),
    "context row outside the context": (verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=[5, 6], tree=_tree([9], [-1], [2]), context_rows=[2])]), "context row 2"),
    "empty context": (verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=[], tree=_tree([9], [-1], [0]))]), "empty context"),
    "temperature zero": (verifier_pb2.ScoreRequest(temperature=0.0, sequences=[
        verifier_pb2.ScoreSequence(context=[5], tree=_tree([9], [-1], [1]))]), "temperature"),
    "top_k above the vocabulary": (verifier_pb2.ScoreRequest(top_k=VOCAB + 1, sequences=[
        verifier_pb2.ScoreSequence(context=[5], tree=_tree([9], [-1], [1]))]), "top_k"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_the_server_stays_up(case, stub):
    request, words = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as caught:
        stub.Score(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert words in caught.value.details()
    good = verifier_pb2.ScoreRequest(sequences=[verifier_pb2.ScoreSequence(context=[5, 6], tree=_tree([9], [-1], [2]))])
    assert tensor_from_proto(stub.Score(good).results[0].probs).shape == (1, VOCAB)


def test_requests_above_the_limits_are_resource_exhausted(target):
    server, address = serve(ScoreHandler(target, threading.Lock(), max_nodes=4, max_response_bytes=3 * 4 * VOCAB))
    try:
        with open_channel(address, ServiceConfig()) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            too_many = verifier_pb2.ScoreRequest(sequences=[
                verifier_pb2.ScoreSequence(context=[5, 6], tree=_tree([9] * 5, [-1, 0, 1, 2, 3], [2] * 5))])
            too_big = verifier_pb2.ScoreRequest(sequences=[
                verifier_pb2.ScoreSequence(context=[5, 6], tree=_tree([9] * 3, [-1, 0, 1], [2] * 3), context_rows=[1])])
            for request, words in ((too_many, "tree nodes"), (too_big, "top_k > 0")):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Score(request)
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert words in caught.value.details()
            too_big.top_k = 4  # the same rows as top-k fit
            assert len(stub.Score(too_big).results) == 1
    finally:
        server.stop(None)


def test_fails_over_to_the_next_verifier_and_says_when_none_answers(target, drafter, verifier):
    contexts, trees, rows = proposal_trees(drafter)
    dead = f"127.0.0.1:{free_port()}"
    scorer = remote([dead, verifier])
    local = LocalScorer(target).score(contexts, trees, rows)
    for _ in range(2):  # round-robin starts at the dead one, then continues past it
        answers = scorer.score(contexts, trees, rows)
        assert all(torch.equal(a, b) for a, b in zip(answers, local))
    scorer.close()
    nobody = remote([dead])
    with pytest.raises(ScorerUnavailable, match=dead):
        nobody.score(contexts, trees, rows)
    nobody.close()


def test_a_specopd_step_with_the_remote_scorer_equals_the_local_step(target, drafter, verifier):
    config = SpecOPDConfig(block_size=4, anchors_per_seq=3, branches_per_anchor=3, lr=3e-3, seed=5)
    local = SpecOPDTrainer(target, copy.deepcopy(drafter), config)
    scorer = remote(verifier, stop_token_ids=target.config.stop_token_ids)
    distant = SpecOPDTrainer(scorer, copy.deepcopy(drafter), config)
    assert distant.target is None
    assert_same_training(local, distant)
    scorer.close()


def assert_same_training(local: SpecOPDTrainer, distant: SpecOPDTrainer) -> None:
    """Two SpecOPD steps on one batch: the same supervised tokens, losses and drafter weights."""
    batch = trajectories(3, seed=1)
    for _ in range(2):
        a, b = local.step(batch), distant.step(batch)
        assert a.num_supervised_tokens == b.num_supervised_tokens > 0
        assert abs(a.loss - b.loss) <= 1e-6, (a.loss, b.loss)
    for (name, x), y in zip(local.drafter.state_dict().items(), distant.drafter.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6, rtol=0), name


# ---------------------------------------------------------------------------- limits and fairness
class CountingLock:
    """The target lock, counting how often it was taken (the handler takes it once per chunk)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries = 0

    def __enter__(self) -> None:
        self.lock.acquire()
        self.entries += 1

    def __exit__(self, *exc_info) -> None:
        self.lock.release()


class CountingPasses:
    """Counts the target's forward passes while in the ``with`` block."""

    def __init__(self, target) -> None:
        self.target = target
        self.passes = 0

    def __enter__(self) -> "CountingPasses":
        self.handle = self.target.register_forward_pre_hook(lambda *args: setattr(self, "passes", self.passes + 1))
        return self

    def __exit__(self, *exc_info) -> None:
        self.handle.remove()


def random_ids(num: int, generator: torch.Generator) -> list[int]:
    return torch.randint(7, VOCAB, (num,), generator=generator).tolist()


def test_a_sequence_beyond_the_model_context_is_refused_before_the_model_runs(target, stub):
    limit = target.config.max_position_embeddings  # the default handler's max_model_len
    generator = torch.Generator().manual_seed(3)
    long_context = random_ids(limit + 1, generator)
    near_full = random_ids(limit - 1, generator)
    refused = {
        # The probe: more context tokens than the model has positions.
        f"the context has {limit + 1} tokens": verifier_pb2.ScoreSequence(
            context=long_context, tree=_tree([9], [-1], [limit + 1])),
        # The context fits but a branch runs past the last position (anchor + depth = limit).
        f"position {limit} (anchor + depth)": verifier_pb2.ScoreSequence(
            context=near_full, tree=_tree([9, 10], [-1, 0], [limit - 1] * 2)),
    }
    for words, sequence in refused.items():
        request = verifier_pb2.ScoreRequest(sequences=[
            verifier_pb2.ScoreSequence(context=[5, 6], tree=_tree([9], [-1], [2])), sequence])
        with CountingPasses(target) as counter, pytest.raises(grpc.RpcError) as caught:
            stub.Score(request)
        # As generation refuses a prompt that does not fit: INVALID_ARGUMENT, the limit named.
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert words in caught.value.details() and f"this model's context is {limit} tokens" in caught.value.details()
        assert counter.passes == 0
    # The last position itself is allowed.
    fits = verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=near_full, tree=_tree([9], [-1], [limit - 1]), context_rows=[0])])
    assert tensor_from_proto(stub.Score(fits).results[0].probs).shape == (2, VOCAB)


def test_the_engine_max_model_len_is_the_limit_when_given(target):
    server, address = serve(ScoreHandler(target, threading.Lock(), max_model_len=16))
    try:
        with open_channel(address, ServiceConfig()) as channel, CountingPasses(target) as counter:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Score(verifier_pb2.ScoreRequest(sequences=[
                    verifier_pb2.ScoreSequence(context=list(range(7, 24)), tree=_tree([9], [-1], [17]))]))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "the context has 17 tokens, but this model's context is 16 tokens" in caught.value.details()
            assert counter.passes == 0
            ok = verifier_pb2.ScoreRequest(sequences=[
                verifier_pb2.ScoreSequence(context=list(range(7, 22)), tree=_tree([9], [-1], [15]))])
            assert len(stub.Score(ok).results) == 1 and counter.passes > 0
    finally:
        server.stop(None)


def test_a_request_over_the_per_call_budget_is_resource_exhausted(target):
    server, address = serve(ScoreHandler(target, threading.Lock(), max_call_tokens=20))
    try:
        with open_channel(address, ServiceConfig()) as channel, CountingPasses(target) as counter:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            # Two sequences of 8 context tokens + 2 tree nodes: 20 tokens, the budget exactly.
            sequences = [verifier_pb2.ScoreSequence(context=list(range(7, 15)), tree=_tree([9, 10], [-1, 0], [8, 8]))
                         for _ in range(2)]
            assert len(stub.Score(verifier_pb2.ScoreRequest(sequences=sequences)).results) == 2
            passes = counter.passes
            sequences[1].tree.tokens.append(11)  # one tree node more: 21 tokens
            sequences[1].tree.parents.append(1)
            sequences[1].tree.anchors.append(8)
            more_context = copy.deepcopy(sequences[0])
            more_context.context.append(7)  # or one context token more
            for request in (verifier_pb2.ScoreRequest(sequences=sequences),
                            verifier_pb2.ScoreRequest(sequences=[sequences[0], more_context])):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Score(request)
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                details = caught.value.details()
                assert "21 tokens" in details and "per-call budget of 20 tokens" in details
            assert counter.passes == passes  # refused before the model
    finally:
        server.stop(None)


def test_chunked_scoring_equals_one_pass_over_the_request(target):
    """Chunks only regroup the sequences: each one's probabilities are those of one pass over all."""
    generator = torch.Generator().manual_seed(6)
    contexts = [random_ids(n, generator) for n in (30, 30, 200, 10, 10, 10)]
    # Five nodes each, two branches at two anchors: a chunk costs len(chunk) * (context + 5).
    trees = [TokenTree.from_paths([(len(c), random_ids(3, generator)), (len(c) - 2, random_ids(2, generator))])
             for c in contexts]
    rows = [[0, len(c) - 1] for c in contexts]
    request = verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=c, tree=tree_to_proto(t), context_rows=r)
        for c, t, r in zip(contexts, trees, rows)
    ])
    whole = LocalScorer(target).score(contexts, trees, rows)
    # Default: one chunk, the very same pass. 75: [30, 30] (2 x 35), [200] alone (larger than a
    # chunk), [10, 10, 10] (3 x 15). 1: every sequence alone.
    for max_chunk_tokens, num_chunks in ((4096, 1), (75, 3), (1, len(contexts))):
        lock = CountingLock()
        server, address = serve(ScoreHandler(target, lock, max_chunk_tokens=max_chunk_tokens))
        try:
            with open_channel(address, ServiceConfig()) as channel:
                results = verifier_pb2_grpc.VerifierStub(channel).Score(request).results
        finally:
            server.stop(None)
        chunked = [tensor_from_proto(r.probs) for r in results]
        assert lock.entries == num_chunks
        worst = max(float((a - b).abs().max()) for a, b in zip(chunked, whole))
        print(f"max_chunk_tokens={max_chunk_tokens} ({num_chunks} chunks): max |p_chunked - p_whole| = {worst:.2e}")
        if num_chunks == 1:
            assert all(torch.equal(a, b) for a, b in zip(chunked, whole))
        for a, b in zip(chunked, whole):
            # Another padding changes fp32 rounding only (matmul and softmax over other shapes).
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_an_engine_step_gets_the_target_between_score_chunks(target):
    """While a large Score call runs, a thread stepping like the engine (asking for the target
    again the moment it lets go) waits at most ~one chunk, and the call is not starved either."""
    lock = FairLock()  # the engine's target lock
    server, address = serve(ScoreHandler(target, lock))  # the defaults the verifier runs with
    generator = torch.Generator().manual_seed(7)
    # 2100 context tokens each: two do not fit the default 4096-token chunk, so 12 chunks.
    sequences = [verifier_pb2.ScoreSequence(context=random_ids(2100, generator), context_rows=[2099],
                                            tree=_tree([9, 10, 11], [-1, 0, 1], [2100] * 3)) for _ in range(12)]
    waits: list[tuple[float, float]] = []  # (asked, got) per step, time.monotonic()
    stepping, stop = threading.Event(), threading.Event()

    def engine_steps() -> None:
        while not stop.is_set():
            asked = time.monotonic()
            with lock:
                waits.append((asked, time.monotonic()))
                stepping.set()
                time.sleep(0.002)  # a step's pass

    engine = threading.Thread(target=engine_steps, daemon=True)
    try:
        with open_channel(address, ServiceConfig(deadline_seconds=120)) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            engine.start()
            assert stepping.wait(10)
            start = time.monotonic()
            assert len(stub.Score(verifier_pb2.ScoreRequest(sequences=sequences)).results) == len(sequences)
            end = time.monotonic()
    finally:
        stop.set()
        engine.join(10)
        server.stop(None)
    total = end - start
    during = [(asked, got) for asked, got in waits if got > start and asked < end]  # waits overlapping the call
    steps = sum(start < got < end for _, got in during)
    longest = max(got - asked for asked, got in during)
    print(f"Score took {total:.3f} s; {steps} engine steps in it, the longest wait {longest:.3f} s")
    # Held for the whole call, the engine would wait ~the whole call once, stepping only while the
    # request is parsed and answered (a few steps); released between the 12 chunks, it steps ~once
    # per chunk and waits ~one chunk (the lock is FIFO both ways).
    assert steps >= 8
    assert longest < total / 3
