"""What the services add to the passes, measured through real processes: `specd bench profile`'s
serving part (on unless ``--no-services``).

The services register this module as the `specd bench profile` command (entry-point group
``specd.commands``, `specd.cli`): `run` composes the in-process part (`specd.bench.profile.measure`,
the same flags) with this calibration (`measure_services`). The library never imports it; with
no services installed, `specd bench profile` is the in-process part alone.

A pass measured in one process is not what a deployment pays for it. The simulator's profile
therefore also holds two measurements made through the same processes `specd bench serve`
starts (`services.up.Stack`, the machine split the same way: `services.load.deployment_stack`):

- **Drafter round trips.** One drafter replica; this process plays the verifier with the
  verifier's own client (`services.verifier.drafter_pool.RemoteDrafters`), pinned off the
  replica's core. The Draft and Speculate tables are then timed exactly as in-process
  (`specd.bench.profile.measure_drafter`) but each point is a whole round trip: the request's
  serialisation, loopback gRPC, the replica's handling and its packed pass, the answer's parsing.
  ``rpc_seconds`` is then only the network a deployment adds beyond loopback (``--rpc-ms``).
- **Verifier serving.** A plain verifier (no drafters) driven over its OpenAI HTTP API by closed
  loops of C streaming clients, as `specd bench serve` drives it. Per level, from the verifier's
  own metrics: target passes, mean rows per pass, mean seconds of a target pass, and mean seconds
  of a step outside its target pass (admission, sampling, streaming every delta to its client —
  in the same process, on the same core, as the passes). The simulator reads the latter as the
  step overhead by rows, and the ratio of the in-service pass to the in-process table as the
  pass's in-service cost (`specd.plan.profile.Serving`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from services.client import metrics
from services.common.config import ServiceConfig
from services.load import clients_off_verifier_cores, deployment_stack, off_cores, run_level, sender
from services.up import Stack, StackConfig, stack_ports
from services.verifier.drafter_pool import RemoteDrafters
from specd.bench import profile as bench_profile
from specd.bench.profile import ProfileSettings, add_scales, measure_drafter, median_rounds
from specd.plan.profile import CostTable, Profile, ServiceCosts, Serving, parse_profile
from specd.plan.sim import Lengths

VERIFIER_LEVELS = (1, 4, 16, 64)
QUICK_LEVELS = (1, 16)
"""The verifier's concurrency levels with ``--quick``."""

add_arguments = bench_profile.add_arguments  # the same flags as the in-process part's


def run(args: argparse.Namespace) -> int:
    """`specd bench profile`: the in-process part, then (unless ``--no-services``) the services'."""
    measured = bench_profile.measure(args, services=not args.no_services)
    if not args.no_services:
        measure_services(measured.profile, measured.settings, str(measured.target_dir), str(measured.drafter_dir),
                         measured.drafter, measured.pool, levels=QUICK_LEVELS if args.quick else VERIFIER_LEVELS)
    return bench_profile.write(measured.profile, args)


def measure_drafter_service(drafter_dir: str, model: torch.nn.Module, settings: ProfileSettings, *,
                            pin: bool = True, progress: tqdm | None = None) -> tuple[CostTable, CostTable, list[dict]]:
    """The Draft and Speculate tables through one drafter replica (module docstring)."""
    config = StackConfig(target="", drafter=drafter_dir, drafters=1, verifiers=0, trainer=False, pin=pin,
                         drafter_args=["--max-num-seqs", str(max(settings.batches))], **stack_ports())
    with Stack(config) as stack, off_cores({s.core for s in stack.drafters}):
        pool = RemoteDrafters([stack.drafters[0].grpc], ServiceConfig(), timeout=60.0)
        try:
            return measure_drafter(
                model, settings.batches, block_size=settings.block_size,
                speculate_blocks=(settings.block_size, *settings.extra_blocks), budgets=settings.budgets,
                tails=settings.tails, context=settings.context, repeats=settings.repeats, progress=progress,
                make_drafter=lambda batch: pool)
        finally:
            pool.close()


