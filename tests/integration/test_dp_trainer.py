"""The data-parallel trainer service (2 gloo ranks, real processes, a real redis-server).

Two runs consume the same traces (each in its own Redis database):

- **2 ranks**: ``python -m services.trainer --data-parallel 2`` twice, with the variables torchrun
  sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), stopped with SIGTERM sent to both
  ranks as torchrun forwards it, then started again on its checkpoint;
- **1 rank**: the same `TrainerService` with a `Leader` over a world of one (a spawned process),
  uninterrupted.

The stream: 4 held-out traces, then traces to train on in batches of 4 (a version is due every 2
steps). Before the SIGTERM, steps 1-2 are checkpointed, acknowledged, gated and published, step 3
is trained but not checkpointed, and a 13th trace is queued in no step. After the restart, 3 more
traces make step 4 with the redelivered 13th (then SIGTERM again: at 2 ranks the next version is
due 2 steps after the checkpoint of the first SIGTERM; at 1 rank step 4 is one, checkpointed and
gated). Items 1 and 3 of the first
batch are out of the vocabulary, so at 2 ranks rank 1 has nothing usable on step 1 (its dummy
pass and empty scoring call keep the collectives in step), and one trace has a 2-token output
(fewer anchors: the ranks hold different numbers of branches).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from spawned import run_spawned
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from unit.redis_server import redis_server

from services.common.config import ServiceConfig, parse_config
from services.common.server import open_channel, wait_healthy
from services.trainer.parallel import start_ranks
from services.trainer.server import SERVICE_NAME, TrainerConfig, TrainerService
from services.up import free_port
from specd._proto.v1 import trainer_pb2, trainer_pb2_grpc
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.loading import save_model
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.train.data_parallel import TRAINER_STATE, init_distributed
from specd.train.online import Trace, is_heldout
from specd.train.online_parallel import Leader

VOCAB = FLAVOURS["debug"].vocab_size
HELDOUT_EVERY, BATCH, STEPS_PER_VERSION = 4, 4, 2
NUM_HELDOUT, NUM_BEFORE, NUM_AFTER = 4, 13, 3  # training traces before and after the restart
STEPS_BEFORE, STEPS = 3, 4
TIMEOUT_SECONDS = 120
REPO = Path(__file__).resolve().parents[2]
# As in test_data_parallel: the float noise of another packing (1 vs 2 ranks) moves Adam's step on
# rarely seen weights by ~1e-6; a wrong gradient, row or item moves weights by ~lr.
WEIGHT_TOLERANCE = 5e-5


def flags(models: Path, checkpoint_dir: Path) -> list[str]:
    """The options both runs share (the CLI's flags)."""
    values = {"drafter": models / "drafter", "target": models / "target", "checkpoint_dir": checkpoint_dir,
              "consumer": "trainer", "batch_size": BATCH, "steps_per_version": STEPS_PER_VERSION,
              "heldout_every": HELDOUT_EVERY, "min_heldout": NUM_HELDOUT, "block_size": 4, "anchors_per_seq": 3,
              "branches_per_anchor": 3, "lr": 3e-3, "seed": 7, "block_ms": 20}
    return [f"--{name.replace('_', '-')}={value}" for name, value in values.items()]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(2)
    target = Qwen3ForCausalLM(FLAVOURS["debug"]).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4)  # peaked p: a wrong context or weight shows
    torch.manual_seed(4)
    save_model(target, root / "target")
    save_model(D3DModel(D3D_FLAVOURS["debug"]).eval(), root / "drafter")
    return root


def make_traces() -> tuple[list[Trace], list[Trace]]:
    """(held-out traces, traces to train on), in the order they are pushed."""
    generator = torch.Generator().manual_seed(11)
    heldout, train, number = [], [], 0
    while len(heldout) < NUM_HELDOUT or len(train) < NUM_BEFORE + NUM_AFTER:
        trace_id = f"{number:032x}"
        number += 1
        side, size = (heldout, NUM_HELDOUT) if is_heldout(trace_id, HELDOUT_EVERY) else (train, NUM_BEFORE + NUM_AFTER)
        if len(side) == size:
            continue
        prompt = torch.randint(7, VOCAB, (4 + number % 3,), generator=generator).tolist()
        output = torch.randint(7, VOCAB, (2 if side is train and len(train) == 6 else 10 + number % 5,),
                               generator=generator).tolist()
        if side is train and len(train) in (1, 3):
            output[-1] = VOCAB + 3  # out of the vocabulary: screened out
        side.append(Trace(trace_id=trace_id, prompt_ids=prompt, output_ids=output, accepted=[1],
                          drafter_version="", finish_reason="length"))
    return heldout, train


def push(client: redis.Redis, traces: list[Trace]) -> None:
    for trace in traces:
        client.xadd("specd:traces", trace.to_fields())


def pending_ids(client: redis.Redis) -> list[str]:
    return [p["message_id"] for p in client.xpending_range("specd:traces", "specd-trainer", "-", "+", 100)]


