"""Verifier.Score over the tensor channel (gloo, in one process): the same supervision as a local
target, with the data off the gRPC answer; and every way a channel fails ends in plain gRPC.

Both ranks live in this process, which works because every channel is its own process group on
its own store (never the default group).
"""

from __future__ import annotations

import copy
import math
import threading

import grpc
import pytest
import torch
from test_score_service import VOCAB, ScoreOnly, assert_same_training, proposal_trees

from services.common.config import ServiceConfig
from services.common.server import GrpcServer, open_channel
from services.common.tensor_channel import TrainerChannel
from services.common.wire import tensor_from_proto, tree_from_proto, tree_to_proto
from services.trainer.scorer import RemoteScorer
from services.verifier.score import ScoreHandler
from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.train.specopd import LocalScorer, SpecOPDConfig, SpecOPDTrainer

HOST = "127.0.0.1"


class Verifier:
    """A Score-only verifier server on ``port`` (0: a free one), and its handler."""

    def __init__(self, target, port: int = 0) -> None:
        self.handler = ScoreHandler(target, threading.Lock())
        self.server = GrpcServer("verifier-test", ServiceConfig(port=port))
        verifier_pb2_grpc.add_VerifierServicer_to_server(ScoreOnly(self.handler), self.server.server)
        self.port = self.server.start(["specd.v1.Verifier"])
        self.server.set_serving()
        self.address = f"{HOST}:{self.port}"

    def stop(self) -> None:
        """As a verifier process ending: the server stops and its side of every channel goes."""
        self.server.stop(None)
        self.handler.close()


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(2)
    model = Qwen3ForCausalLM(FLAVOURS["debug"]).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # peaked p: a wrong or misordered row shows up in the numbers
    return model


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(4)
    return D3DModel(D3D_FLAVOURS["debug"]).eval()


@pytest.fixture
def verifier(target):
    running = Verifier(target)
    yield running
    running.stop()


def tensor_scorer(address: str, **kwargs) -> RemoteScorer:
    options = {"channel_host": HOST, "channel_timeout": 5.0, **kwargs}
    return RemoteScorer([address], ServiceConfig(deadline_seconds=10), vocab_size=VOCAB, transport="tensor", **options)


def worst_difference(answers, expected) -> float:
    assert [a.shape for a in answers] == [b.shape for b in expected]
    return max(float((a - b).abs().max()) for a, b in zip(answers, expected))


def test_calls_reuse_one_channel_and_equal_the_local_scorer(target, drafter, verifier):
    contexts, trees, rows = proposal_trees(drafter)
    local = LocalScorer(target).score(contexts, trees, rows)
    # max_response_bytes=1: one request per sequence, so 3 Score calls per score() on one channel.
    scorer = tensor_scorer(verifier.address, max_response_bytes=1)
    try:
        for call in range(3):
            order = [(call + i) % 3 for i in range(3)]  # other row counts in each position: pairing matters
            answers = scorer.score([contexts[i] for i in order], [trees[i] for i in order], [rows[i] for i in order])
            worst = worst_difference(answers, [local[i] for i in order])
            print(f"call {call}: max |p_channel - p_local| = {worst:.2e}")
            assert worst <= 1e-6
        assert (scorer.counters.opened, scorer.counters.on_channel, scorer.counters.fallbacks) == (1, 9, 0)
        assert len(verifier.handler.channels) == 1
    finally:
        scorer.close()


def test_the_answer_carries_shapes_only_and_the_tensors_follow(target, drafter, verifier):
    contexts, trees, rows = proposal_trees(drafter)
    local = LocalScorer(target).score(contexts, trees, rows)
    channel = TrainerChannel(HOST, timeout=5.0)
    try:
        with open_channel(verifier.address, ServiceConfig()) as grpc_channel:
            stub = verifier_pb2_grpc.VerifierStub(grpc_channel)
            for _ in range(2):
                request = verifier_pb2.ScoreRequest(channel=channel.next_request(), sequences=[
                    verifier_pb2.ScoreSequence(context=c, tree=tree_to_proto(t), context_rows=r)
                    for c, t, r in zip(contexts, trees, rows)])
                response = stub.Score(request)
                assert response.channel_sequence == request.channel.sequence and not response.channel_error
                assert all(r.on_channel and not r.probs.data and r.probs.dtype == "float32" for r in response.results)
                shapes = [tuple(r.probs.shape) for r in response.results]
                assert shapes == [tuple(p.shape) for p in local]
                received = channel.receive(shapes, torch.float32, response.channel_sequence)
                assert worst_difference(received, local) <= 1e-6
    finally:
        channel.close()


