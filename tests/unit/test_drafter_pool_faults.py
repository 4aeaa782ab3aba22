"""A sick drafter replica costs its own sequences, never the batch (`RemoteDrafters`, Failure).

Two in-process drafter replicas behind one pool, over real gRPC on localhost; one of them is made
to hang as a stopped process does (calls arrive, nothing answers) or to refuse (UNAVAILABLE).
Properties: a call over both replicas returns in about a grace, not the deadline, with real blocks
for the healthy replica's sequences and none for the hung one's, and so does every call while it
hangs; a hung part that reaches its deadline moves its sequences, one that answers late gives its
replica back; a down replica is asked for its Info in the background, never on the caller's
thread; a replica down for long is not a warning every retry; and decoding through a pool with a
hung replica is still exactly plain greedy decoding.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from services.common.config import ServiceConfig
from services.common.server import GrpcServer, abort
from services.drafter.server import SERVICE_NAME, DrafterMetrics, DrafterServicer
from services.verifier.drafter_pool import RemoteDrafters
from specd._proto.v1 import drafter_pb2_grpc
from specd.drafters.base import DraftBlock, DraftRequest, SpeculateRequest
from specd.drafters.d3d import D3DDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.loading import load_model, save_model
from specd.models.qwen3 import FLAVOURS as QWEN3_FLAVOURS
from specd.models.qwen3 import Qwen3ForCausalLM
from specd.sampling import SamplingParams

CONFIG = ServiceConfig()
VOCAB = D3D_FLAVOURS["debug"].vocab_size
GREEDY = SamplingParams(max_tokens=16)
TIMEOUT = 5.0  # every drafter RPC's deadline: what a hung replica used to cost the whole batch
FAST = TIMEOUT / 3  # "returns at once", with room for a loaded 2-core machine (a grace is 0.25 s)
RETRY = 0.2


class StoppableServicer(DrafterServicer):
    """A drafter replica that can hang like a stopped process (every RPC waits, unanswered,
    until `resume` or until its caller gives up) or refuse like one going away (UNAVAILABLE)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._running = threading.Event()
        self._running.set()
        self.failing = False
        self.num_info = 0

    def hang(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def _gate(self, context: grpc.ServicerContext) -> None:
        while not self._running.wait(0.02):
            if not context.is_active():  # the caller's deadline passed: free the server thread
                abort(context, grpc.StatusCode.CANCELLED, "the caller gave up")
        if self.failing:
            abort(context, grpc.StatusCode.UNAVAILABLE, "the replica is going away")

    def _gated(self, requests: Iterator, context: grpc.ServicerContext) -> Iterator:
        for request in requests:
            self._gate(context)
            yield request

    def Draft(self, request, context):
        self._gate(context)
        return super().Draft(request, context)

    def Speculate(self, request_iterator, context):
        return super().Speculate(self._gated(request_iterator, context), context)

    def Release(self, request, context):
        self._gate(context)
        return super().Release(request, context)

    def Info(self, request, context):
        self.num_info += 1
        self._gate(context)
        return super().Info(request, context)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("drafter") / "v1"
    torch.manual_seed(4)
    save_model(D3DModel(D3D_FLAVOURS["debug"]), directory)
    return directory


@contextlib.contextmanager
def replica(directory: Path) -> Iterator[tuple[StoppableServicer, str]]:
    """An in-process drafter replica on a free port, SERVING; resumed and stopped on exit."""
    servicer = StoppableServicer(max_num_seqs=8, metrics=DrafterMetrics(CollectorRegistry()))
    servicer.swap_weights(directory, "v1")
    server = GrpcServer("test", CONFIG, max_workers=8)
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server.server)
    port = server.start([SERVICE_NAME])
    server.set_serving()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.resume()
        server.stop(None)


@pytest.fixture
def replicas(checkpoint) -> Iterator[tuple[tuple[StoppableServicer, str], tuple[StoppableServicer, str]]]:
    with replica(checkpoint) as first, replica(checkpoint) as second:
        yield first, second


