"""What a D3D draft costs in process against through the drafter service, on the same trace.

Through the services a sync step waits for a Draft round trip; `specd bench serve` measured it at
18-21 ms of the replica's time (its ``server_seconds``) where the same drafter drafted in 4-8 ms in
process. This script replays one trace both ways, as a sync verifier steps: a draft, then a
verification, then the next draft.

- The trace: held-out greedy answers of the target (the zoo's ``responses-<target>``), decoded as a
  speculative decode would: draft a block for the context, accept the drafted tokens that match
  the answer, append them and the answer's next token, draft again. ``--synthetic``: random
  prompts growing a token a step (for costs only, where the answers are not built).
- The verification: a stand-in for the target's pass of block + 1 tokens, every linear product of
  the target in order (what makes a decode pass memory-bound: its weights, and hundreds of small
  parallel regions), on this process's threads.
- ``in process``: `D3DDrafter.draft` on this thread. ``service``: the same calls through the
  verifier's own client (`services.verifier.drafter_pool.RemoteDrafters`) to a drafter service
  started here as `specd up` starts one (`services.up.Stack`), each call split into the pass (the replica's
  ``specd:drafter_pass_seconds``), the rest of the replica's handling, the transport (the pool's
  ``transport_seconds``: the RPC less the replica's time) and the pool's own work.

Both ways get ``--threads`` intra-op threads and the environment this script runs in (set
``GOMP_SPINCOUNT`` to see what `specd.threads.shared_machine_env` changes). The blocks must be
equal both ways (greedy, same weights, same dtype): the script checks it. It prints a table and
writes JSON.

    .venv/bin/python bench/draft_rpc.py [--drafter d3d-smollm2-135m] [--block 4] [--answers 8]
        [--threads 2] [--synthetic] [--json out/bench/draft_rpc.json]

Run it alone: it times passes on a machine whose cores it assumes are idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from services.client import metrics
from services.common.config import ServiceConfig
from services.up import Stack, StackConfig, stack_ports
from services.verifier.drafter_pool import RemoteDrafters
from specd import precision, zoo
from specd.bench.recipe import split
from specd.drafters.base import DraftRequest
from specd.drafters.d3d import D3DDrafter
from specd.models.loading import load_model
from specd.ports import free_port
from specd.sampling import SamplingParams
from specd.train.drafter import read_sequences

GREEDY = SamplingParams(temperature=0.0)


def trace(sequences: list[list[int]], prompt_lens: list[int], drafter: D3DDrafter, block: int, max_steps: int):
    """The contexts a speculative decode of each answer drafts for (greedy acceptance against the
    answer itself), found with the in-process drafter."""
    contexts: list[tuple[int, list[int]]] = []
    for seq_id, (ids, prompt_len) in enumerate(zip(sequences, prompt_lens)):
        length = prompt_len
        for _ in range(max_steps):
            if length + block + 1 > len(ids):
                break
            context = ids[:length]
            contexts.append((seq_id, context))
            drafted = drafter.draft([DraftRequest(seq_id=seq_id, context=context, block_size=block, params=GREEDY)])
            accepted = 0
            for token, truth in zip(drafted[0].tokens, ids[length:]):
                if token != truth:
                    break
                accepted += 1
            length += accepted + 1
        drafter.release(seq_id)
    return contexts


def verify_pass(target: torch.nn.Module, rows: int):
    """A stand-in for the target's verification pass of ``rows`` tokens: every linear product of
    the target's layers and its head on ``rows`` rows, in order (what makes a decode pass
    memory-bound, and its hundreds of small parallel regions), without attention or a cache."""
    weights = [m.weight for m in target.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def run() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    return run


def replay(drafter, contexts, block: int, verify=None) -> tuple[list[float], list[float], list[list[int]]]:
    """Each context's draft in turn (a sync step: draft, then verify); seconds of each draft and of
    each verification stand-in, and the blocks."""
    seconds, verify_seconds, blocks = [], [], []
    last_seq = None
    for seq_id, context in contexts:
        if last_seq is not None and seq_id != last_seq:
            drafter.release(last_seq)
        last_seq = seq_id
        start = time.perf_counter()
        drafted = drafter.draft([DraftRequest(seq_id=seq_id, context=context, block_size=block, params=GREEDY)])
        seconds.append(time.perf_counter() - start)
        blocks.append(list(drafted[0].tokens))
        if verify is not None:
            start = time.perf_counter()
            verify()
            verify_seconds.append(time.perf_counter() - start)
    if last_seq is not None:
        drafter.release(last_seq)
    return seconds, verify_seconds, blocks


def summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {"mean_ms": statistics.fmean(ms), "p50_ms": ms[len(ms) // 2], "p90_ms": ms[int(len(ms) * 0.9)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="d3d-smollm2-135m", help="the zoo's drafter, or a drafter directory")
    parser.add_argument("--target", default="smollm2-135m", help="whose answers make the trace and whose pass is verified")
    parser.add_argument("--block", type=int, default=4, help="tokens drafted per call")
    parser.add_argument("--answers", type=int, default=8, help="held-out answers replayed")
    parser.add_argument("--steps", type=int, default=40, help="at most this many drafts per answer")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads, both ways")
    parser.add_argument("--no-verify", action="store_true", help="drafts only, no verification stand-in between them")
    parser.add_argument("--synthetic", action="store_true",
                        help="random 160-token prompts growing a token a step instead of the target's answers "
                             "(costs only: for a drafter whose answers are not built)")
    parser.add_argument("--json", default="out/bench/draft_rpc.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if Path(args.drafter).is_dir():
        model_dir = Path(args.drafter)
    else:
        zoo.build(only=args.drafter)
        model_dir = zoo.zoo_dir() / args.drafter
    if args.synthetic:
        generator = torch.Generator().manual_seed(0)
        sequences = [torch.randint(100, 8000, (160 + args.steps + args.block + 1,), generator=generator).tolist()
                     for _ in range(args.answers)]
        prompt_lens, chosen = [160] * args.answers, list(range(args.answers))
    else:
        zoo.build(only=f"responses-{args.target}")
        sequences, prompt_lens = read_sequences(zoo.zoo_dir() / f"responses-{args.target}" / "sequences.jsonl")
        chosen = split(len(sequences))[1][: args.answers]
    dtype = precision.resolve_drafter_dtype("auto", torch.device("cpu"))
    local = D3DDrafter(load_model(model_dir, dtype=dtype))
    verify = None if args.no_verify else verify_pass(load_model(zoo.model_path(args.target)), args.block + 1)
    spin = os.environ.get("GOMP_SPINCOUNT", "libgomp's default")
    with torch.inference_mode():
        contexts = trace([sequences[i] for i in chosen], [prompt_lens[i] for i in chosen], local, args.block, args.steps)
        print(f"[draft_rpc] {len(contexts)} drafts over {len(chosen)} held-out answers, block {args.block}, "
              f"{args.threads} threads, drafter in {dtype}, GOMP_SPINCOUNT {spin}", flush=True)
        replay(local, contexts[:20], args.block, verify)  # warm-up
        local_seconds, local_verify, local_blocks = replay(local, contexts, args.block, verify)

        # One drafter replica as `specd up` starts it; it inherits this environment.
        metrics_url = f"http://127.0.0.1:{free_port()}"
        config = StackConfig(target="", drafter=str(model_dir), drafters=1, verifiers=0, trainer=False,
                             drafter_args=["--threads", str(args.threads), "--metrics-port", metrics_url.rsplit(":", 1)[1]],
                             **stack_ports())
        with Stack(config) as stack:
            remote = RemoteDrafters([stack.drafters[0].grpc], ServiceConfig())
            replay(remote, contexts[:20], args.block, verify)  # warm-up
            passes_before = metrics(metrics_url)["specd:drafter_pass_seconds_sum"]
            server_before, transport_before = remote.stats.server_seconds, remote.stats.transport_seconds
            remote_seconds, remote_verify, remote_blocks = replay(remote, contexts, args.block, verify)
            pass_seconds = metrics(metrics_url)["specd:drafter_pass_seconds_sum"] - passes_before
            server_seconds = remote.stats.server_seconds - server_before
            transport_seconds = remote.stats.transport_seconds - transport_before
            remote.close()

    calls = len(contexts)
    mismatched = sum(a != b for a, b in zip(local_blocks, remote_blocks))
    rows = {"in process": {"draft": summary(local_seconds)}, "service": {"draft": summary(remote_seconds)}}
    if verify is not None:
        rows["in process"]["verify"] = summary(local_verify)
        rows["service"]["verify"] = summary(remote_verify)
    service_split = {
        "pass_ms": pass_seconds / calls * 1000,
        "server_rest_ms": (server_seconds - pass_seconds) / calls * 1000,
        "transport_ms": transport_seconds / calls * 1000,
        "client_ms": (sum(remote_seconds) - server_seconds - transport_seconds) / calls * 1000,
    }
    print("| way | draft mean ms | draft p50 ms | verify stand-in mean ms |\n| --- | --- | --- | --- |")
    for way, row in rows.items():
        verify_ms = f"{row['verify']['mean_ms']:.2f}" if "verify" in row else ""
        print(f"| {way} | {row['draft']['mean_ms']:.2f} | {row['draft']['p50_ms']:.2f} | {verify_ms} |")
    print("a service draft, per call: " + ", ".join(f"{k} {v:.2f}" for k, v in service_split.items()))
    print(f"blocks that differ between the two ways: {mismatched} of {calls}")
    Path(args.json).write_text(json.dumps({
        "drafter": Path(args.drafter).name, "block": args.block, "threads": args.threads, "dtype": str(dtype),
        "gomp_spincount": spin, "calls": calls, "cpu": torch.backends.cpu.get_cpu_capability(), "rows": rows,
        "service_split": service_split, "mismatched_blocks": mismatched,
    }, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 1 if mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