def test_a_specopd_step_over_the_channel_equals_the_local_step(target, drafter, verifier):
    config = SpecOPDConfig(block_size=4, anchors_per_seq=3, branches_per_anchor=3, lr=3e-3, seed=5)
    local = SpecOPDTrainer(target, copy.deepcopy(drafter), config)
    scorer = tensor_scorer(verifier.address, stop_token_ids=target.config.stop_token_ids)
    distant = SpecOPDTrainer(scorer, copy.deepcopy(drafter), config)
    try:
        assert_same_training(local, distant)
        assert scorer.counters.on_channel == 2 and scorer.counters.fallbacks == 0
    finally:
        scorer.close()


def test_a_restarted_verifier_costs_one_grpc_call_then_a_new_channel(target, drafter):
    contexts, trees, rows = proposal_trees(drafter)
    local = LocalScorer(target).score(contexts, trees, rows)
    first = Verifier(target)
    scorer = tensor_scorer(first.address)
    second = None
    try:
        assert worst_difference(scorer.score(contexts, trees, rows), local) <= 1e-6
        old_id = scorer._links[0].channel.channel_id
        first.stop()
        second = Verifier(target, port=first.port)  # the same address, a new process's state
        # The trainer's gRPC channel saw the old server go: wait until it reaches the new one.
        grpc.channel_ready_future(scorer._channels[0]).result(timeout=30)
        # The new verifier cannot join the old channel (joined before): it answers over gRPC.
        assert worst_difference(scorer.score(contexts, trees, rows), local) <= 1e-6
        assert (scorer.counters.opened, scorer.counters.fallbacks, scorer.counters.dropped) == (1, 1, 1)
        assert len(second.handler.channels) == 0
        # The next call opens a new channel with the new verifier.
        assert worst_difference(scorer.score(contexts, trees, rows), local) <= 1e-6
        assert (scorer.counters.opened, scorer.counters.on_channel, scorer.counters.fallbacks) == (2, 2, 1)
        new_id = scorer._links[0].channel.channel_id
        assert new_id != old_id and new_id in second.handler.channels
    finally:
        scorer.close()
        if second is not None:
            second.stop()


def test_a_channel_that_breaks_after_the_answer_falls_back_to_grpc(target, drafter, verifier, monkeypatch):
    contexts, trees, rows = proposal_trees(drafter)
    local = LocalScorer(target).score(contexts, trees, rows)
    scorer = tensor_scorer(verifier.address, channel_timeout=3.0)
    try:
        assert worst_difference(scorer.score(contexts, trees, rows), local) <= 1e-6
        (joined,) = verifier.handler.channels._channels.values()
        # The verifier dies between its answer and the transfer: the answer says "on the channel",
        # and the peer's side of the group goes away instead of sending.
        monkeypatch.setattr(joined, "send", lambda tensors, sequence: joined.close())
        assert worst_difference(scorer.score(contexts, trees, rows), local) <= 1e-6
        assert (scorer.counters.on_channel, scorer.counters.fallbacks, scorer.counters.dropped) == (1, 1, 1)
        assert scorer._links[0].channel is None
        assert worst_difference(scorer.score(contexts, trees, rows), local) <= 1e-6  # a new channel
        assert (scorer.counters.opened, scorer.counters.on_channel) == (2, 2)
        assert joined.channel_id not in verifier.handler.channels
    finally:
        scorer.close()


