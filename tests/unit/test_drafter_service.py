"""The drafter service and the verifier's pool of drafter replicas, over real gRPC on localhost.

Properties: blocks and candidates that cross the wire equal the in-process `D3DDrafter`'s (the
delta protocol, eviction and resend included); sequences spread over replicas and survive one
going away, and no replica at all is `DrafterUnavailable`; speculative decoding through the pool
is still exactly plain greedy decoding; weight swaps are served at once and a checkpoint with a
wrong sha256 is refused; bad input is INVALID_ARGUMENT and the replica keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import redis
import torch
from prometheus_client import CollectorRegistry
from redis_server import redis_server

from services.common.checkpoints import stream_checkpoint
from services.common.config import ServiceConfig
from services.common.server import GrpcServer, open_channel, wait_healthy
from services.common.wire import params_to_proto
from services.drafter.server import SERVICE_NAME, DrafterMetrics, DrafterServicer
from services.drafter.weights import WeightWatcher
from services.verifier.drafter_pool import RemoteDrafters, resolve
from specd._proto.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, trainer_pb2_grpc
from specd.drafters.base import DraftBlock, DrafterUnavailable, DraftRequest, SpeculateRequest
from specd.drafters.d3d import D3DDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.loading import ModelLoadError, file_sha256, load_model, save_model
from specd.models.qwen3 import FLAVOURS as QWEN3_FLAVOURS
from specd.models.qwen3 import Qwen3ForCausalLM
from specd.ports import free_port
from specd.sampling import SamplingParams

CONFIG = ServiceConfig()
VOCAB = D3D_FLAVOURS["debug"].vocab_size
GREEDY = SamplingParams(max_tokens=16)
SAMPLED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=11)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Two versions of a tiny random D3D drafter, and a non-D3D model, in Hugging Face layout."""
    root = tmp_path_factory.mktemp("drafters")
    paths = {}
    for version, seed in (("v1", 4), ("v2", 5)):
        torch.manual_seed(seed)
        save_model(D3DModel(D3D_FLAVOURS["debug"]), root / version)
        paths[version] = root / version
    torch.manual_seed(6)
    save_model(Qwen3ForCausalLM(QWEN3_FLAVOURS["debug"]), root / "qwen3")
    paths["qwen3"] = root / "qwen3"
    return paths


@contextlib.contextmanager
def serve(servicer: object, add: object, name: str) -> Iterator[tuple[GrpcServer, str]]:
    """An in-process gRPC server on a free port, SERVING; stopped on exit."""
    server = GrpcServer("test", CONFIG, max_workers=8)
    add(servicer, server.server)
    port = server.start([name])
    server.set_serving()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@contextlib.contextmanager
def drafter_replica(directory: Path, version: str = "v1", max_num_seqs: int = 4) -> Iterator[tuple[DrafterServicer, GrpcServer, str]]:
    servicer = DrafterServicer(max_num_seqs=max_num_seqs, metrics=DrafterMetrics(CollectorRegistry()))
    servicer.swap_weights(directory, version)
    with serve(servicer, drafter_pb2_grpc.add_DrafterServicer_to_server, SERVICE_NAME) as (server, address):
        yield servicer, server, address


def metric(servicer: DrafterServicer, sample: str) -> float | None:
    return servicer.metrics.registry.get_sample_value(sample)


def reference(directory: Path, max_num_seqs: int = 4) -> D3DDrafter:
    """The in-process drafter a replica must equal: the same weights in the same dtype (a
    servicer built without a dtype keeps the checkpoint's)."""
    return D3DDrafter(load_model(directory), max_num_seqs=max_num_seqs)