# ---------------------------------------------------------------------------- the 1-rank run
def one_rank(rank: int, argv: list[str]) -> None:
    """The 1-rank service (spawned): the same learner, commands and checkpoints over a world of one."""
    torch.set_num_threads(1)
    ranks = init_distributed("cpu")  # no WORLD_SIZE: a group of one on a HashStore
    service = TrainerService(parse_config(TrainerConfig, argv, env={}), leader=Leader(ranks))
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while service.learner.num_steps < STEPS or service.learner.counters.traces_consumed < NUM_HELDOUT + NUM_BEFORE + NUM_AFTER:
        assert time.monotonic() < deadline, "the 1-rank service did not get there"
        service.poll(block_ms=20)
    service.learner.close()
    dist.destroy_process_group()


def run_one_rank(redis_url: str, models: Path, directory: Path) -> None:
    argv = [*flags(models, directory), f"--redis-url={redis_url}"]
    run_spawned(one_rank, (argv,), 1, TIMEOUT_SECONDS, "the 1-rank service")


# ---------------------------------------------------------------------------- the 2-rank run
class TwoRanks:
    """``services.trainer --data-parallel 2`` as torchrun starts it: one process per rank."""

    def __init__(self, redis_url: str, models: Path, directory: Path, name: str) -> None:
        self.port = free_port()
        argv = [*flags(models, directory), "--data-parallel=2", f"--port={self.port}", "--drain-seconds=0.5"]
        master_port = free_port()
        directory.parent.mkdir(parents=True, exist_ok=True)
        self.logs = [directory.parent / f"{name}-rank{rank}.log" for rank in range(2)]
        self.processes = []
        for rank, log in enumerate(self.logs):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SPECD_REDIS_URL": redis_url,
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
            self.processes.append(subprocess.Popen([sys.executable, "-m", "services.trainer", *argv], env=env,
                                                   cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT))

    def wait_for(self, done) -> trainer_pb2.StatusResponse:
        """Poll Status until ``done(status)``."""
        address = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + TIMEOUT_SECONDS
        wait_healthy(address, ServiceConfig(), timeout=TIMEOUT_SECONDS, service=SERVICE_NAME)
        with open_channel(address, ServiceConfig()) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            while not done(status := stub.Status(trainer_pb2.StatusRequest())):
                assert all(p.poll() is None for p in self.processes), "a rank exited early"
                assert time.monotonic() < deadline, f"the 2-rank service did not get there: {status}"
                time.sleep(0.05)
        return status

    def terminate(self) -> list[int]:
        """SIGTERM to every rank (what torchrun does with the one it gets); their exit codes."""
        try:
            for process in self.processes:
                process.send_signal(signal.SIGTERM)
            return [process.wait(timeout=60) for process in self.processes]
        finally:
            self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    def output(self) -> list[str]:
        return [log.read_text() for log in self.logs]


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp_trainer")
    heldout, train = make_traces()
    with redis_server(root) as url:
        urls = {"one": url[:-1] + "1", "two": url[:-1] + "2"}  # one database per run
        clients = {name: redis.Redis.from_url(u, decode_responses=True) for name, u in urls.items()}
        seconds, out = {}, {"root": root, "models": models, "heldout": heldout, "train": train}
        start = time.monotonic()
        push(clients["two"], heldout + train[:NUM_BEFORE])
        first = TwoRanks(urls["two"], models, root / "two" / "run", "first")
        try:
            out["status_before"] = first.wait_for(lambda s: s.steps == STEPS_BEFORE and
                                                  s.traces_consumed == NUM_HELDOUT + NUM_BEFORE)
            out["pending_at_sigterm"] = pending_ids(clients["two"])
            out["codes_before"] = first.terminate()
        finally:
            first.kill()
        out["logs_before"] = first.output()
        out["pending_after_sigterm"] = pending_ids(clients["two"])
        out["state_before"] = state(root / "two" / "run")
        seconds["2 ranks, until SIGTERM"] = time.monotonic() - start

        start = time.monotonic()
        push(clients["two"], train[NUM_BEFORE:])
        second = TwoRanks(urls["two"], models, root / "two" / "run", "second")
        try:  # resumed at step 3; step 4 with the redelivered trace
            out["status"] = second.wait_for(lambda s: s.steps == STEPS)
            out["codes_after"] = second.terminate()
        finally:
            second.kill()
        out["logs_after"] = second.output()
        seconds["2 ranks, resumed"] = time.monotonic() - start

        start = time.monotonic()
        push(clients["one"], heldout + train)
        run_one_rank(urls["one"], models, root / "one" / "run")
        seconds["1 rank"] = time.monotonic() - start
        out["entries"] = {i: f["trace_id"] for i, f in clients["two"].xrange("specd:traces")}
        out["pending"] = {name: pending_ids(client) for name, client in clients.items()}
        out["live"] = {name: json.loads(client.get("specd:drafter:live")) for name, client in clients.items()}
        print("wall seconds:", {k: round(v, 1) for k, v in seconds.items()})
        for client in clients.values():
            client.close()
        yield out


def state(run: Path) -> dict:
    return json.loads((run / "online" / TRAINER_STATE).read_text())


