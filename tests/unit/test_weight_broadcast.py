"""Drafter versions broadcast over torch.distributed (gloo on CPU), with pulling as the fallback.

Properties: receivers in other processes end with byte-identical files whose sha256 they checked;
a wrong announced sha256 is refused and installs nothing; a member that never joins makes the
broadcaster give up within its timeout with an error naming it, and tells the members that did
join to give up at once; the registry ignores stale heartbeats. End to end, with a real
redis-server: a version the trainer publishes reaches a registered drafter by broadcast (it never
calls GetCheckpoint) and is served; when a registered replica never joins, the trainer still
publishes and the drafter pulls the version instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from prometheus_client import CollectorRegistry
from redis_server import redis_server

from services.common.broadcast import (
    ANNOUNCEMENT_KEY,
    REGISTRY_KEY,
    Announcement,
    BroadcastError,
    Membership,
    VersionBroadcast,
    heartbeat,
    leave,
    live_members,
)
from services.common.config import ServiceConfig, parse_config
from services.common.server import GrpcServer, open_channel
from services.drafter.server import DrafterConfig, DrafterMetrics, DrafterServicer
from services.drafter.weights import WeightWatcher
from services.trainer.server import SERVICE_NAME, TrainerConfig, TrainerMetrics, TrainerService, TrainerServicer
from specd._proto.v1 import trainer_pb2_grpc
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.loading import file_sha256, load_model, save_model
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.train.online import Trace, is_heldout

CHUNK_BYTES = 64 << 10  # the tiny drafter's weights (~700 KB) cross in about a dozen pieces
VERSION_KEY, VERSION_CHANNEL = "specd:drafter:live", "specd:drafter:updates"

# A receiver process: joins one update through the real code, exits 3 when it refuses the files
# (sha256), 4 when the update cannot complete.
RECEIVER = """
import sys
from pathlib import Path
from services.common.broadcast import Announcement, BroadcastError, receive_version
from services.common.checkpoints import CheckpointError
try:
    receive_version(Announcement.parse(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
except CheckpointError as err:
    print(err, file=sys.stderr)
    sys.exit(3)
except BroadcastError as err:
    print(err, file=sys.stderr)
    sys.exit(4)
"""


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A tiny random target, the trainer's tiny D3D drafter, and a different one a replica starts on."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(2)
    target = Qwen3ForCausalLM(FLAVOURS["debug"]).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
    save_model(target, root / "target")
    for name, seed in (("drafter", 4), ("replica", 5)):
        torch.manual_seed(seed)
        save_model(D3DModel(D3D_FLAVOURS["debug"]).eval(), root / name)
    return root


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def client(redis_url) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url, decode_responses=True)
    connection.flushall()
    yield connection
    connection.close()


def sha256_map(directory: Path) -> dict[str, str]:
    return {path.name: file_sha256(path) for path in sorted(directory.iterdir())}


def start_receiver(announcement: Announcement, replica_id: str, destination: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RECEIVER, announcement.to_json(), replica_id, str(destination)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True,
    )


def finish(process: subprocess.Popen) -> tuple[int, str]:
    _, stderr = process.communicate(timeout=60)
    return process.returncode, stderr


def wait_joined(update: VersionBroadcast, ranks: list[int]) -> None:
    """Readiness poll: the receivers at ``ranks`` said they are ready (so a short timeout is fair)."""
    deadline = time.monotonic() + 60
    while not all(update.store.check([f"ready/{rank}"]) for rank in ranks):
        assert time.monotonic() < deadline, f"receivers {ranks} never joined"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- the transfer
def test_two_receivers_end_with_byte_identical_verified_files(models, tmp_path):
    source = models / "drafter"
    assert (source / "model.safetensors").stat().st_size > 4 * CHUNK_BYTES  # several pieces per file
    members = ["replica-b", "replica-a"]
    with VersionBroadcast(source, "v1", sha256_map(source), members, host="127.0.0.1", timeout=30.0,
                          chunk_bytes=CHUNK_BYTES) as update:
        assert update.announcement.members == ["replica-a", "replica-b"] and update.announcement.backend == "gloo"
        receivers = {m: start_receiver(update.announcement, m, tmp_path / m / "v1") for m in members}
        result = update.send()
        outcomes = {m: finish(process) for m, process in receivers.items()}
    assert outcomes == {m: (0, "") for m in members}
    assert sorted(result.received) == sorted(members) and result.refused == {}
    for member in members:
        received = tmp_path / member / "v1"
        assert sorted(os.listdir(tmp_path / member)) == ["v1"]  # no staging directory left behind
        assert sorted(os.listdir(received)) == ["config.json", "model.safetensors"]
        for name in ("config.json", "model.safetensors"):
            assert (received / name).read_bytes() == (source / name).read_bytes()
        assert sha256_map(received) == update.announcement.sha256


def test_a_wrong_announced_sha256_is_refused_and_installs_nothing(models, tmp_path):
    source = models / "drafter"
    wrong = {**sha256_map(source), "model.safetensors": "0" * 64}
    with VersionBroadcast(source, "v2", wrong, ["replica-a"], host="127.0.0.1", timeout=30.0,
                          chunk_bytes=CHUNK_BYTES) as update:
        receiver = start_receiver(update.announcement, "replica-a", tmp_path / "replica-a" / "v2")
        result = update.send()
        code, stderr = finish(receiver)
    assert code == 3, stderr
    assert "model.safetensors" in stderr and "refusing to install" in stderr
    assert os.listdir(tmp_path / "replica-a") == []  # neither the version nor its staging directory
    assert result.received == [] and "sha256 mismatch" in result.refused["replica-a"]


def test_a_member_that_never_joins_makes_the_broadcast_time_out_cleanly(models, tmp_path):
    source = models / "drafter"
    timeout = 2.0
    with VersionBroadcast(source, "v3", sha256_map(source), ["alive", "ghost"], host="127.0.0.1", timeout=timeout) as update:
        receiver = start_receiver(update.announcement, "alive", tmp_path / "alive" / "v3")
        wait_joined(update, [update.announcement.rank_of("alive")])
        started = time.monotonic()
        with pytest.raises(BroadcastError, match=r"\['ghost'\] did not join") as caught:
            update.send()
        waited = time.monotonic() - started
        code, stderr = finish(receiver)
        told = time.monotonic() - started
    assert timeout - 0.5 < waited < timeout + 3, f"gave up after {waited:.1f}s with a {timeout}s timeout"
    assert "--broadcast-host" in str(caught.value)  # says what to check
    # The member that joined was called off at once, not after its own (longer) patience.
    assert code == 4 and "called off" in stderr and told < timeout + 10
    assert not (tmp_path / "alive").exists()


def test_announcements_are_checked_before_anything_is_joined():
    good = Announcement(version="v1", sha256={"a": "0" * 64}, files={"a": 3}, master_addr="127.0.0.1", master_port=1,
                        world_size=2, members=["x"], backend="gloo", timeout=1.0)
    assert Announcement.parse(good.to_json()) == good and good.rank_of("x") == 1 and good.rank_of("y") is None
    for bad, message in [
        ({"files": {"../a": 3}, "sha256": {"../a": "0" * 64}}, "plain name"),
        ({"version": ".."}, "plain name"),
        ({"files": {"b": 3}}, "sha256 names"),
        ({"world_size": 3}, "world_size"),
        ({"backend": "mpi"}, "backend"),
        ({"master_port": "1"}, "store address"),
        ({"members": "x"}, "members"),
        ({"timeout": "1"}, "timeout"),
        ({"files": ["a"]}, "non-empty maps"),
    ]:
        with pytest.raises(ValueError, match=message):
            Announcement.parse(_replace(good, **bad).to_json())
    for raw in ('{"version": "v1"}', "[1, 2]", "not json"):
        with pytest.raises(ValueError, match="not the JSON"):
            Announcement.parse(raw)


def _replace(announcement: Announcement, **changes) -> Announcement:
    values = {name: getattr(announcement, name) for name in Announcement.__dataclass_fields__}
    return Announcement(**{**values, **changes})


def test_the_registry_ignores_stale_heartbeats(client):
    heartbeat(client, "replica-b")
    heartbeat(client, "replica-a")
    seconds, _ = client.time()
    client.zadd(REGISTRY_KEY, {"replica-dead": seconds - 10})  # > 3 heartbeats of 2 s ago
    assert live_members(client, heartbeat_seconds=2.0) == ["replica-a", "replica-b"]
    assert client.zscore(REGISTRY_KEY, "replica-dead") is None  # pruned
    leave(client, "replica-a")
    assert live_members(client) == ["replica-b"]


def test_weight_transport_flags_are_checked():
    trainer = ["--redis-url", "redis://x", "--drafter", "d", "--target", "t"]
    assert parse_config(TrainerConfig, trainer + ["--weight-transport", "broadcast"]).weight_transport == "broadcast"
    assert parse_config(TrainerConfig, trainer, env={}).weight_transport == "pull"
    with pytest.raises(ValueError, match="weight_transport"):
        TrainerConfig(redis_url="redis://x", drafter="d", target="t", weight_transport="carrier-pigeon")
    with pytest.raises(ValueError, match="needs --trainer"):
        DrafterConfig(model="m", weight_transport="broadcast")
    drafter = DrafterConfig(model="m", weight_transport="broadcast", trainer="t:1", redis_url="redis://x")
    assert drafter.membership() is not None and drafter.membership().replica_id == drafter.replica_id
    assert DrafterConfig(model="m").membership() is None


# ---------------------------------------------------------------------------- end to end
class CountingTrainer(TrainerServicer):
    """The trainer's servicer, counting GetCheckpoint calls (a pull)."""

    def __init__(self, service: TrainerService) -> None:
        super().__init__(service)
        self.pulls = 0

    def GetCheckpoint(self, request, context):
        self.pulls += 1
        yield from super().GetCheckpoint(request, context)


def heldout_trace() -> Trace:
    trace_id = next(f"{n:032x}" for n in range(1000) if is_heldout(f"{n:032x}", 4))
    generator = torch.Generator().manual_seed(0)
    vocab = FLAVOURS["debug"].vocab_size
    return Trace(trace_id=trace_id, prompt_ids=torch.randint(7, vocab, (5,), generator=generator).tolist(),
                 output_ids=torch.randint(7, vocab, (12,), generator=generator).tolist(), accepted=[1, 0],
                 drafter_version="", finish_reason="length")


@dataclass
class Setup:
    service: TrainerService
    trainer: CountingTrainer
    trainer_metrics: CollectorRegistry
    drafter: DrafterServicer
    watcher: WeightWatcher


@contextlib.contextmanager
def trainer_and_drafter(models: Path, redis_url: str, client: redis.Redis, tmp_path: Path, *, broadcast_timeout: float):
    """A broadcasting TrainerService behind a real gRPC server, and a drafter replica whose
    watcher joins broadcasts (registered and listening when this yields)."""
    config = TrainerConfig(
        redis_url=redis_url, drafter=str(models / "drafter"), target=str(models / "target"),
        checkpoint_dir=str(tmp_path / "trainer"), consumer="trainer-a", batch_size=2, heldout_every=4, min_heldout=1,
        block_size=4, anchors_per_seq=2, branches_per_anchor=2, block_ms=20,
        weight_transport="broadcast", broadcast_host="127.0.0.1", broadcast_timeout=broadcast_timeout,
    )
    trainer_metrics = CollectorRegistry()
    service = TrainerService(config, client=client, metrics=TrainerMetrics(trainer_metrics))
    client.xadd(config.stream, heldout_trace().to_fields())
    for _ in range(50):  # the gate needs one held-out trace
        if service.learner.heldout:
            break
        service.poll(block_ms=10)
    servicer = CountingTrainer(service)
    server = GrpcServer("trainer-test", ServiceConfig())
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server.server)
    port = server.start([SERVICE_NAME])
    server.set_serving()

    drafter = DrafterServicer(max_num_seqs=2, metrics=DrafterMetrics(CollectorRegistry()))
    drafter.swap_weights(models / "replica", "initial")
    metrics = drafter.metrics
    channel = open_channel(f"127.0.0.1:{port}", ServiceConfig())
    watcher = WeightWatcher(
        drafter, redis.Redis.from_url(redis_url), trainer_pb2_grpc.TrainerStub(channel),
        directory=tmp_path / "drafter", key=VERSION_KEY, channel=VERSION_CHANNEL, poll_seconds=60.0,
        refused=metrics.weight_refused, broadcast=Membership(replica_id="drafter-0"), pulls=metrics.weight_pulls,
        broadcasts=metrics.weight_broadcasts, broadcast_failures=metrics.weight_broadcast_failures,
    )
    watcher.start()
    try:
        deadline = time.monotonic() + 20
        # Readiness poll: registered, and subscribed (the poll is a minute away: only hints are this quick).
        while client.zscore(REGISTRY_KEY, "drafter-0") is None or client.pubsub_numsub(VERSION_CHANNEL)[0][1] < 1:
            assert time.monotonic() < deadline, "the watcher never registered and subscribed"
            time.sleep(0.02)
        yield Setup(service, servicer, trainer_metrics, drafter, watcher)
    finally:
        watcher.stop()
        channel.close()
        server.stop(None)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def serves(drafter: DrafterServicer, directory: Path) -> bool:
    want = load_model(directory).state_dict()
    return all(torch.equal(tensor, want[name]) for name, tensor in drafter.drafter.model.state_dict().items())


def test_a_published_version_reaches_a_registered_drafter_by_broadcast(models, redis_url, client, tmp_path):
    with trainer_and_drafter(models, redis_url, client, tmp_path, broadcast_timeout=30.0) as setup:
        assert not serves(setup.drafter, models / "drafter")
        assert setup.service.publish_checkpoint(models / "drafter")  # the trainer's own weights: equal passes the gate
        version = setup.service.status().live_version
        assert setup.watcher.wait_for(version, timeout=30) == "installed"
        assert setup.drafter.version == version and serves(setup.drafter, models / "drafter")
        registry = setup.drafter.metrics.registry
        assert sample(registry, "specd:drafter_weight_broadcasts_total") == 1
        assert sample(setup.trainer_metrics, "specd:trainer_weight_broadcasts_total") == 1
        assert client.get(ANNOUNCEMENT_KEY) is None  # the announcement ends with the update
        assert json.loads(client.get(VERSION_KEY))["version"] == version
        # The live key names the version the replica already serves: reading it pulls nothing.
        setup.watcher.stop()
        assert setup.watcher.check() is None
        assert setup.trainer.pulls == 0 and sample(registry, "specd:drafter_weight_pulls_total") == 0


def test_a_member_that_never_joins_makes_the_drafters_pull_instead(models, redis_url, client, tmp_path):
    timeout = 2.0
    with trainer_and_drafter(models, redis_url, client, tmp_path, broadcast_timeout=timeout) as setup:
        heartbeat(client, "ghost")  # registered, then never watching the announcements
        started = time.monotonic()
        assert setup.service.publish_checkpoint(models / "drafter")  # published all the same
        assert time.monotonic() - started < timeout + 10
        version = setup.service.status().live_version
        assert json.loads(client.get(VERSION_KEY))["version"] == version
        assert setup.watcher.wait_for(version, timeout=30) == "installed"
        assert setup.drafter.version == version and serves(setup.drafter, models / "drafter")
        registry = setup.drafter.metrics.registry
        assert setup.trainer.pulls == 1 and sample(registry, "specd:drafter_weight_pulls_total") == 1
        assert sample(registry, "specd:drafter_weight_broadcasts_total") == 0
        # The drafter either joined and was called off, or (on a loaded machine) saw the
        # announcement only after the trainer had given up: one failure or none, never a broadcast.
        assert sample(registry, "specd:drafter_weight_broadcast_failures_total", reason="transfer") in (0.0, 1.0)
        assert sample(setup.trainer_metrics, "specd:trainer_weight_broadcast_failures_total") == 1
        assert client.get(ANNOUNCEMENT_KEY) is None