def test_a_trainer_that_cannot_open_a_channel_scores_over_grpc(target, drafter, verifier):
    contexts, trees, rows = proposal_trees(drafter)
    # 203.0.113.1 (TEST-NET-3) is no address of this machine: the store cannot reach itself there.
    scorer = tensor_scorer(verifier.address, channel_host="203.0.113.1", channel_timeout=0.5)
    try:
        assert worst_difference(scorer.score(contexts, trees, rows), LocalScorer(target).score(contexts, trees, rows)) <= 1e-6
        assert (scorer.counters.opened, scorer.counters.on_channel) == (0, 0)
    finally:
        scorer.close()


def _request(channel: verifier_pb2.TensorChannel, top_k: int = 0) -> verifier_pb2.ScoreRequest:
    tree = common_pb2.TokenTree(tokens=[9], parents=[-1], anchors=[2])
    return verifier_pb2.ScoreRequest(top_k=top_k, channel=channel,
                                     sequences=[verifier_pb2.ScoreSequence(context=[5, 6], tree=tree)])


GOOD = {"master_addr": HOST, "master_port": 29500, "channel_id": "abc123", "backend": "gloo", "timeout_seconds": 5.0,
        "sequence": 1}
BAD_CHANNELS = {
    "no address": ({"master_addr": ""}, "master_addr"),
    "port zero": ({"master_port": 0}, "master_port"),
    "port above 65535": ({"master_port": 70000}, "master_port"),
    "id with a slash": ({"channel_id": "../x"}, "channel_id"),
    "empty id": ({"channel_id": ""}, "channel_id"),
    "unknown backend": ({"backend": "mpi"}, "backend"),
    "zero timeout": ({"timeout_seconds": 0.0}, "timeout_seconds"),
    "nan timeout": ({"timeout_seconds": math.nan}, "timeout_seconds"),
    "huge timeout": ({"timeout_seconds": 1e6}, "timeout_seconds"),
    "sequence zero": ({"sequence": 0}, "sequence"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHANNELS))
def test_bad_channel_parameters_are_invalid_argument_and_the_verifier_keeps_serving(case, verifier):
    change, words = BAD_CHANNELS[case]
    with open_channel(verifier.address, ServiceConfig()) as grpc_channel:
        stub = verifier_pb2_grpc.VerifierStub(grpc_channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(_request(verifier_pb2.TensorChannel(**{**GOOD, **change})))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert words in caught.value.details()
        assert len(verifier.handler.channels) == 0  # nothing was joined
        plain = verifier_pb2.ScoreRequest(sequences=_request(verifier_pb2.TensorChannel()).sequences)
        assert tensor_from_proto(stub.Score(plain).results[0].probs).shape == (1, VOCAB)


def test_top_k_with_a_channel_is_invalid_argument(verifier):
    with open_channel(verifier.address, ServiceConfig()) as grpc_channel, pytest.raises(grpc.RpcError) as caught:
        verifier_pb2_grpc.VerifierStub(grpc_channel).Score(_request(verifier_pb2.TensorChannel(**GOOD), top_k=3))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "full distributions only" in caught.value.details()


@pytest.mark.parametrize("change, words", [
    ({"backend": "nccl"}, "NCCL"),  # a CPU target cannot join an NCCL channel
    ({"timeout_seconds": 0.5}, "cannot reach"),  # no store listens at that port
], ids=["nccl on a cpu target", "store unreachable"])
def test_a_channel_the_verifier_cannot_use_is_declined_with_the_data_over_grpc(change, words, target, verifier):
    with open_channel(verifier.address, ServiceConfig()) as grpc_channel:
        stub = verifier_pb2_grpc.VerifierStub(grpc_channel)
        nobody = TrainerChannel(HOST, timeout=1.0)
        port = nobody.port
        nobody.close()  # a port where no store listens any more
        response = stub.Score(_request(verifier_pb2.TensorChannel(**{**GOOD, "master_port": port, **change})))
    assert words in response.channel_error and response.channel_sequence == 0
    (result,) = response.results
    assert not result.on_channel
    tree = tree_from_proto(_request(verifier_pb2.TensorChannel()).sequences[0].tree)
    expected = LocalScorer(target).score([[5, 6]], [tree], [[]])[0]
    assert (tensor_from_proto(result.probs) - expected).abs().max() <= 1e-6
    assert len(verifier.handler.channels) == 0
