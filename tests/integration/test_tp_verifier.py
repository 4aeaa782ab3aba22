"""A tensor-parallel verifier as deployed: ``torchrun --nproc-per-node 2 -m services.verifier
--tensor-parallel 2`` (gloo ranks on the CPU) with a D3D drafter replica, over gRPC.

The target is a random hybrid Qwen3-Next (Gated DeltaNet + gated attention: a KV cache and a
recurrent-state cache on each rank) with a sharpened head. Rank 0 serves; rank 1 replays its
target calls (`services.verifier.lockstep`). What must hold:

- concurrent greedy requests through the drafter give exactly this process's plain greedy decoding
  of the whole model, token for token (and the drafter really drafted);
- ``Score`` (a temporary cache per request: prefill, then a packed tree) gives the whole model's
  distributions within 1e-5;
- SIGTERM to torchrun drains rank 0, which then sends the stop op: rank 1 leaves on it, and both
  are gone in seconds;
- ``--tensor-parallel 2`` without torchrun exits with the command to use.

Before the service, the lockstep itself, for every target kind, in two spawned gloo ranks: rank 0
runs `SpeculativeEngine` (prompt-lookup drafting, so blocks are partly accepted and rows reused),
`LocalScorer`, and ``hidden_states`` + ``lm_head`` over a `LockstepTarget` while rank 1 follows;
everything must equal the whole model in this process.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawned import run_spawned

from services.client import metrics
from services.common.config import ServiceConfig
from services.common.server import open_channel, wait_healthy
from services.common.wire import tensor_from_proto, tree_to_proto
from services.up import free_port
from services.verifier.lockstep import LockstepTarget, follow
from specd._proto.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.batch import ForwardBatch
from specd.data.tokenizer import save_tokenizer, train_tokenizer
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models import qwen3, sparse
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.loading import load_model, save_model
from specd.models.qwen3_next import FLAVOURS, Qwen3NextForCausalLM
from specd.parallel import tensor_parallel
from specd.sampling import SamplingParams
from specd.train.specopd import LocalScorer
from specd.tree import TokenTree

START_TIMEOUT_SECONDS = 90
LOCKSTEP_TIMEOUT_SECONDS = 120


# ---------------------------------------------------------------------------- the lockstep, in-process
KINDS = {
    "qwen3": lambda: qwen3.Qwen3ForCausalLM(qwen3.FLAVOURS["debug"]),
    "qwen3_next": lambda: Qwen3NextForCausalLM(FLAVOURS["debug"]),
    "sparse": lambda: sparse.SparseForCausalLM(sparse.FLAVOURS["debug"]),
}
ENGINE_PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 7, 9, 8, 7, 9, 8], [5] * 6, [11, 12, 13, 14, 15, 16, 17]]
SCORE_CONTEXTS = [[5, 9, 13, 17, 21, 25, 29], [40, 41, 42]]
SCORE_TREES = [TokenTree.from_paths([(7, [3, 4, 5, 6, 7]), (7, [3, 8]), (4, [9, 10])]),
               TokenTree.from_paths([(3, [11, 12]), (1, [13])])]
SCORE_ROWS = [[2, 6], [0]]


@torch.no_grad()
def lockstep_run(target) -> dict:
    """What rank 0 computes through the lockstep target (or the whole model, for the reference)."""
    config = EngineConfig(max_num_seqs=3, mode="sync", block_size=6, adaptive_block=False)
    engine = SpeculativeEngine(target, NgramDrafter(vocab_size=target.config.vocab_size), config)
    generations = engine.generate(ENGINE_PROMPTS, SamplingParams(max_tokens=20))
    engine.close()
    cache = target.new_cache(2)
    batch = ForwardBatch.causal([[3, 1, 4, 1, 5], [9, 2, 6]], cache.lengths.tolist())
    hidden = target.hidden_states(batch, cache)
    return {
        "tokens": [g.token_ids for g in generations],
        "accepted": sum(sum(g.accepted_lengths) for g in generations),
        "score": LocalScorer(target).score(SCORE_CONTEXTS, SCORE_TREES, SCORE_ROWS),
        "head of the last hidden states": target.lm_head(hidden),
        "head of other hidden states": target.lm_head(hidden[:, :2] * 1.5),
    }


def lockstep_worker(rank: int, port: int, root: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for kind in KINDS:
        shard = tensor_parallel(load_model(root / kind))
        if rank != 0:
            follow(shard)
            continue
        target = LockstepTarget(shard)
        results[kind] = lockstep_run(target)
        target.stop()
    if rank == 0:
        torch.save(results, root / "lockstep.pt")
    dist.barrier()  # tear gloo down together: a rank gone early was seen to abort at exit (SIGABRT)
    dist.destroy_process_group()


def test_lockstep_engine_scorer_and_head_equal_the_whole_model(tmp_path):
    whole = {}
    for i, (kind, build) in enumerate(KINDS.items()):
        torch.manual_seed(10 + i)
        model = build().eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8)  # greedy loops that prompt lookup can draft
        save_model(model, tmp_path / kind)
        whole[kind] = lockstep_run(load_model(tmp_path / kind))
    run_spawned(lockstep_worker, (free_port(), tmp_path), 2, LOCKSTEP_TIMEOUT_SECONDS, "the lockstep ranks")
    ranks = torch.load(tmp_path / "lockstep.pt")
    for kind in KINDS:
        got, want = ranks[kind], whole[kind]
        plain = autoregressive(load_model(tmp_path / kind), ENGINE_PROMPTS, SamplingParams(max_tokens=20))
        assert got["tokens"] == want["tokens"] == [g.token_ids for g in plain], kind
        assert got["accepted"] > 0, kind  # blocks were partly accepted: commits of tree prefixes
        for name in ("head of the last hidden states", "head of other hidden states"):
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0)
        for got_probs, want_probs in zip(got["score"], want["score"], strict=True):
            torch.testing.assert_close(got_probs, want_probs, atol=1e-5, rtol=0)
        print(kind, "accepted drafted tokens:", got["accepted"])


# ---------------------------------------------------------------------------- the service


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the whole target module, its directory, the drafter's directory)."""
    root = tmp_path_factory.mktemp("tp_verifier")
    texts = [f"the {a} {b} jumps over the {c} {i} times" for i, (a, b, c) in
             enumerate((a, b, c) for a in ("red", "green", "blue") for b in ("fox", "dog") for c in ("logs", "hills"))]
    tokenizer = train_tokenizer(texts * 4, vocab_size=300)
    vocab = tokenizer.get_vocab_size()
    torch.manual_seed(0)
    target = Qwen3NextForCausalLM(dataclasses.replace(FLAVOURS["debug"], vocab_size=vocab)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # greedy text with structure a drafter can sometimes guess
    save_model(target, root / "target")
    save_tokenizer(tokenizer, root / "target")
    torch.manual_seed(1)
    save_model(D3DModel(dataclasses.replace(D3D_FLAVOURS["debug"], vocab_size=vocab)).eval(), root / "drafter")
    return target, root / "target", root / "drafter"


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def service(models, tmp_path_factory):
    """A drafter replica and a 2-rank verifier; yields (gRPC address, HTTP URL, torchrun process, log)."""
    _, target_dir, drafter_dir = models
    logs = tmp_path_factory.mktemp("tp_verifier_logs")
    drafter_port, grpc_port, http_port = free_port(), free_port(), free_port()
    drafter = subprocess.Popen(
        [sys.executable, "-m", "services.drafter", "--model", str(drafter_dir), "--port", str(drafter_port)],
        stdout=(logs / "drafter.log").open("w"), stderr=subprocess.STDOUT, env=environment())
    log = logs / "verifier.log"
    # --tee 3: each rank's lines prefixed with its rank, so the test can tell what rank 1 said.
    verifier = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--tee", "3",
         "-m", "services.verifier", "--tensor-parallel", "2", "--model", str(target_dir),
         "--port", str(grpc_port), "--http-port", str(http_port), "--drafters", f"127.0.0.1:{drafter_port}",
         "--block-size", "4", "--max-num-seqs", "4"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=environment())
    address = f"127.0.0.1:{grpc_port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        for process, name in ((drafter, "drafter"), (verifier, "verifier")):
            port = drafter_port if name == "drafter" else grpc_port
            while True:
                assert process.poll() is None, f"the {name} exited: {(logs / f'{name}.log').read_text()[-3000:]}"
                try:
                    wait_healthy(f"127.0.0.1:{port}", ServiceConfig(), timeout=2.0)
                    break
                except TimeoutError:
                    assert time.monotonic() < deadline, f"the {name} was not healthy in time"
        yield address, f"http://127.0.0.1:{http_port}", verifier, log
    finally:
        for process in (verifier, drafter):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