@contextlib.contextmanager
def pool_of(*addresses: str, retry_seconds: float = RETRY, **kwargs) -> Iterator[RemoteDrafters]:
    pool = RemoteDrafters(list(addresses), CONFIG, timeout=TIMEOUT, retry_seconds=retry_seconds, **kwargs)
    try:
        yield pool
    finally:
        pool.close()


def prompt(seed: int, length: int = 9) -> list[int]:
    return torch.randint(7, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def drafts(contexts: dict[int, list[int]]) -> list[DraftRequest]:
    return [DraftRequest(seq_id=s, context=list(c), block_size=4, params=GREEDY) for s, c in contexts.items()]


def speculations(contexts: dict[int, list[int]], blocks: dict[int, list[int]]) -> list[SpeculateRequest]:
    return [
        SpeculateRequest(seq_id=s, context=list(c), block=blocks[s], block_size=4, budget=3, params=GREEDY)
        for s, c in contexts.items()
    ]


def timed(call: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def poll(condition: Callable[[], bool], what: str, timeout: float = 4 * TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def placed(pool: RemoteDrafters, checkpoint: Path, contexts: dict[int, list[int]]) -> dict[int, list[int]]:
    """Draft once with every replica healthy (placing the sequences: two on each); the blocks."""
    blocks = {s: block.tokens for s, block in zip(contexts, pool.draft(drafts(contexts)))}
    assert blocks == expected_blocks(checkpoint, contexts)
    assert sorted(pool.assigned().values()) == [len(contexts) // 2] * 2
    return blocks


def sizes(blocks: list[DraftBlock]) -> list[int]:
    return [len(block.tokens) for block in blocks]


def expected_blocks(checkpoint: Path, contexts: dict[int, list[int]]) -> dict[int, list[int]]:
    """What a drafter that never saw these sequences answers for their contexts."""
    local = D3DDrafter(load_model(checkpoint), max_num_seqs=8)
    return {s: block.tokens for s, block in zip(contexts, local.draft(drafts(contexts)))}


# ---------------------------------------------------------------------------- hung replicas
def test_a_hung_replica_costs_one_grace_then_its_sequences_move(checkpoint, replicas):
    (_, a), (sick, b) = replicas
    with pool_of(a, b) as pool:
        contexts = {s: prompt(s, 6 + s) for s in range(4)}
        blocks = placed(pool, checkpoint, contexts)
        on_sick = {s for s in contexts if pool.replica_of(s) == b}

        sick.hang()
        candidates, seconds = timed(lambda: pool.speculate(speculations(contexts, blocks)))
        print(f"speculate over both replicas, one hung: {seconds:.3f}s (deadline {TIMEOUT}s)")
        assert seconds < FAST
        for seq_id, got in zip(contexts, candidates):
            assert (got == {}) == (seq_id in on_sick), (seq_id, on_sick)
        assert pool.states()[b] == "busy" and pool.stats.num_stragglers == 1

        # While it hangs, its sequences are answered at once, with no block; the others as ever.
        slowest = 0.0
        for _ in range(3):
            got, seconds = timed(lambda: pool.draft(drafts(contexts)))
            slowest = max(slowest, seconds)
            assert sizes(got) == [0 if s in on_sick else 4 for s in contexts]
            blocks = {s: g.tokens for s, g in zip(contexts, got)}
            _, seconds = timed(lambda: pool.speculate(speculations(contexts, blocks)))
            slowest = max(slowest, seconds)
        print(f"slowest call while the replica hangs: {slowest:.3f}s")
        assert slowest < FAST and pool.stats.num_stragglers == 1

        # The hung Speculate reaches its deadline: the replica is down, its sequences move (full
        # contexts) and get blocks from the healthy replica.
        poll(lambda: pool.states()[b] == "down", "the hung replica was taken out of use")
        got, seconds = timed(lambda: pool.draft(drafts(contexts)))
        assert seconds < FAST
        assert sizes(got) == [4] * len(contexts)
        assert pool.assigned() == {a: 4, b: 0}

        # Back once its background Info answers: a new sequence goes to it (fewest sequences).
        sick.resume()
        poll(lambda: pool.states()[b] == "live", "the replica came back")
        fresh = {9: prompt(9, 11)}
        (block,) = pool.draft(drafts(fresh))
        assert pool.replica_of(9) == b and block.tokens == expected_blocks(checkpoint, fresh)[9]


def test_a_late_answer_is_dropped_and_the_replica_used_again(checkpoint, replicas):
    (_, a), (sick, b) = replicas
    with pool_of(a, b) as pool:
        contexts = {s: prompt(20 + s, 7 + s) for s in range(4)}
        placed(pool, checkpoint, contexts)
        on_sick = {s for s in contexts if pool.replica_of(s) == b}
        contexts = {s: c + [7 + s] for s, c in contexts.items()}  # a step later (plain decoding)
        wanted = expected_blocks(checkpoint, contexts)

        sick.hang()
        got, seconds = timed(lambda: pool.draft(drafts(contexts)))
        print(f"draft over both replicas, one hung: {seconds:.3f}s (deadline {TIMEOUT}s)")
        assert seconds < FAST
        assert [g.tokens for g in got] == [[] if s in on_sick else wanted[s] for s in contexts]

        sick.resume()  # before the deadline: the Draft answers late, and nothing moves
        poll(lambda: pool.states()[b] == "live", "the late answer gave the replica back")
        contexts = {s: c + [8] for s, c in contexts.items()}
        got = pool.draft(drafts(contexts))
        assert [g.tokens for g in got] == list(expected_blocks(checkpoint, contexts).values())
        assert {s for s in contexts if pool.replica_of(s) == b} == on_sick
        assert pool.stats.num_replica_failures == 0 and pool.stats.num_resends == 0


def test_a_down_replica_is_probed_in_the_background_not_by_the_caller(checkpoint, replicas):
    (_, a), (sick, b) = replicas
    with pool_of(a, b) as pool:
        contexts = {s: prompt(40 + s) for s in range(4)}
        placed(pool, checkpoint, contexts)
        sick.failing = True  # refuses: down at the next call, its sequences move
        pool.draft(drafts(contexts))
        assert pool.states()[b] == "down" and pool.assigned() == {a: 4, b: 0}

        # Now it hangs, Info included, and its retry is due: the caller must not be the one asking.
        sick.failing = False
        sick.hang()
        asked = sick.num_info
        time.sleep(2 * RETRY)  # the condition under test: past retry_seconds
        slowest = 0.0
        for _ in range(3):
            got, seconds = timed(lambda: pool.draft(drafts(contexts)))
            slowest = max(slowest, seconds)
            assert sizes(got) == [4] * len(contexts)
        print(f"slowest call with a hung replica due for its retry: {slowest:.3f}s")
        assert slowest < FAST
        poll(lambda: sick.num_info > asked, "the background probe asked the hung replica's Info")

        sick.resume()
        poll(lambda: pool.states()[b] == "live", "the replica came back")
        fresh = {9: prompt(49, 5)}
        (block,) = pool.draft(drafts(fresh))
        assert pool.replica_of(9) == b and block.tokens == expected_blocks(checkpoint, fresh)[9]


def test_a_replica_down_for_long_is_logged_with_backoff(checkpoint, replicas, caplog):
    (_, a), (sick, b) = replicas
    retry = 0.05
    with pool_of(a, b, retry_seconds=retry) as pool:
        contexts = {s: prompt(60 + s) for s in range(2)}
        pool.draft(drafts(contexts))
        caplog.set_level(logging.INFO, logger="services.verifier.drafter_pool")
        sick.failing = True
        start = time.monotonic()
        while time.monotonic() - start < 2.0:  # calls go on all along, as a verifier's would
            pool.draft(drafts(contexts))
            time.sleep(retry / 2)
        periods = (time.monotonic() - start) / retry
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and b in r.getMessage()]
        print(f"{len(warnings)} warnings over {periods:.0f} retry periods ({sick.num_info} Info probes)")
        # Down once, then still down at doubling intervals: about log2(periods) + 1.
        assert 1 <= len(warnings) <= 8 < periods / 4, [r.getMessage() for r in warnings]
        assert sick.num_info >= 5  # it was asked all along, just not warned about each time

        sick.failing = False
        poll(lambda: pool.states()[b] == "live", "the replica came back")
        back = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and b in r.getMessage()]
        assert sum("is back" in message for message in back) == 1, back


# ---------------------------------------------------------------------------- end to end
def test_greedy_through_a_pool_with_a_hung_replica_is_plain_greedy(checkpoint, replicas):
    """The engine over two replicas, one hung from the first step: lossless (== plain greedy),
    the pool never gives up, and nothing waits for the hung replica's deadline."""
    torch.manual_seed(3)
    target = Qwen3ForCausalLM(QWEN3_FLAVOURS["debug"]).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # sharper greedy text, so drafts are sometimes right
    prompts = [prompt(80 + i, 6 + 3 * i) for i in range(3)]
    params = SamplingParams(max_tokens=20)
    expected = [g.token_ids for g in autoregressive(target, prompts, params)]
    (_, a), (sick, b) = replicas
    with pool_of(a, b) as pool:
        sick.hang()
        engine = SpeculativeEngine(target, pool, EngineConfig(max_num_seqs=3, block_size=4, mode="async"))
        generations, seconds = timed(lambda: engine.generate(prompts, params))
        engine.close()
        print(f"3 x 20 tokens with one replica hung: {seconds:.2f}s (deadline {TIMEOUT}s)")
        assert [g.token_ids for g in generations] == expected
        assert engine.drafter is pool, "the pool failed during decoding"
        assert seconds < TIMEOUT
        assert pool.stats.num_stragglers >= 1 and engine.stats.num_candidate_lookups > 0


# ---------------------------------------------------------------------------- rows of a hung replica
def test_release_for_a_replica_taken_for_down_frees_its_rows_when_it_returns(checkpoint, replicas):
    """Found by `specd bench chaos`: a SIGSTOPped drafter that came back held the rows of every
    sequence that finished (or moved off it) while it was down, long after the load stopped."""
    (healthy, a), (sick, b) = replicas
    with pool_of(a, b) as pool:
        contexts = {s: prompt(40 + s, 6 + s) for s in range(4)}
        placed(pool, checkpoint, contexts)
        assert len(sick._contexts) == 2 and len(healthy._contexts) == 2
        sick.hang()
        pool.draft(drafts(contexts))  # the hung part is left running
        poll(lambda: pool.states()[b] == "down", "the hung replica was taken out of use")
        for seq_id in contexts:  # every sequence finishes while it is down
            pool.release(seq_id)
        assert len(healthy._contexts) == 0 and len(sick._contexts) == 2  # it could not be told
        sick.resume()
        poll(lambda: pool.states()[b] == "live", "the replica came back")
        poll(lambda: len(sick._contexts) == 0, "the returned replica was told to release its rows")


def test_release_for_a_busy_replica_frees_its_rows_once_its_late_answer_comes(checkpoint, replicas):
    (_, a), (sick, b) = replicas
    with pool_of(a, b) as pool:
        contexts = {s: prompt(50 + s, 6 + s) for s in range(4)}
        placed(pool, checkpoint, contexts)
        sick.hang()
        pool.draft(drafts(contexts))
        assert pool.states()[b] == "busy"
        for seq_id in contexts:
            pool.release(seq_id)
        sick.resume()  # before the deadline: a late answer, the replica never down
        poll(lambda: len(sick._contexts) == 0, "the busy replica was told once it answered")
        assert pool.stats.num_replica_failures == 0