def measure_verifier_serving(target_dir: str, pool: list[list[int]], *, levels: tuple[int, ...] = VERIFIER_LEVELS,
                             max_tokens: int = 64, max_num_seqs: int = 64, pin: bool = True,
                             progress: tqdm | None = None, drafter_dir: str = "", mode: str = "async") -> dict:
    """Per concurrency level: rows, pass and outside-the-pass seconds of a verifier serving HTTP
    streams of the prompts in ``pool`` (module docstring): plain, or with ``drafter_dir``
    speculating (``mode``) with one drafter replica — then the time outside the pass leaves out
    its blocking drafter calls too (the simulator times those from the drafter tables, scaled by
    the mean wait for one, ``draft_seconds``, over its own)."""
    config = deployment_stack(target_dir, drafter_dir, drafters=1 if drafter_dir else 0, mode=mode, pin=pin,
                              max_num_seqs=max_num_seqs, **stack_ports())
    out: dict[str, list] = {"concurrency": [], "requests": [], "rows": [], "passes": [], "target_seconds": [],
                            "overhead_seconds": [], "tokens_per_s": [], "trace": []}
    if drafter_dir:
        out["tokens_per_row"] = []  # 1 + the mean verified block: the pass's shape
        out["draft_seconds"] = []  # the mean wait for one blocking Draft call
    with Stack(config) as stack, clients_off_verifier_cores(stack):
        base = stack.verifiers[0].http
        send = sender("http", stack, Path(target_dir).name)
        if drafter_dir:
            stack.wait_drafting()
        run_level(send, pool, 1, 2, 8)  # warm up: first passes allocate
        for concurrency in levels:
            if progress is not None:
                progress.set_postfix_str(f"verifier serving c={concurrency}")
            requests = max(4 * concurrency, 16)  # as `specd bench serve` sends them
            before = metrics(base)
            results, seconds, errors = run_level(send, pool, concurrency, requests, max_tokens)
            after = metrics(base)
            if errors:
                raise RuntimeError(f"the verifier failed {len(errors)} requests at concurrency {concurrency}: {errors[0]}")
            delta = {name: after[name] - before.get(name, 0.0) for name in after}
            passes = delta["specd:num_target_passes_total"]
            target = delta["specd:engine_seconds_total{part=target}"]
            step = delta["specd:engine_seconds_total{part=step}"]
            blocking = delta.get("specd:engine_seconds_total{part=drafter_blocking}", 0.0)
            out["concurrency"].append(concurrency)
            out["requests"].append(len(results))
            out["passes"].append(int(passes))
            # Every running row counts one sequence pass (drafted block or plain step); plain
            # decoding commits one token per running row per pass.
            counted = delta.get("specd:num_sequence_passes_total", 0.0) if drafter_dir else 0.0
            out["rows"].append((counted or delta["specd:spec_decode_num_emitted_tokens_total"]) / passes)
            out["target_seconds"].append(target / passes)
            out["overhead_seconds"].append((step - target - blocking) / passes)
            if drafter_dir:
                drafted = delta.get("specd:spec_decode_num_draft_tokens_total", 0.0)
                out["tokens_per_row"].append(1.0 + drafted / counted if counted else 1.0)
                calls = delta.get("specd:num_drafter_blocking_calls_total", 0.0)
                out["draft_seconds"].append(blocking / calls if calls else 0.0)
            out["tokens_per_s"].append(sum(r.completion_tokens for r in results) / seconds)
            out["trace"].append([[r.prompt_tokens, r.completion_tokens, r.prompt_index] for r in results])
            if progress is not None:
                progress.update()
    return out


def measure_services(profile: Profile, settings: ProfileSettings, target_dir: str, drafter_dir: str,
                     drafter_model: torch.nn.Module, prompts: list[list[int]], *, levels: tuple[int, ...]) -> None:
    """Add what the services cost beyond the passes (module docstring) to ``profile``: the
    drafter tables become round trips through a replica (the bare passes stay as ``drafter_pass``
    and ``speculate_pass``), and ``serving.verifier`` gets a plain verifier's step overhead and
    in-service pass cost by rows. The pass's in-service cost is a ratio: the measured mean pass
    over the simulator's mean pass for the same level (the same requests replayed in the same
    order by the same closed loop). ``serving.speculative`` is the same verifier speculating
    (async, one drafter replica): its step time outside the pass and its blocking drafter calls,
    and its pass over the simulated pass with the block fixed at the measured mean, and its
    blocking Draft wait over the simulated one (`add_scales`); ``serving.speculative_sync`` the
    same drafting synchronously — its step waits for a Draft round trip before every pass, and
    its ratios differ from async's, so sync deployments get their own. With ``settings.rounds``
    the three run round robin, each round starting its services afresh."""
    points = len(settings.batches) * (len(settings.tails) + len(settings.budgets) * (1 + len(settings.extra_blocks)))
    modes = ("plain", "async", "sync")
    with tqdm(total=points + len(modes) * settings.rounds * len(levels), desc="bench profile: services",
              unit="point") as progress:
        draft_table, speculate_table, _ = measure_drafter_service(drafter_dir, drafter_model, settings, progress=progress)
        rounds: dict[str, list[dict]] = {mode: [] for mode in modes}
        for _ in range(settings.rounds):
            for mode in modes:  # round robin: a slow minute lands on one round of each mode
                rounds[mode].append(measure_verifier_serving(
                    target_dir, prompts, levels=levels, max_tokens=settings.max_tokens, progress=progress,
                    # plain: no drafter (the mode then means nothing; the default stands in)
                    drafter_dir="" if mode == "plain" else drafter_dir, mode="async" if mode == "plain" else mode))
    verifier, speculating, synchronous = (median_rounds(rounds[mode]) for mode in modes)
    profile.drafter_pass = CostTable(**profile.drafter.to_json())
    profile.speculate_pass = CostTable(**profile.speculate_table.to_json())
    profile.drafter = profile.drafter.with_seconds(draft_table.seconds)
    profile.speculate = profile.speculate_table.with_seconds(speculate_table.seconds)
    bare = parse_profile(profile.to_json(), source="the measured profile")
    prompt_lengths = Lengths.parse(profile.workload.prompt_tokens)
    outputs = Lengths.parse([min(n, settings.max_tokens) for n in profile.workload.output_tokens])
    add_scales(bare, verifier, prompt_lengths, outputs)
    add_scales(bare, speculating, prompt_lengths, outputs, mode="async")
    add_scales(bare, synchronous, prompt_lengths, outputs, mode="sync")

    def by_rows(columns: dict) -> dict:
        order = sorted(range(len(columns["rows"])), key=columns["rows"].__getitem__)
        keep = [i for n, i in enumerate(order) if n == 0 or columns["rows"][i] > columns["rows"][order[n - 1]]]
        return {k: [v[i] for i in keep] for k, v in columns.items()}

    profile.serving = ServiceCosts(drafter_round_trips=True, verifier=Serving(**by_rows(verifier)),
                                   speculative=Serving(**by_rows(speculating)),
                                   speculative_sync=Serving(**by_rows(synchronous)))
    profile.notes += ("; drafter tables: round trips through a drafter replica from another process (loopback "
                      "gRPC included); serving.verifier: a plain verifier service under closed-loop HTTP load; "
                      "serving.speculative: the same verifier speculating (async) with one drafter replica; "
                      "serving.speculative_sync: the same, drafting synchronously")