@pytest.fixture(scope="module")
def stub(service):
    channel = open_channel(service[0], ServiceConfig())
    yield verifier_pb2_grpc.VerifierStub(channel)
    channel.close()


def generate(stub, prompt: list[int], max_tokens: int) -> list[int]:
    request = verifier_pb2.GenerateRequest(prompt_token_ids=prompt,
                                           params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [t for message in stub.Generate(request, timeout=120) for t in message.token_ids]


def prompts(num: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(num)
    return [torch.randint(7, vocab, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 14, (num,), generator=generator)]


def test_greedy_through_two_ranks_and_a_drafter_equals_plain_greedy(models, service, stub):
    target = models[0]
    http = service[1]
    deadline = time.monotonic() + 60
    # The verifier decodes plain until its pool has checked the drafter (a few seconds).
    while metrics(http).get("specd:spec_decode_num_draft_tokens_total", 0) == 0:
        assert time.monotonic() < deadline, "the verifier never drafted"
        generate(stub, [1, 1, 1], 4)
    batch = prompts(6, target.config.vocab_size)
    with ThreadPoolExecutor(6) as pool:  # more requests than rows: rows are reset and reused
        outputs = list(pool.map(lambda p: generate(stub, p, 16), batch))
    want = [g.token_ids for g in autoregressive(target, batch, SamplingParams(max_tokens=16, stop_token_ids=()))]
    assert outputs == want
    samples = metrics(http)
    print({k: v for k, v in samples.items() if k.startswith("specd:spec_decode_num")})
    assert samples["specd:spec_decode_num_draft_tokens_total"] > 0  # drafted blocks were verified


def test_score_equals_the_whole_model(models, service, stub):
    target = models[0]
    contexts, trees, rows = SCORE_CONTEXTS, SCORE_TREES, SCORE_ROWS
    request = verifier_pb2.ScoreRequest(sequences=[
        verifier_pb2.ScoreSequence(context=c, tree=tree_to_proto(t), context_rows=r)
        for c, t, r in zip(contexts, trees, rows)])
    for _ in range(2):  # a second request: the first one's temporary caches were released
        response = stub.Score(request, timeout=60)
        want = LocalScorer(target).score(contexts, trees, rows)
        for result, expected in zip(response.results, want, strict=True):
            torch.testing.assert_close(tensor_from_proto(result.probs), expected, atol=1e-5, rtol=0)


def test_sigterm_drains_rank_0_then_stops_the_followers(service, stub):
    _, _, verifier, log = service
    assert len(generate(stub, [9, 10, 11], 3)) == 3
    verifier.send_signal(signal.SIGTERM)  # as Kubernetes stops the pod: torchrun forwards it to every rank
    verifier.wait(40)
    text = log.read_text()
    assert "[default0]" in text and "draining" in text
    assert "rank 1: stop op after" in text  # the follower left on rank 0's stop op, not on the signal
    ranks_said = [line for line in text.splitlines() if line.startswith("[default")]
    assert not [line for line in ranks_said if "Traceback" in line or "Error" in line]


def test_tensor_parallel_without_torchrun_says_how_to_launch(models):
    done = subprocess.run([sys.executable, "-m", "services.verifier", "--tensor-parallel", "2",
                           "--model", str(models[1]), "--http-port", "-1"],
                          check=False, capture_output=True, text=True, env=environment(), timeout=120)
    assert done.returncode != 0
    assert "torchrun --nproc-per-node 2 -m services.verifier --tensor-parallel 2" in done.stderr
    assert "WORLD_SIZE is not set" in done.stderr
