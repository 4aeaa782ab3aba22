"""The online SpecOPD trainer against a real redis-server: at-least-once traces, exactly-once training.

Traces are acknowledged only after the checkpoint that holds them; a trainer killed after a step
(or between its checkpoint and its acknowledgements) loses no trace and trains none twice into
one version; bad entries go to the dead-letter stream; the gate refuses a worse drafter and
publishes a better or equal one with the right key, hint, files and sha256; SIGTERM saves and
acknowledges before the process exits. Every checkpoint's ledger says which traces it took in:
after a ``kill -9`` inside the window between a checkpoint and its acknowledgements (the
``trainer.after_checkpoint`` failpoint), every acknowledged trace is in exactly one entry.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch
from redis_server import redis_server

from services.common.checkpoints import fetch_checkpoint
from services.common.config import ServiceConfig
from services.common.failpoints import ENVIRONMENT as FAILPOINTS
from services.common.failpoints import LOG_ENVIRONMENT as FAILPOINT_LOG
from services.common.server import GrpcServer, open_channel, wait_healthy
from services.trainer.server import (
    SERVICE_NAME,
    TrainerConfig,
    TrainerService,
    TrainerServicer,
)
from specd._proto.v1 import trainer_pb2, trainer_pb2_grpc
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.loading import file_sha256, load_model, save_model
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.ports import free_port
from specd.train.online import (
    LedgerEntry,
    OnlineConfig,
    Trace,
    bounded_ledger,
    expected_tau,
    gate,
    is_heldout,
    read_ledger,
)
from specd.train.specopd import SpecOPDConfig, SpecOPDTrainer

VOCAB = FLAVOURS["debug"].vocab_size
HELDOUT_EVERY = 4


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def client(redis_url):
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    connection.flushall()
    yield connection
    connection.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny random target (peaked p) and a tiny random D3D drafter, saved in HF layout."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(2)
    target = Qwen3ForCausalLM(FLAVOURS["debug"]).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
    torch.manual_seed(4)
    drafter = D3DModel(D3D_FLAVOURS["debug"]).eval()
    save_model(target, root / "target")
    save_model(drafter, root / "drafter")
    return root


def config(models: Path, redis_url: str, directory: Path, **overrides) -> TrainerConfig:
    values = {
        "redis_url": redis_url, "drafter": str(models / "drafter"), "target": str(models / "target"),
        "checkpoint_dir": str(directory), "consumer": "trainer-a", "batch_size": 2, "steps_per_version": 2,
        "heldout_every": HELDOUT_EVERY, "min_heldout": 1, "block_size": 4, "anchors_per_seq": 2,
        "branches_per_anchor": 2, "lr": 3e-3, "block_ms": 20, "claim_idle_ms": 60_000,
    }
    return TrainerConfig(**{**values, **overrides})


def make_traces(count: int, *, heldout: bool, start: int = 0) -> list[Trace]:
    """``count`` traces whose ids are (or are not) held out, with random token ids."""
    generator = torch.Generator().manual_seed(start)
    traces, number = [], start
    while len(traces) < count:
        trace_id = f"{number:032x}"
        number += 1
        if is_heldout(trace_id, HELDOUT_EVERY) != heldout:
            continue
        prompt = torch.randint(7, VOCAB, (4 + len(traces) % 3,), generator=generator).tolist()
        output = torch.randint(7, VOCAB, (10 + len(traces) % 4,), generator=generator).tolist()
        traces.append(Trace(trace_id=trace_id, prompt_ids=prompt, output_ids=output, accepted=[1, 0, 2],
                            drafter_version="", finish_reason="length"))
    return traces


def add(client: redis.Redis, traces: list[Trace], stream: str = "specd:traces") -> list[str]:
    return [client.xadd(stream, trace.to_fields()) for trace in traces]


def pending(client: redis.Redis) -> int:
    return client.xpending("specd:traces", "specd-trainer")["pending"]


def poll_until(service: TrainerService, done, rounds: int = 50) -> None:
    for _ in range(rounds):
        if done():
            return
        service.poll(block_ms=10)
    raise AssertionError("the trainer did not get there")


def saved_state(directory: Path) -> dict:
    return torch.load(directory / "online" / "state.pt", weights_only=False)


# ---------------------------------------------------------------------------- the stream
def test_traces_are_acknowledged_only_after_the_checkpoint_that_holds_them(models, redis_url, client, tmp_path):
    service = TrainerService(config(models, redis_url, tmp_path / "run"), client=client)
    traces = make_traces(4, heldout=False)
    add(client, traces)
    poll_until(service, lambda: service.learner.num_steps == 1)
    assert pending(client) == 2  # trained, not yet in a checkpoint: not acknowledged
    assert not (tmp_path / "run" / "online").exists()
    poll_until(service, lambda: service.learner.num_steps == 2)
    assert pending(client) == 0
    state = saved_state(tmp_path / "run")
    assert state["num_steps"] == 2
    assert state["data"]["trained_ids"] == [t.trace_id for t in traces]
    assert service.status().traces_consumed == 4 and service.status().supervised_tokens > 0


def test_a_quiet_stream_replays_kept_traces_and_takes_none_in_twice(models, redis_url, client, tmp_path):
    """With ``replay_traces`` a poll that reads nothing steps on trained traces drawn from the kept
    ones; without it, it waits. A replay step acknowledges nothing and leaves a partial batch queued."""
    waiting = TrainerService(config(models, redis_url, tmp_path / "off", consumer="off", group="off",
                                    steps_per_version=100), client=client)
    service = TrainerService(config(models, redis_url, tmp_path / "run", replay_traces=4, steps_per_version=100),
                             client=client)
    traces = make_traces(2, heldout=False)
    add(client, traces)
    poll_until(waiting, lambda: waiting.learner.num_steps == 1)
    waiting.poll(block_ms=10)
    assert waiting.learner.num_steps == 1  # no replay: a quiet stream is a wait
    poll_until(service, lambda: service.learner.num_steps == 1)
    before = copy.deepcopy(service.learner.weights().state_dict())
    service.poll(block_ms=10)  # nothing new
    assert service.learner.num_steps == 2 and service.status().replay_steps == 1
    assert any(not torch.equal(before[k], v) for k, v in service.learner.weights().state_dict().items())
    assert list(service.learner.trained_ids) == [t.trace_id for t in traces]
    assert service.status().traces_consumed == 2
    add(client, make_traces(1, heldout=False, start=100))
    service.poll(block_ms=10)  # takes the new trace in: half a batch, no replay while traces arrive
    service.poll(block_ms=10)  # quiet again: a replay step; the half batch stays queued
    assert service.status().replay_steps == 2 and len(service.learner.batch) == 1
    service.checkpoint()
    assert pending(client) == 1  # the two trained traces acknowledged, the queued one not
    state = saved_state(tmp_path / "run")
    assert [entry[0] for entry in state["data"]["replay"]] == [t.trace_id for t in traces]
    assert state["data"]["trained_ids"] == [t.trace_id for t in traces]


@pytest.mark.parametrize("restart", ["same consumer, own backlog", "new consumer, reclaimed"])
def test_a_killed_trainer_loses_no_trace_and_trains_none_twice(restart, models, redis_url, client, tmp_path):
    directory = tmp_path / "run"
    traces = make_traces(8, heldout=False)
    add(client, traces[:6])
    first = TrainerService(config(models, redis_url, directory), client=client)
    poll_until(first, lambda: first.learner.num_steps == 3)  # checkpoint at 2 (4 acked), one step after it
    assert pending(client) == 2
    # Killed here: `first` is abandoned; the step after the checkpoint is neither saved nor acknowledged.

    overrides = {} if restart.startswith("same") else {"consumer": "trainer-b", "claim_idle_ms": 0}
    second = TrainerService(config(models, redis_url, directory, **overrides), client=client)
    assert second.learner.num_steps == 2  # resumed from the checkpoint
    add(client, traces[6:])
    poll_until(second, lambda: second.learner.num_steps == 4 and pending(client) == 0)
    trained = saved_state(directory)["data"]["trained_ids"]
    assert sorted(trained) == sorted(t.trace_id for t in traces)  # every trace, each once
    assert len(trained) == len(set(trained))


def test_a_checkpoint_saved_but_not_acknowledged_is_not_trained_again(models, redis_url, client, tmp_path):
    directory = tmp_path / "run"
    traces = make_traces(6, heldout=False)
    add(client, traces[:2])
    first = TrainerService(config(models, redis_url, directory, steps_per_version=5), client=client)
    poll_until(first, lambda: first.learner.num_steps == 1)
    first.learner.save()  # the checkpoint is written; the process dies before acknowledging
    weights = {k: v.clone() for k, v in first.learner.trainer.drafter.state_dict().items()}
    assert pending(client) == 2  # `first` is abandoned from here on

    second = TrainerService(config(models, redis_url, directory, consumer="trainer-b", claim_idle_ms=0), client=client)
    poll_until(second, lambda: second.learner.counters.duplicates == 2)
    assert second.learner.num_steps == 1  # the redelivered traces were skipped, not trained
    assert all(torch.equal(weights[k], v) for k, v in second.learner.trainer.drafter.state_dict().items())
    add(client, traces[2:])
    poll_until(second, lambda: second.learner.num_steps == 3 and pending(client) == 0)
    trained = saved_state(directory)["data"]["trained_ids"]
    assert trained == [t.trace_id for t in traces]


def test_bad_entries_and_repeatedly_delivered_ones_go_to_the_dead_letter_stream(models, redis_url, client, tmp_path):
    good = make_traces(1, heldout=False)[0]
    bad = [
        ({"trace_id": "abc", "prompt_ids": "[1, 2"}, "lacks field(s) output_ids"),
        ({**good.to_fields(), "trace_id": "not-hex!"}, "hex digits"),
        ({**good.to_fields(), "output_ids": "[1, \"x\"]"}, "JSON list of integers"),
        ({**good.to_fields(), "prompt_ids": "{not json"}, "not JSON"),
    ]
    ids = [client.xadd("specd:traces", fields) for fields, _ in bad]
    service = TrainerService(config(models, redis_url, tmp_path / "run", max_deliveries=1, claim_idle_ms=0), client=client)
    poll_until(service, lambda: client.xlen("specd:traces:dead") == 4)
    dead = client.xrange("specd:traces:dead")
    for (_, words), (_, fields), source in zip(bad, dead, ids):
        assert words in fields["dead_reason"] and fields["dead_source_id"] == source
    assert pending(client) == 0 and service.status().traces_consumed == 0
    assert service.learner.counters.dead_letters == 4

    # A trace a dead consumer took and never acknowledged comes back once more: above max_deliveries.
    entry = client.xadd("specd:traces", good.to_fields())
    client.xreadgroup("specd-trainer", "ghost", {"specd:traces": ">"})
    poll_until(service, lambda: client.xlen("specd:traces:dead") == 5)
    _, fields = client.xrange("specd:traces:dead")[-1]
    assert fields["dead_source_id"] == entry and "delivered 2 times" in fields["dead_reason"]
    assert fields["trace_id"] == good.trace_id  # the entry itself is kept for inspection
    assert pending(client) == 0


# ---------------------------------------------------------------------------- the gate and versions
def test_the_gate_refuses_a_worse_drafter_and_publishes_a_better_or_equal_one(models, redis_url, client, tmp_path):
    service = TrainerService(config(models, redis_url, tmp_path / "run"), client=client)
    heldout = make_traces(4, heldout=True)
    add(client, heldout)
    poll_until(service, lambda: len(service.learner.heldout) == 4)
    hints = client.pubsub()
    hints.subscribe("specd:drafter:updates")
    assert hints.get_message(timeout=5)["type"] == "subscribe"

    # A better drafter: the initial one distilled on these trajectories for a few steps.
    better = load_model(models / "drafter")
    distiller = SpecOPDTrainer(load_model(models / "target"), better,
                               SpecOPDConfig(block_size=4, anchors_per_seq=4, branches_per_anchor=4, lr=3e-3))
    for _ in range(15):
        distiller.step([t.trajectory for t in heldout])
    initial_tau = expected_tau(service.learner.live, [t.trajectory for t in heldout], seed=0)
    assert service.offer(better)
    status = service.status()
    print(f"held-out tau: initial {initial_tau:.4f}, distilled {status.last_candidate_tau:.4f}")
    assert status.last_candidate_tau > initial_tau + 0.01
    assert status.versions_published == 1 and status.live_tau == status.last_candidate_tau

    record = json.loads(client.get("specd:drafter:live"))
    assert record["version"] == status.live_version
    assert json.loads(hints.get_message(timeout=5)["data"]) == record
    directory = tmp_path / "run" / "versions" / record["version"]
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    assert record["sha256"] == {name: file_sha256(directory / name) for name in ("config.json", "model.safetensors")}
    assert all(torch.equal(a, b) for a, b in zip(load_model(directory).state_dict().values(), better.state_dict().values()))

    torch.manual_seed(99)
    worse = D3DModel(D3D_FLAVOURS["debug"])  # re-initialised: knows nothing
    assert not service.offer(worse)
    assert service.status().versions_refused == 1 and service.status().last_candidate_tau < status.live_tau
    assert json.loads(client.get("specd:drafter:live")) == record  # the live version did not move

    assert service.offer(copy.deepcopy(better))  # equal is not worse
    assert service.status().versions_published == 2
    hints.close()


def test_get_checkpoint_serves_published_versions(models, redis_url, client, tmp_path):
    service = TrainerService(config(models, redis_url, tmp_path / "run"), client=client)
    add(client, make_traces(1, heldout=True))
    poll_until(service, lambda: len(service.learner.heldout) == 1)
    server = GrpcServer("trainer-test", ServiceConfig())
    trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(service, default_chunk_bytes=4096), server.server)
    port = server.start([SERVICE_NAME])
    server.set_serving()
    try:
        with open_channel(f"127.0.0.1:{port}", ServiceConfig()) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.GetCheckpoint(trainer_pb2.GetCheckpointRequest()))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "published" in caught.value.details()

            assert service.publish_checkpoint(models / "drafter")  # the live drafter's own weights: equal passes
            record = json.loads(client.get("specd:drafter:live"))
            fetched = fetch_checkpoint(stub, "", tmp_path / "fetched", expected_sha256=record["sha256"])
            for name in ("config.json", "model.safetensors"):
                assert (fetched / name).read_bytes() == (tmp_path / "run" / "versions" / record["version"] / name).read_bytes()
            assert stub.Status(trainer_pb2.StatusRequest()).live_version == record["version"]

            with pytest.raises(grpc.RpcError) as caught:
                list(stub.GetCheckpoint(trainer_pb2.GetCheckpointRequest(version="../online")))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "unknown drafter version" in caught.value.details()
    finally:
        server.stop(None)


def test_a_restarted_trainer_adopts_a_version_published_after_its_last_checkpoint(models, redis_url, client, tmp_path):
    first = TrainerService(config(models, redis_url, tmp_path / "run"), client=client)
    add(client, make_traces(1, heldout=True))
    poll_until(first, lambda: len(first.learner.heldout) == 1)
    first.learner.save()
    assert first.publish_checkpoint(models / "drafter")  # published, then killed before the next checkpoint
    version = first.status().live_version  # `first` is abandoned from here on
    second = TrainerService(config(models, redis_url, tmp_path / "run"), client=client)
    assert second.status().live_version == version and second.version_dir("") is not None


def test_gate_rules_and_trace_entries():
    assert gate(1.5, 1.5) and gate(1.6, 1.5) and not gate(1.4, 1.5)
    assert not gate(float("nan"), 1.5) and not gate(1.5, float("nan"))  # no evidence, no publish
    trace = make_traces(1, heldout=False)[0]
    assert Trace.from_fields({k.encode(): v.encode() for k, v in trace.to_fields().items()}) == trace
    assert [is_heldout(f"{i:x}", 5) for i in range(50)] == [is_heldout(f"{i:x}", 5) for i in range(50)]
    assert 5 <= sum(is_heldout(f"{i:x}", 5) for i in range(500)) / 5 <= 200  # about one in five
    with pytest.raises(ValueError, match="heldout_every"):
        OnlineConfig(heldout_every=1)


# ---------------------------------------------------------------------------- the process
def test_sigterm_finishes_the_step_saves_and_acknowledges(models, redis_url, client, tmp_path):
    traces = make_traces(2, heldout=False)
    add(client, traces)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECD_REDIS_URL": redis_url}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.trainer", "--port", str(port), "--drafter", str(models / "drafter"),
         "--target", str(models / "target"), "--checkpoint-dir", str(tmp_path / "run"), "--batch-size", "2",
         "--steps-per-version", "100", "--heldout-every", str(HELDOUT_EVERY), "--block-size", "4",
         "--anchors-per-seq", "2", "--branches-per-anchor", "2", "--block-ms", "50", "--drain-seconds", "1"],
        env=env, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        address = f"127.0.0.1:{port}"
        wait_healthy(address, ServiceConfig(), timeout=60, service=SERVICE_NAME)
        with open_channel(address, ServiceConfig()) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            deadline = time.monotonic() + 60
            while stub.Status(trainer_pb2.StatusRequest()).steps < 1:  # poll Status until the first step
                assert time.monotonic() < deadline, "no training step within 60 s"
                time.sleep(0.05)
        assert pending(client) == 2  # trained, but no checkpoint is due: not acknowledged yet
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output
    state = saved_state(tmp_path / "run")
    assert state["num_steps"] == 1 and state["data"]["trained_ids"] == [t.trace_id for t in traces]
    assert pending(client) == 0


# ---------------------------------------------------------------------------- the ledger
def ids(traces: list[Trace]) -> list[str]:
    return [t.trace_id for t in traces]


def assert_each_once(ledger: list[LedgerEntry], acknowledged: list[str]) -> None:
    """The property a fault test checks: every acknowledged trace in exactly one entry."""
    taken = [i for entry in ledger for i in entry.trained + entry.heldout]
    twice = sorted({i for i in taken if taken.count(i) > 1})
    assert not twice, f"trace ids in two ledger entries: {twice}"
    assert sorted(taken) == sorted(acknowledged)
    assert [entry.checkpoint for entry in ledger] == list(range(1, len(ledger) + 1))


def test_the_ledger_records_each_checkpoint_and_survives_a_restart(models, redis_url, client, tmp_path):
    directory = tmp_path / "run"
    trained, heldout = make_traces(6, heldout=False), make_traces(2, heldout=True, start=1000)
    add(client, [trained[0], heldout[0], *trained[1:4]])
    first = TrainerService(config(models, redis_url, directory), client=client)
    poll_until(first, lambda: first.learner.num_steps == 2 and pending(client) == 0)
    want = [LedgerEntry(checkpoint=1, num_steps=2, trained=ids(trained[:4]), heldout=ids(heldout[:1]))]
    assert read_ledger(directory) == read_ledger(directory / "online") == first.learner.ledger == want
    first.stop()
    first.run()  # a stop with nothing new since the checkpoint writes none

    second = TrainerService(config(models, redis_url, directory), client=client)
    assert second.learner.ledger == want and second.learner.num_checkpoints == 1
    add(client, [heldout[1], *trained[4:]])
    poll_until(second, lambda: second.learner.num_steps == 3)
    second.stop()
    second.run()  # the shutdown path: one step since the checkpoint, saved as checkpoint 2
    want.append(LedgerEntry(checkpoint=2, num_steps=3, trained=ids(trained[4:]), heldout=ids(heldout[1:])))
    assert read_ledger(directory) == want and pending(client) == 0

    # A data-parallel checkpoint keeps the same state as JSON (trainer.json): read the same way.
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "trainer.json").write_text(json.dumps({"data": second.learner.state()}))
    assert read_ledger(tmp_path / "dcp") == want
    with pytest.raises(FileNotFoundError, match="no online checkpoint"):
        read_ledger(tmp_path / "nothing")


def test_a_successor_skips_every_redelivered_heldout_trace_even_past_max_heldout(models, redis_url, client, tmp_path):
    """A window of more held-out traces than the gate keeps, saved and never acknowledged (a kill
    between checkpoint and ack): the successor is redelivered all of them and must skip each one.
    (When the gate's own newest ``max_heldout`` were the only memory, the oldest came back as
    new, pushed out the next before it came back, and every one landed in two ledger entries.)"""
    directory = tmp_path / "run"
    trained, heldout = make_traces(6, heldout=False), make_traces(3, heldout=True, start=1000)
    add(client, [*heldout, *trained[:4]])
    first = TrainerService(config(models, redis_url, directory, max_heldout=1), client=client)
    first.stream.ack = lambda ids: None  # killed between the checkpoint and its XACK
    poll_until(first, lambda: first.learner.num_checkpoints == 1)
    assert pending(client) == 7 and len(first.learner.heldout) == 1

    second = TrainerService(config(models, redis_url, directory, max_heldout=1), client=client)
    add(client, trained[4:])
    poll_until(second, lambda: second.learner.num_steps == 3)
    assert second.learner.counters.duplicates == 7
    second.stop()
    second.run()  # saves checkpoint 2 and acknowledges everything
    assert pending(client) == 0
    ledger = read_ledger(directory)
    assert [e.checkpoint for e in ledger] == [1, 2] and ledger[1].heldout == [] and ledger[1].trained == ids(trained[4:])
    assert_each_once(ledger, ids(trained) + ids(heldout))


def test_the_ledger_keeps_the_newest_entries_that_cover_remember_traces():
    entries = [LedgerEntry(checkpoint=n, num_steps=n, trained=[f"{n}-{i}" for i in range(size)], heldout=[])
               for n, size in enumerate([3, 2, 4], start=1)]
    assert [e.checkpoint for e in bounded_ledger(entries, 100)] == [1, 2, 3]
    assert [e.checkpoint for e in bounded_ledger(entries, 6)] == [2, 3]  # 2 + 4 ids cover 6; 4 alone do not
    assert [e.checkpoint for e in bounded_ledger(entries, 4)] == [3]
    assert [e.checkpoint for e in bounded_ledger(entries, 1)] == [3]  # the newest always stays


def test_a_malformed_failpoint_setting_stops_the_trainer_at_start(models, redis_url, client, tmp_path, monkeypatch):
    monkeypatch.setenv(FAILPOINTS, "trainer.after_checkpoint=sleep(forever)")
    with pytest.raises(ValueError, match=f"{FAILPOINTS}.*must be a number"):
        TrainerService(config(models, redis_url, tmp_path / "run"), client=client)


def trainer_process(models: Path, redis_url: str, directory: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.trainer", "--port", str(port), "--drafter", str(models / "drafter"),
         "--target", str(models / "target"), "--checkpoint-dir", str(directory), "--consumer", "trainer-a",
         "--batch-size", "2", "--steps-per-version", "2", "--heldout-every", str(HELDOUT_EVERY), "--min-heldout", "1",
         "--block-size", "4", "--anchors-per-seq", "2", "--branches-per-anchor", "2", "--lr", "3e-3",
         "--block-ms", "20", "--claim-idle-ms", "60000", "--drain-seconds", "1"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "SPECD_REDIS_URL": redis_url, **env},
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.mark.parametrize("restart", ["same consumer", "new consumer"])
def test_kill_9_between_checkpoint_and_ack_leaves_every_acknowledged_trace_in_one_ledger_entry(
        restart, models, redis_url, client, tmp_path):
    """A trainer process is killed inside ``trainer.after_checkpoint`` (saved, nothing acknowledged);
    its successor skips what that checkpoint holds, trains a step and dies too (no checkpoint);
    the third trains the lost step's traces again and checkpoints. Every trace is acknowledged and
    in exactly one ledger entry, and the lost step's traces are in the last one only."""
    directory, log = tmp_path / "run", tmp_path / "failpoints.jsonl"
    trained, heldout = make_traces(8, heldout=False), make_traces(2, heldout=True, start=1000)
    add(client, [trained[0], heldout[0], *trained[1:4]])
    process = trainer_process(models, redis_url, directory, free_port(),
                              {FAILPOINTS: "trainer.after_checkpoint=sleep(600)", FAILPOINT_LOG: str(log)})
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().endswith("\n")):  # poll for the hit: it is in the window now
            if process.poll() is not None:
                raise AssertionError(f"the trainer exited before its checkpoint:\n{process.communicate()[0]}")
            assert time.monotonic() < deadline, "the trainer reached no checkpoint within 120 s"
            time.sleep(0.05)
        hit = json.loads(log.read_text())
        assert hit["name"] == "trainer.after_checkpoint" and hit["pid"] == process.pid
        process.kill()  # kill -9, between the checkpoint and its XACK
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert pending(client) == 5  # saved, never acknowledged
    first_entry = LedgerEntry(checkpoint=1, num_steps=2, trained=ids(trained[:4]), heldout=ids(heldout[:1]))
    assert read_ledger(directory) == [first_entry]

    new = restart.startswith("new")
    second = TrainerService(config(models, redis_url, directory, **({"consumer": "trainer-b", "claim_idle_ms": 0}
                                                                      if new else {})), client=client)
    add(client, trained[4:6])
    poll_until(second, lambda: second.learner.num_steps == 3)
    assert second.learner.counters.duplicates == 5  # the redelivered traces the checkpoint holds: skipped
    # Killed here too: step 3 (trained[4:6]) is in no checkpoint, and nothing is acknowledged.

    third = TrainerService(config(models, redis_url, directory, **({"consumer": "trainer-c", "claim_idle_ms": 0}
                                                                     if new else {})), client=client)
    assert third.learner.num_steps == 2 and third.learner.ledger == [first_entry]
    add(client, [heldout[1], *trained[6:]])
    poll_until(third, lambda: third.learner.num_steps == 4 and pending(client) == 0)
    ledger = read_ledger(directory)
    assert ledger == [first_entry, LedgerEntry(checkpoint=2, num_steps=4, trained=ids(trained[4:]),
                                               heldout=ids(heldout[1:]))]
    assert_each_once(ledger, ids(trained) + ids(heldout))