def prompt(seed: int, length: int = 9) -> list[int]:
    return torch.randint(7, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_same_block(got: DraftBlock, want: DraftBlock) -> None:
    assert got.tokens == want.tokens
    torch.testing.assert_close(torch.tensor(got.confidence), torch.tensor(want.confidence), rtol=1e-4, atol=1e-5)
    assert (got.probs is None) == (want.probs is None)
    if want.probs is not None:
        difference = (got.probs - want.probs).abs().max().item()
        assert difference < 1e-5, f"q differs by {difference}"


def assert_same_candidates(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for outcome, block in want.items():
        assert_same_block(got[outcome], block)


def drafts(contexts: dict[int, list[int]], params: dict[int, SamplingParams], block_size: int = 4) -> list[DraftRequest]:
    return [DraftRequest(seq_id=s, context=list(c), block_size=block_size, params=params[s]) for s, c in contexts.items()]


def speculations(contexts, blocks, params, block_size: int = 4, budget: int = 3) -> list[SpeculateRequest]:
    return [
        SpeculateRequest(seq_id=s, context=list(c), block=blocks[s], block_size=block_size, budget=budget, params=params[s])
        for s, c in contexts.items()
    ]


def commit_likeliest(contexts: dict[int, list[int]], blocks: dict[int, list[int]], candidates: list[dict]) -> None:
    """Advance each sequence as a verification hitting its likeliest candidate would."""
    for seq_id, options in zip(list(contexts), candidates):
        (k, c), block = max(options.items(), key=lambda option: sum(option[1].confidence))
        contexts[seq_id] = contexts[seq_id] + blocks[seq_id][:k] + [c]
        blocks[seq_id] = block.tokens


# ---------------------------------------------------------------------------- exactness
def test_remote_blocks_and_candidates_equal_in_process(checkpoints):
    """Several speculate/commit steps through the pool == the same calls on a local D3DDrafter;
    an evicted sequence is resent in full and still gets exactly the local answer."""
    local = reference(checkpoints["v1"])
    with drafter_replica(checkpoints["v1"], max_num_seqs=2) as (servicer, _, address):
        pool = RemoteDrafters([address], CONFIG, timeout=30.0)
        assert (pool.vocab_size, pool.max_block, pool.version) == (local.vocab_size, local.max_block, "v1")
        params = {1: GREEDY, 2: SAMPLED}
        contexts = {1: prompt(1), 2: prompt(2, 13)}
        wanted = local.draft(drafts(contexts, params))
        for got, want in zip(pool.draft(drafts(contexts, params)), wanted):
            assert_same_block(got, want)
        blocks = {s: block.tokens for s, block in zip(contexts, wanted)}
        for _ in range(4):
            requests = speculations(contexts, blocks, params)
            remote, wanted = pool.speculate(requests), local.speculate(requests)
            for got, want in zip(remote, wanted):
                assert_same_candidates(got, want)
            commit_likeliest(contexts, blocks, wanted)
        assert pool.stats.num_resends == 0
        assert pool.stats.num_round_trips == 1 + 4

        # A third sequence evicts the least recently used one (seq 1) from the 2-row replica...
        params[3], contexts[3] = GREEDY, prompt(3)
        for got, want in zip(pool.draft(drafts({3: contexts[3]}, params)), local.draft(drafts({3: contexts[3]}, params))):
            assert_same_block(got, want)
        assert metric(servicer, "specd:drafter_evictions_total") == 1
        local.release(1)
        # ...so its next call is answered `resend` and sent again in full: the replica re-prefills
        # and answers exactly what a fresh local drafter does.
        both = {1: contexts[1], 2: contexts[2]}
        for got, want in zip(pool.draft(drafts(both, params)), local.draft(drafts(both, params))):
            assert_same_block(got, want)
        assert pool.stats.num_resends == 1
        pool.close()


def test_every_pass_runs_on_the_compute_thread_speculate_on_its_share_of_threads(checkpoints):
    """Passes arrive on the server's request threads but all compute on the replica's one compute
    thread (one OpenMP pool per process, `specd.threads`); a Speculate pass runs on
    ``speculate_threads`` (it runs beside the verifier's pass), a Draft on the process's threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        servicer = DrafterServicer(max_num_seqs=4, metrics=DrafterMetrics(CollectorRegistry()), speculate_threads=1)
        servicer.swap_weights(checkpoints["v1"], "v1")
        seen: list[tuple[str, str, int]] = []
        drafter = servicer.drafter
        for kind in ("draft", "speculate"):
            original = getattr(drafter, kind)

            def recording(requests, kind=kind, original=original):
                seen.append((kind, threading.current_thread().name, torch.get_num_threads()))
                return original(requests)

            setattr(drafter, kind, recording)
        with serve(servicer, drafter_pb2_grpc.add_DrafterServicer_to_server, SERVICE_NAME) as (_, address):
            pool = RemoteDrafters([address], CONFIG, timeout=30.0)
            contexts, params = {1: prompt(1)}, {1: GREEDY}
            blocks = {1: pool.draft(drafts(contexts, params))[0].tokens}
            pool.speculate(speculations(contexts, blocks, params))
            pool.draft(drafts({2: prompt(2)}, {2: GREEDY}))
            pool.close()
    finally:
        torch.set_num_threads(previous)
    assert [(kind, threads) for kind, _, threads in seen] == [("draft", 2), ("speculate", 1), ("draft", 2)]
    assert {name for _, name, _ in seen} == {"specd-drafter-compute"}


# ---------------------------------------------------------------------------- replicas
def test_two_replicas_spread_fail_over_and_then_unavailable(checkpoints):
    with drafter_replica(checkpoints["v1"]) as (first, first_server, a), drafter_replica(checkpoints["v1"]) as (second, _, b):
        pool = RemoteDrafters([a, b], CONFIG, timeout=30.0, retry_seconds=60.0)
        params = {s: GREEDY for s in range(4)}
        contexts = {s: prompt(10 + s, 5 + s) for s in range(4)}
        blocks = {s: block.tokens for s, block in zip(contexts, pool.draft(drafts(contexts, params)))}
        assert pool.assigned() == {a: 2, b: 2}
        assert first.num_sequences == 2 and second.num_sequences == 2
        # A local drafter that gets exactly the calls the surviving replica gets.
        survivor = reference(checkpoints["v1"])
        held = {s: c for s, c in contexts.items() if pool.replica_of(s) == b}
        survivor.draft(drafts(held, params))
        survivor.speculate(speculations(held, blocks, params))
        commit_likeliest(contexts, blocks, pool.speculate(speculations(contexts, blocks, params)))

        first_server.stop(None)  # the replica goes away mid-way (its Speculate stream breaks)
        candidates = pool.speculate(speculations(contexts, blocks, params))
        assert pool.stats.num_failovers == 1 and pool.assigned() == {a: 0, b: 4}
        # The survivor answers its own sequences as before; the moved ones arrive in full in a
        # retry, and as their blocks did not come from the survivor they get no candidates yet.
        stayed = {s: contexts[s] for s in held}
        wanted = dict(zip(stayed, survivor.speculate(speculations(stayed, blocks, params))))
        for seq_id, got in zip(contexts, candidates):
            assert_same_candidates(got, wanted.get(seq_id, {}))
        for got, want in zip(pool.draft(drafts(contexts, params)), survivor.draft(drafts(contexts, params))):
            assert_same_block(got, want)
        pool.release(0)
        assert second.num_sequences == 3

    with pytest.raises(DrafterUnavailable, match="no drafter replica is reachable"):
        pool.draft(drafts(contexts, params))
    with pytest.raises(DrafterUnavailable):
        pool.speculate(speculations(contexts, blocks, params))
    pool.close()


def test_verifiers_with_one_sequence_each_do_not_all_pick_the_first_replica(checkpoints):
    """Each pool is one verifier that knows only its own sequences: the first sequence of every
    verifier ties on every replica, and ties go to a random one — else one replica of the cluster
    would draft for every verifier at one sequence each."""
    with drafter_replica(checkpoints["v1"]) as (_, _, a), drafter_replica(checkpoints["v1"]) as (_, _, b):
        chosen = []
        for verifier in range(16):
            pool = RemoteDrafters([a, b], CONFIG, timeout=30.0, retry_seconds=60.0)
            pool.draft(drafts({0: prompt(verifier, 6)}, {0: GREEDY}))
            chosen.append(pool.replica_of(0))
            pool.close()
        # 16 fair coin flips all alike: probability 2 ** -15.
        assert set(chosen) == {a, b}, chosen


def test_no_replica_at_construction_is_unavailable():
    address = f"127.0.0.1:{free_port()}"  # a port nobody listens on
    with pytest.raises(DrafterUnavailable, match=address):
        RemoteDrafters([address], CONFIG, timeout=5.0)


def test_a_dns_name_resolves_to_its_replicas(checkpoints):
    assert resolve("10.0.0.7:50052") == ["10.0.0.7:50052"]
    with pytest.raises(ValueError, match="needs a port"):
        resolve("dns:///drafter")
    with drafter_replica(checkpoints["v1"]) as (servicer, _, address):
        port = address.rpartition(":")[2]
        pool = RemoteDrafters([f"dns:///localhost:{port}"], CONFIG, timeout=30.0)
        assert len(pool.draft(drafts({1: prompt(50)}, {1: GREEDY}))) == 1
        assert pool.replica_of(1) == address and servicer.num_sequences == 1
        pool.close()


def test_speculative_decoding_through_the_pool_is_plain_greedy(checkpoints):
    """The engine over two remote replicas: lossless (== plain greedy), with candidate hits."""
    torch.manual_seed(3)
    target = Qwen3ForCausalLM(QWEN3_FLAVOURS["debug"]).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # sharper greedy text, so drafts are sometimes right
    prompts = [prompt(20 + i, 6 + 3 * i) for i in range(3)]
    params = SamplingParams(max_tokens=20)
    expected = [g.token_ids for g in autoregressive(target, prompts, params)]
    with drafter_replica(checkpoints["v1"]) as (_, _, a), drafter_replica(checkpoints["v1"]) as (_, _, b):
        pool = RemoteDrafters([a, b], CONFIG, timeout=30.0)
        engine = SpeculativeEngine(target, pool, EngineConfig(max_num_seqs=3, block_size=4, mode="async"))
        got = [g.token_ids for g in engine.generate(prompts, params)]
        engine.close()
        assert engine.drafter is pool, "the pool failed during decoding"
        assert pool.assigned() == {a: 0, b: 0}  # every sequence released
        pool.close()
    assert got == expected
    assert engine.stats.num_candidate_lookups > 0


# ---------------------------------------------------------------------------- weights
def test_swap_weights_serves_the_new_version_and_refuses_a_bad_one(checkpoints):
    with drafter_replica(checkpoints["v1"]) as (servicer, _, address):
        pool = RemoteDrafters([address], CONFIG, timeout=30.0)
        params = {1: GREEDY, 2: SAMPLED}
        contexts = {1: prompt(30), 2: prompt(31)}
        blocks = {s: block.tokens for s, block in zip(contexts, pool.draft(drafts(contexts, params)))}

        servicer.swap_weights(checkpoints["v2"], "v2")
        # Contexts survive the swap: deltas still work, caches re-prefill, candidates miss once.
        assert pool.speculate(speculations(contexts, blocks, params)) == [{}, {}]
        assert pool.version == "v2" and pool.stats.num_resends == 0
        contexts = {s: c + blocks[s] for s, c in contexts.items()}
        for got, want in zip(pool.draft(drafts(contexts, params)), reference(checkpoints["v2"]).draft(drafts(contexts, params))):
            assert_same_block(got, want)

        for bad in ("qwen3", "missing"):
            with pytest.raises(ModelLoadError):
                servicer.swap_weights(checkpoints["v1"].parent / bad, "v3")
        assert servicer.version == "v2" and metric(servicer, "specd:drafter_weight_refused_total") == 2
        assert len(pool.draft(drafts(contexts, params))) == 2 and pool.version == "v2"
        pool.close()


class CheckpointTrainer(trainer_pb2_grpc.TrainerServicer):
    """Just the trainer's GetCheckpoint, over fixed directories."""

    def __init__(self, versions: dict[str, Path]) -> None:
        self.versions = versions

    def GetCheckpoint(self, request, context):
        yield from stream_checkpoint(self.versions[request.version], request.version)


@pytest.fixture
def redis_url(tmp_path) -> Iterator[str]:
    with redis_server(tmp_path) as url:
        yield url


def test_watcher_installs_published_versions_and_refuses_a_wrong_sha256(checkpoints, redis_url, tmp_path):
    key, channel = "specd:drafter:live", "specd:drafter:updates"
    trainer = CheckpointTrainer({"v2": checkpoints["v2"], "v3": checkpoints["v1"]})
    with drafter_replica(checkpoints["v1"]) as (servicer, _, address), serve(
        trainer, trainer_pb2_grpc.add_TrainerServicer_to_server, "specd.v1.Trainer"
    ) as (_, trainer_address):
        client = redis.Redis.from_url(redis_url)
        watcher = WeightWatcher(
            servicer, client, trainer_pb2_grpc.TrainerStub(open_channel(trainer_address, CONFIG)),
            directory=tmp_path / "versions", key=key, channel=channel, poll_seconds=60.0,
            refused=servicer.metrics.weight_refused,
        )
        watcher.start()
        deadline = time.monotonic() + 20
        while client.pubsub_numsub(channel)[0][1] < 1:  # readiness poll: the watcher listens
            assert time.monotonic() < deadline, "the watcher never subscribed"
            time.sleep(0.02)
        pool = RemoteDrafters([address], CONFIG, timeout=30.0)

        def publish(version: str, sha256: dict[str, str]) -> None:
            client.set(key, json.dumps({"version": version, "sha256": sha256}))
            client.publish(channel, version)

        sha = {p.name: file_sha256(p) for p in checkpoints["v2"].iterdir()}
        publish("v2", sha)  # the poll is a minute away: only the pub/sub hint can be this quick
        assert watcher.wait_for("v2", timeout=30) == "installed"
        assert servicer.version == "v2"
        contexts, params = {1: prompt(40)}, {1: GREEDY}
        for got, want in zip(pool.draft(drafts(contexts, params)), reference(checkpoints["v2"]).draft(drafts(contexts, params))):
            assert_same_block(got, want)
        assert pool.version == "v2"

        publish("v3", {**sha, "model.safetensors": "0" * 64})
        assert watcher.wait_for("v3", timeout=30) == "refused"
        assert servicer.version == "v2" and metric(servicer, "specd:drafter_weight_refused_total") == 1
        assert not (tmp_path / "versions" / "v3").exists()
        assert len(pool.draft(drafts(contexts, params))) == 1 and pool.version == "v2"
        watcher.stop()
        pool.close()


# ---------------------------------------------------------------------------- bad input
def test_bad_input_is_invalid_argument_and_the_replica_keeps_serving(checkpoints):
    with drafter_replica(checkpoints["v1"]) as (servicer, _, address):
        stub = drafter_pb2_grpc.DrafterStub(open_channel(address, CONFIG))
        greedy = params_to_proto(GREEDY)

        def item(tokens, block_size=4, params=greedy, seq_id=1):
            context = drafter_pb2.SequenceContext(seq_id=seq_id, tokens=tokens)
            if params is not None:
                context.params.CopyFrom(params)
            return drafter_pb2.DraftItem(context=context, block_size=block_size)

        bad_drafts = {
            "block_size must be >= 1": [item([9, 10], block_size=0)],
            "above this drafter's max_block": [item([9, 10], block_size=99)],
            "outside the vocabulary": [item([9, VOCAB + 5])],
            "has no params": [item([9, 10], params=None)],
            "the context is empty": [item([])],
            "appears twice": [item([9]), item([10])],
            "temperature must be >= 0": [item([9], params=common_pb2.SamplingParams(temperature=-1.0))],
        }
        for message, items in bad_drafts.items():
            with pytest.raises(grpc.RpcError) as caught:
                stub.Draft(drafter_pb2.DraftRequest(items=items), timeout=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert message in caught.value.details()

        speculate = drafter_pb2.SpeculateRequest(step=7, items=[
            drafter_pb2.SpeculateItem(context=item([9, 10]).context, block=[VOCAB], block_size=4, budget=2)
        ])
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Speculate(iter([speculate]), timeout=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block has token ids" in caught.value.details()

        # Still serving, and nothing bad was stored.
        assert stub.Info(drafter_pb2.InfoRequest(), timeout=10).drafter_version == "v1"
        assert servicer.num_sequences == 0
        answer = stub.Draft(drafter_pb2.DraftRequest(items=[item([9, 10, 11])]), timeout=10)
        assert len(answer.blocks[0].tokens) == 4

        # Through the pool: the caller's bug is a ValueError, not a failover.
        pool = RemoteDrafters([address], CONFIG, timeout=30.0)
        with pytest.raises(ValueError, match="max_block"):
            pool.draft([DraftRequest(seq_id=5, context=[9, 10], block_size=99, params=GREEDY)])
        assert len(pool.draft([DraftRequest(seq_id=5, context=[9, 10], block_size=4, params=GREEDY)])) == 1
        assert pool.stats.num_failovers == 0
        pool.close()


def test_calls_before_the_weights_are_loaded_are_unavailable():
    servicer = DrafterServicer(metrics=DrafterMetrics(CollectorRegistry()))
    with serve(servicer, drafter_pb2_grpc.add_DrafterServicer_to_server, SERVICE_NAME) as (_, address):
        stub = drafter_pb2_grpc.DrafterStub(open_channel(address, CONFIG))
        with pytest.raises(grpc.RpcError) as caught:
            stub.Info(drafter_pb2.InfoRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "loading its weights" in caught.value.details()


# ---------------------------------------------------------------------------- the process
def test_python_m_services_drafter_serves_and_drains(checkpoints):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "SPECD_VERSION": "from-env"}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.drafter", "--model", str(checkpoints["v1"]), "--port", "0", "--drain-seconds", "1"],
        stdout=subprocess.PIPE, text=True, env=environment, cwd=Path(__file__).parents[2],
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("drafter serving on 127.0.0.1:") and "(version from-env)" in line, line
        address = line.split()[3]
        wait_healthy(address, CONFIG, timeout=30, service=SERVICE_NAME)
        info = drafter_pb2_grpc.DrafterStub(open_channel(address, CONFIG)).Info(drafter_pb2.InfoRequest(), timeout=10)
        assert (info.vocab_size, info.drafter_version) == (VOCAB, "from-env")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