def checkpoint_weights(run: Path, scratch: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(run / "online" / "dcp", scratch)
    return torch.load(scratch, weights_only=False)["model"]


def first_version(run: Path) -> tuple[str, dict[str, torch.Tensor]]:
    (directory,) = (run / "versions").glob(f"v{STEPS_PER_VERSION:07d}-*")
    return directory.name, load_file(str(directory / "model.safetensors"))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# ---------------------------------------------------------------------------- the properties
def test_sigterm_exits_cleanly_and_acknowledges_only_what_the_checkpoint_holds(runs):
    print("rank 0:", runs["logs_before"][0][-2500:], "rank 1:", runs["logs_before"][1][-1000:], sep="\n")
    assert runs["codes_before"] == [0, 0], "both ranks exit 0 on SIGTERM"
    heldout, train, saved, entries = runs["heldout"], runs["train"], runs["state_before"], runs["entries"]
    assert saved["num_steps"] == STEPS_BEFORE and saved["world_size"] == 2
    assert saved["data"]["trained_ids"] == [t.trace_id for t in train[: STEPS_BEFORE * BATCH]]
    assert [i for i, *_ in saved["data"]["heldout"]] == [t.trace_id for t in heldout]
    # At SIGTERM, step 3's traces and the queued one were pending: no checkpoint since step 2.
    assert sorted(entries[i] for i in runs["pending_at_sigterm"]) == sorted(t.trace_id for t in train[8:NUM_BEFORE])
    # After it, what was acknowledged is exactly what the saved checkpoint holds; the queued trace waits.
    first = [i for i in entries if entries[i] in {t.trace_id for t in heldout + train[:NUM_BEFORE]}]
    acknowledged = {entries[i] for i in first if i not in runs["pending_after_sigterm"]}
    assert acknowledged == set(saved["data"]["trained_ids"]) | {t.trace_id for t in heldout}
    assert [entries[i] for i in runs["pending_after_sigterm"]] == [train[NUM_BEFORE - 1].trace_id]
    assert "rank 1: STOP after" in runs["logs_before"][1]


def test_a_restarted_two_rank_service_resumes_its_checkpoint_and_goes_on(runs):
    print("rank 0:", runs["logs_after"][0][-2500:], sep="\n")
    assert runs["codes_after"] == [0, 0]
    assert "resumed the online checkpoint at step 3" in runs["logs_after"][0]
    saved = state(runs["root"] / "two" / "run")
    assert saved["num_steps"] == STEPS and runs["pending"]["two"] == []  # the final SIGTERM's checkpoint
    assert saved["data"]["trained_ids"] == [t.trace_id for t in runs["train"]]  # each once, the queued one too


def test_two_ranks_train_gate_and_publish_what_one_rank_does(runs, tmp_path):
    one, two = runs["root"] / "one" / "run", runs["root"] / "two" / "run"
    before = runs["status_before"]
    assert before.versions_published == 1 and before.versions_refused == 0
    # The version published after step 2: the full weights gathered on rank 0, equal to one rank's.
    name_one, published_one = first_version(one)
    name_two, published_two = first_version(two)
    assert name_two == before.live_version
    initial = load_file(str(runs["models"] / "drafter" / "model.safetensors"))
    difference, moved = max_difference(published_one, published_two), max_difference(initial, published_two)
    # The checkpoint at step 4 (2 ranks: written after a SIGTERM and a restart; DCP, gathered here).
    final = max_difference(checkpoint_weights(one, tmp_path / "one.pt"), checkpoint_weights(two, tmp_path / "two.pt"))
    # Both checkpoints at step 4 hold the step-2 gate's figures (the 1-rank one gates step 4 after saving).
    counters = {name: state(run)["data"]["counters"] for name, run in (("one", one), ("two", two))}
    print(f"published weights: max |diff| 1 vs 2 ranks {difference:.2e} (moved {moved:.2e} from the initial); "
          f"checkpoint after step {STEPS}: {final:.2e}\ncounters 1 rank {counters['one']}\n2 ranks {counters['two']}")
    assert difference < WEIGHT_TOLERANCE and final < WEIGHT_TOLERANCE and moved > 1e-3
    for name in ("versions_published", "versions_refused", "live_tau", "last_candidate_tau"):
        assert counters["one"][name] == pytest.approx(counters["two"][name], rel=1e-5), name
    assert counters["two"]["live_tau"] == pytest.approx(before.live_tau) and before.live_tau > 1.0
    assert state(one)["num_supervised_tokens"] == state(two)["num_supervised_tokens"] == runs["status"].supervised_tokens
    assert state(one)["data"]["trained_ids"] == state(two)["data"]["trained_ids"]
    assert runs["live"]["two"]["version"] == name_two == runs["status"].live_version
    assert runs["live"]["one"]["version"] in (name_one, *(p.name for p in (one / "versions").iterdir()))


def test_more_ranks_than_processes_is_refused_with_the_torchrun_command(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE is not set: launch it as `torchrun --nproc-per-node 2"):
        start_ranks(2, "cpu")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(RuntimeError, match="needs 2 processes, one per rank, but WORLD_SIZE is 3"):
        start_ranks(2, "cpu")
