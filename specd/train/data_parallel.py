"""Data-parallel SpecOPD: the drafter sharded with FSDP2 over ranks, one global batch per step.

Run under ``torchrun --nproc-per-node N python -m specd.train.data_parallel ...`` (NCCL on GPUs,
gloo on CPUs). Design choices:

- **FSDP2** (``torch.distributed.fsdp.fully_shard``) on each decoder layer, on ``lm_head`` and
  ``ar_head`` (SpecOPD calls them outside the drafter's pass, so they need their own hooks), then
  on the root, whose hooks are put on ``hidden_states`` (`register_fsdp_forward_method`): SpecOPD
  never calls ``forward``. Parameters are DTensors sharded on dim 0 of a 1-D mesh.
- **Randomness belongs to the trajectory**, not the process: item j of step s (its index in the
  global batch) draws its anchors and branches from streams seeded with (seed, s, j). Rank r
  takes items r, r + W, r + 2W, ...; the loss curve is then that of one rank with the same global
  batch, whatever W is (`tests/integration/test_data_parallel.py`).
- **Exactly two FSDP passes per rank per step** (one no-grad pass giving q to sample from, one
  training pass), whatever the rank holds: its items are packed into one pass (per-item draws
  from the one q), and a rank with nothing usable runs a dummy pass. FSDP all-gathers in every
  pass, so ranks running different numbers of passes (one per item when ``B % W != 0``, or a
  skipped item) would hang. The branch sampler is therefore ours (`draft_logits` under no_grad,
  the training form of `sample_branches`' pass) rather than `SpecOPDTrainer.supervise` per item.
- **Scoring where the target is**: offline, every rank holds a copy of the target and scores its
  own trees. When only rank 0 can score (the trainer service: verifiers' ``Score`` or one local
  target), `GatheredScorer` makes scoring one collective per step: rank 0 scores the trees of all
  ranks in one call and sends each rank its rows; a scorer failure aborts the step on every rank
  before training, so the step can be retried whole.
- **The global mean, not a mean of means**: every loss in `specd.train.losses` is a mean over a
  count (E2E-TV: branches with a valid position; KL/TV: valid positions). Each rank scales its
  local mean by local count / global count (counts all-reduced first), so the rank terms sum to
  the global-batch loss; gradients are then SUMMED over ranks (`set_gradient_divide_factor(1)`,
  where FSDP's default divides by W), so they equal the one-rank gradient. Only SUM is used in
  collectives (`set_force_sum_reduction_for_comms`): gloo has neither AVG nor PREMUL_SUM.
  Adam is nearly blind to a global gradient scale (and clipping hides it further), so the test
  compares gradients, where dividing by W shows at once.
- **Gradient clipping** is `torch.nn.utils.clip_grad_norm_` over the DTensor gradients: it
  computes the global norm across shards (checked against one rank in the test).
- **Checkpoints** are DCP (`torch.distributed.checkpoint`): model + optimizer through
  `get_state_dict` / `set_state_dict`, so a checkpoint written at W ranks loads at any other
  number (DCP reshards), plus ``trainer.json`` from rank 0 (step, data cursor, config, losses).
  No RNG state is needed: streams are re-derived from (seed, step, item). A directory is written
  as ``.partial`` and renamed, so a kill mid-write leaves the previous checkpoint.
  `export_drafter` gathers the full weights on rank 0 and writes the usual safetensors model
  (`specd.models.loading.save_model`) that the serving side loads.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shutil
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from specd.data.tokenizer import load_tokenizer
from specd.models.d3d import D3DModel
from specd.models.loading import load_model, save_model
from specd.train.losses import LOSSES, acceptance_probs, distillation_loss, expected_accepted_length, hybrid_weight
from specd.train.opd import TrajectorySource, open_source, recover_checkpoint, swap_in
from specd.train.specopd import (
    SpecOPDConfig,
    StepResult,
    Supervision,
    Trajectory,
    TreeScorer,
    as_scorer,
    choose_anchors,
    draft_logits,
    score_branches,
    screen,
    stop_mask,
)
from specd.tree import TokenTree

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer.json"


# ---------------------------------------------------------------------------- process group and sharding
@dataclass(kw_only=True, slots=True)
class Ranks:
    """This process's place in the job."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str | None = None) -> Ranks:
    """The process group from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    LOCAL_RANK): NCCL on the GPU LOCAL_RANK, gloo on the CPU. Without them: one process alone.

    ``device_type`` ("cuda" or "cpu") overrides the choice (default: cuda when there is one); an
    existing process group is kept, and its backend says the device.
    """
    if dist.is_initialized():
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    elif device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:
            missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise RuntimeError(f"WORLD_SIZE is set but {', '.join(missing)} not: launch with torchrun")
            dist.init_process_group(backend)
        else:  # a plain `python -m`: a job of one, no rendezvous needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return Ranks(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, mesh=mesh)


def shard_drafter(drafter: D3DModel, mesh: DeviceMesh, *, sum_gradients: bool = True) -> D3DModel:
    """Shard ``drafter`` in place with FSDP2 (see the module docstring); returns it.

    ``sum_gradients=False`` keeps FSDP's default of averaging gradients over ranks, which with
    `DataParallelSpecOPD`'s globally normalised loss gives 1/W of the one-rank gradient: kept only
    so that the test can show that it differs.
    """
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(drafter.lm_head, mesh=mesh)
    if drafter.ar_head is not drafter.lm_head:  # tied heads are one module, sharded once
        fully_shard(drafter.ar_head, mesh=mesh)
    fully_shard(drafter, mesh=mesh)
    register_fsdp_forward_method(drafter, "hidden_states")
    for module in drafter.modules():
        if isinstance(module, FSDPModule):  # the setters act on each module's own group only
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0 if sum_gradients else float(mesh.size()))
    return drafter


def gather_drafter(drafter: D3DModel, ranks: Ranks) -> D3DModel | None:
    """The full weights as a plain (unsharded) drafter on rank 0's CPU, None on the others (collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(drafter, options=options)  # every rank takes part; rank 0 gets tensors
    if not ranks.is_main:
        return None
    with torch.device("meta"):  # no second random initialisation: the gathered tensors are assigned
        plain = D3DModel(drafter.config)
    plain.load_state_dict(state, assign=True)
    return plain.eval()


def export_drafter(drafter: D3DModel, directory: str | Path, ranks: Ranks) -> None:
    """Gather the full weights on rank 0 and write them as a usual model directory (collective)."""
    plain = gather_drafter(drafter, ranks)
    if plain is not None:
        save_model(plain, directory)
    dist.barrier()


# ---------------------------------------------------------------------------- scoring on rank 0 only
class ScoringAborted(RuntimeError):
    """Rank 0's scorer failed on this step's trees; every rank leaves the step before training.

    On rank 0, ``error`` is the scorer's own exception (the caller decides: retry, drop the
    batch); on the others it is None and the message says what rank 0 saw.
    """

    def __init__(self, message: str, error: Exception | None = None) -> None:
        super().__init__(message)
        self.error = error


class GatheredScorer:
    """A `TreeScorer` for ranks of which only rank 0 can score (the verifiers' client, or the one
    copy of a target): every rank calls `score` ONCE per step with its own trees (none when it
    holds nothing usable: `DataParallelSpecOPD.supervise` still calls it), rank 0 scores the trees
    of all ranks in one call of ``scorer`` and sends each rank its rows (`dist.send`, fp32).

    Collective, so every rank must call it at the same point; when rank 0's scorer raises, every
    rank raises `ScoringAborted` there, before any training collective, and the step can be
    retried whole (its item seeds do not move until a step completes).
    """

    def __init__(self, scorer: TreeScorer | None, ranks: Ranks, *, vocab_size: int,
                 stop_token_ids: Sequence[int]) -> None:
        if (scorer is not None) != ranks.is_main:
            raise ValueError("rank 0, and only rank 0, holds the scorer of a GatheredScorer")
        self.scorer, self.ranks = scorer, ranks
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)

    def score(self, contexts: list[list[int]], trees: list[TokenTree], context_rows: list[list[int]]) -> list[Tensor]:
        requests: list[tuple | None] = [None] * self.ranks.world_size
        dist.all_gather_object(requests, (contexts, trees, context_rows))  # token ids only: small
        if not self.ranks.is_main:
            failure = [None]
            dist.broadcast_object_list(failure, src=0)
            if failure[0] is not None:
                raise ScoringAborted(f"rank 0 could not score this step: {failure[0]}")
            if not contexts:
                return []
            num_rows = [len(rows) + tree.num_nodes for rows, tree in zip(context_rows, trees)]
            probs = torch.empty(sum(num_rows), self.vocab_size, device=self.ranks.device)
            dist.recv(probs, src=0)
            return list(probs.split(num_rows))
        everything = [[item for request in requests for item in request[part]] for part in range(3)]
        try:
            probs = self.scorer.score(*everything) if everything[0] else []
        except Exception as error:  # told to every rank, then raised here for the caller to judge
            dist.broadcast_object_list([f"{type(error).__name__}: {error}"], src=0)
            raise ScoringAborted(f"the scorer failed: {error}", error) from error
        dist.broadcast_object_list([None], src=0)
        start = 0
        for rank, request in enumerate(requests):  # sequences in rank order, as gathered
            mine = probs[start : start + len(request[0])]
            start += len(request[0])
            if rank == 0:
                own = mine
            elif mine:
                dist.send(torch.cat(mine).to(self.ranks.device, torch.float32).contiguous(), dst=rank)
        return own


# ---------------------------------------------------------------------------- the trainer
def item_streams(seed: int, step: int, index: int, device: torch.device) -> tuple[np.random.Generator, torch.Generator]:
    """The anchor rng and branch generator of global item ``index`` at ``step``."""
    sequence = np.random.SeedSequence([seed, step, index])
    anchor_seed, branch_seed = sequence.generate_state(2, np.uint64)
    generator = torch.Generator(device=device).manual_seed(int(branch_seed) >> 1)
    return np.random.default_rng(int(anchor_seed)), generator


@dataclass(kw_only=True, slots=True)
class Counts:
    """Sizes of one step's supervision; the loss is a mean over one of them."""

    branches: int = 0
    """Branches sampled (the expected accepted length is a mean over them)."""
    used_branches: int = 0
    """Branches with at least one valid position (E2E-TV's denominator)."""
    positions: int = 0
    """Valid positions (KL's and TV's denominator); also the supervised tokens."""

    @classmethod
    def of(cls, supervision: Supervision | None) -> Counts:
        if supervision is None:
            return cls()
        lengths = supervision.valid.sum(-1)  # [num_branches]
        return cls(branches=int(lengths.numel()), used_branches=int((lengths > 0).sum()), positions=int(lengths.sum()))

    def denominator(self, loss: str) -> int:
        return self.used_branches if loss == "e2e-tv" else self.positions


class DataParallelSpecOPD:
    """SpecOPD on a global batch split over ranks; `step` equals one rank's step on the whole batch.

    ``drafter`` must already be sharded (`shard_drafter`). ``target`` is a target module (wrapped
    in `LocalScorer`, one copy per rank) or any `TreeScorer`, e.g. verifiers' ``Score``.
    """

    def __init__(self, target: nn.Module | TreeScorer, drafter: D3DModel, config: SpecOPDConfig, ranks: Ranks) -> None:
        self.scorer = as_scorer(target)
        if drafter.config.vocab_size != self.scorer.vocab_size:
            raise ValueError(f"the drafter's vocabulary ({drafter.config.vocab_size}) differs from the target's "
                             f"({self.scorer.vocab_size}): they must share one tokenizer")
        drafter.config.group_size_for(config.block_size)  # raises when the block cannot be drafted
        self.drafter, self.config, self.ranks = drafter, config, ranks
        # Built on the sharded parameters: each rank keeps the Adam moments of its shards only.
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=config.weight_decay)
        self.num_steps = 0
        self.num_supervised_tokens = 0
        self.skipped: Counter = Counter()

    # -- supervision: this rank's items, one sampling pass
    def supervise(self, batch: Sequence[Trajectory]) -> tuple[Supervision | None, Counter]:
        """This rank's share of the global ``batch`` (items rank, rank + W, ...) and its skips."""
        config, ranks = self.config, self.ranks
        device = self.ranks.device
        kept, anchors, streams, skipped = [], [], [], Counter()
        for index in range(ranks.rank, len(batch), ranks.world_size):
            good, bad = screen([batch[index]], self.scorer.vocab_size, config.max_context, config.block_size)
            skipped.update(bad)
            if not good:
                continue
            rng, generator = item_streams(config.seed, self.num_steps, index, device)
            # Never empty after `screen`: a kept trajectory has room for an anchor.
            anchors.append(choose_anchors(good[0], config.anchors_per_seq, config.block_size, config.max_context, rng))
            kept.append(good[0])
            streams.append(generator)
        prefixes = [t.tokens[: max(row)] for t, row in zip(kept, anchors)]
        self.drafter.eval()
        with torch.no_grad():
            q = self._logits(prefixes, anchors).float().softmax(-1)  # [num_groups, block, vocab]
        if not kept:
            if isinstance(self.scorer, GatheredScorer):  # collective: an idle rank still joins
                self.scorer.score([], [], [])
            return None, skipped
        num_branches, block = config.branches_per_anchor, config.block_size
        branches, start = [], 0
        for row, generator in zip(anchors, streams):
            mine = q[start : start + len(row)].flatten(0, 1)  # [groups * block, vocab]
            draws = torch.multinomial(mine, num_branches, replacement=True, generator=generator)
            branches.append(draws.view(len(row), block, num_branches).transpose(1, 2))
            start += len(row)
        branches = torch.cat(branches)  # [num_groups, K, block]
        target_probs = score_branches(self.scorer, prefixes, anchors, branches.cpu())
        tokens = branches.flatten(0, 1)  # [num_groups * K, block]
        return Supervision(
            prefixes=prefixes, anchors=anchors, group=torch.arange(branches.shape[0]).repeat_interleave(num_branches),
            tokens=tokens, target_probs=target_probs, valid=stop_mask(tokens, self.scorer.stop_token_ids),
        ), skipped

    def _logits(self, prefixes: list[list[int]], anchors: list[list[int]]) -> Tensor:
        """The drafter's block logits ``[num_groups, block, vocab]``; an idle rank runs a one-token
        dummy so that it joins FSDP's collectives (its result is never read)."""
        if not prefixes:
            prefixes, anchors = [[self.drafter.config.mask_token_id]], [[1]]
        return draft_logits(self.drafter, prefixes, anchors, self.config.block_size)

    # -- the step
    def local_loss(self, supervision: Supervision | None, local: Counts, total: Counts) -> tuple[Tensor, Tensor]:
        """(this rank's share of the global loss, its sum of expected accepted lengths).

        The shares of all ranks sum to the loss of the whole batch on one rank: a local mean over
        n_local items times n_local / n_total (see the module docstring).
        """
        config = self.config
        logits = self._logits(supervision.prefixes if supervision else [], supervision.anchors if supervision else [])
        if supervision is None:
            zero = logits.sum() * 0.0  # gradients (zeros) reach every shard: FSDP reduce-scatters all
            return zero, zero.detach()
        logits = logits[supervision.group.to(logits.device)].float()  # [num_branches, block, vocab]
        target_probs = supervision.target_probs.to(logits.device)
        valid = supervision.valid.to(logits.device)
        if config.loss == "hybrid":  # (1 - w) KL + w E2E-TV: two means over different counts
            weight = hybrid_weight(self.num_steps, config.warmup_steps)
            terms = [(name, w) for name, w in (("kl", 1.0 - weight), ("e2e-tv", weight)) if w > 0.0]
        else:
            terms = [(config.loss, 1.0)]
        loss = logits.sum() * 0.0
        for name, weight in terms:
            if local.denominator(name):
                share = local.denominator(name) / total.denominator(name)
                loss = loss + weight * share * distillation_loss(name, target_probs, logits, valid)
        with torch.no_grad():
            accepted = expected_accepted_length(acceptance_probs(target_probs, logits.detach()), valid).sum()
        return loss, accepted

    def backward(self, batch: Sequence[Trajectory]) -> tuple[StepResult, bool]:
        """Supervise, then the loss and its gradient (summed over ranks) without the update.

        Returns the step's result (global figures, the same on every rank) and whether there was
        anything to learn from; every rank gets the same answer, so all step or none do.
        """
        supervision, skipped = self.supervise(batch)
        local = Counts.of(supervision)
        sizes = torch.tensor([local.branches, local.used_branches, local.positions], device=self.ranks.device)
        dist.all_reduce(sizes)
        total = Counts(branches=int(sizes[0]), used_branches=int(sizes[1]), positions=int(sizes[2]))
        gathered: list[Counter | None] = [None] * self.ranks.world_size
        dist.all_gather_object(gathered, skipped)
        skipped = sum(gathered, Counter())
        self.skipped.update(skipped)
        if total.positions == 0:
            return StepResult(loss=math.nan, num_supervised_tokens=0, num_branches=0, expected_accepted_length=math.nan,
                              skipped=dict(skipped)), False
        self.drafter.train()
        loss, accepted = self.local_loss(supervision, local, total)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        figures = torch.stack([loss.detach(), accepted]).double()
        dist.all_reduce(figures)
        return StepResult(loss=float(figures[0]), num_supervised_tokens=total.positions, num_branches=total.branches,
                          expected_accepted_length=float(figures[1]) / total.branches, skipped=dict(skipped)), True

    def step(self, batch: Sequence[Trajectory]) -> StepResult:
        """One optimizer step on the global ``batch`` (the same list on every rank)."""
        result, learn = self.backward(batch)
        if learn:
            if self.config.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
            self.optimizer.step()
        # A batch with nothing usable still counts as a step, so that item seeds move on.
        self.num_steps += 1
        self.num_supervised_tokens += result.num_supervised_tokens
        return result

    # -- checkpoints
    def save(self, directory: str | Path, data: TrajectorySource, log: dict) -> None:
        """DCP model + optimizer shards and rank 0's ``trainer.json``, swapped in by a rename (collective)."""
        directory = Path(directory)
        partial = directory.with_name(directory.name + ".partial")  # `swap_in`'s name for it
        if self.ranks.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        model_state, optimizer_state = get_state_dict(self.drafter, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(partial / "dcp"))
        if self.ranks.is_main:
            state = {"num_steps": self.num_steps, "num_supervised_tokens": self.num_supervised_tokens,
                     "skipped": dict(self.skipped), "data": data.state(), "config": asdict(self.config),
                     "world_size": self.ranks.world_size, "log": log}
            (partial / TRAINER_STATE).write_text(json.dumps(state, indent=1) + "\n")
            swap_in(partial, directory)
        dist.barrier()

    def read_state(self, directory: str | Path) -> dict:
        """The ``trainer.json`` of a checkpoint `save` wrote; ValueError when its configuration is
        not this trainer's (not collective: a caller may check before asking the others to `load`)."""
        directory = Path(directory)
        state = json.loads((directory / TRAINER_STATE).read_text())
        if state["config"] != json.loads(json.dumps(asdict(self.config))):
            raise ValueError(f"{directory} was written with another configuration ({state['config']}): "
                             "resume with the same options, or train into another --out")
        return state

    def load(self, directory: str | Path, data: TrajectorySource) -> dict:
        """Restore what `save` wrote, at any number of ranks; returns its log (collective)."""
        directory = Path(directory)
        state = self.read_state(directory)
        model_state, optimizer_state = get_state_dict(self.drafter, self.optimizer)
        loaded = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(loaded, checkpoint_id=str(directory / "dcp"))  # in place, resharded to this mesh
        set_state_dict(self.drafter, self.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"])
        self.num_steps = state["num_steps"]
        self.num_supervised_tokens = state["num_supervised_tokens"]
        self.skipped = Counter(state["skipped"])
        data.restore(state["data"])
        return state["log"]


def train(trainer: DataParallelSpecOPD, data: TrajectorySource, *, out: str | Path, steps: int, batch_size: int,
          checkpoint_every: int = 50, progress: bool = True) -> list[float]:
    """Train to ``steps`` steps in all, resuming from ``out/checkpoint``; every step's loss."""
    checkpoint = Path(out) / "checkpoint"
    log: dict = {"losses": []}
    if trainer.ranks.is_main:  # finish a swap a kill interrupted (`specd.train.opd.recover_checkpoint`)
        recover_checkpoint(checkpoint)
    dist.barrier()
    if (checkpoint / TRAINER_STATE).is_file():
        log = trainer.load(checkpoint, data)
        if progress and trainer.ranks.is_main:
            print(f"resuming from step {trainer.num_steps} at {trainer.ranks.world_size} rank(s)", flush=True)
    while trainer.num_steps < steps:
        result = trainer.step(data.next_batch(batch_size))
        log["losses"].append(result.loss)
        if progress and trainer.ranks.is_main:
            print(f"step {trainer.num_steps}/{steps}: loss {result.loss:.5f}, expected accepted length "
                  f"{result.expected_accepted_length:.3f}, {result.num_supervised_tokens} tokens"
                  + (f", skipped {result.skipped}" if result.skipped else ""), flush=True)
        if trainer.num_steps % checkpoint_every == 0 or trainer.num_steps == steps:
            trainer.save(checkpoint, data, log)
    return log["losses"]


# ---------------------------------------------------------------------------- launcher
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = SpecOPDConfig()
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m specd.train.data_parallel",
        description="Data-parallel SpecOPD distillation of a D3D drafter (FSDP2; resumable at any rank count).")
    parser.add_argument("--target", required=True, help="target model directory")
    parser.add_argument("--drafter", required=True, help="starting D3D drafter directory")
    parser.add_argument("--data", required=True, help="JSONL trajectories (see specd.train.opd.parse_line)")
    parser.add_argument("--out", required=True, help="output drafter directory (checkpoints under OUT/work)")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all (resumed runs included)")
    parser.add_argument("--batch-size", type=int, required=True, help="trajectories per step, over all ranks")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--anchors", type=int, default=defaults.anchors_per_seq, help="anchors per trajectory")
    parser.add_argument("--branches", type=int, default=defaults.branches_per_anchor, help="branches per anchor (K)")
    parser.add_argument("--loss", choices=LOSSES, default=defaults.loss)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--grad-clip", type=float, default=defaults.grad_clip, help="global grad-norm clip (0: none)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "checkpoint_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("target", "drafter"):
        if not (Path(getattr(args, name)) / "config.json").is_file():
            parser.error(f"--{name} {getattr(args, name)} is not a model directory (no config.json)")
    if not Path(args.data).is_file():
        parser.error(f"--data {args.data} is not a file")
    return args


def build_trainer(args: argparse.Namespace, ranks: Ranks, *, sum_gradients: bool = True
                  ) -> tuple[DataParallelSpecOPD, TrajectorySource]:
    """The trainer (target on every rank, drafter sharded) and data source that ``args`` name."""
    if args.batch_size < ranks.world_size:
        raise SystemExit(f"--batch-size {args.batch_size} is below the {ranks.world_size} ranks: "
                         "every rank needs a trajectory per step")
    target = load_model(args.target, device=ranks.device)
    drafter = load_model(args.drafter, device=ranks.device)
    if not isinstance(drafter, D3DModel) or drafter.config.target_hidden_size:
        raise SystemExit(f"--drafter {args.drafter} is not a D3D drafter: SpecOPD trains D3D drafters")
    source = open_source(args.data, load_tokenizer(_tokenizer_dir(args)) if _tokenizer_dir(args) else None)
    config = SpecOPDConfig(block_size=args.block_size, anchors_per_seq=args.anchors, branches_per_anchor=args.branches,
                           loss=args.loss, lr=args.lr, grad_clip=args.grad_clip, seed=args.seed,
                           max_context=getattr(target.config, "max_position_embeddings", 4096))
    drafter = shard_drafter(drafter, ranks.mesh, sum_gradients=sum_gradients)
    return DataParallelSpecOPD(target, drafter, config, ranks), source


def _tokenizer_dir(args: argparse.Namespace) -> Path | None:
    return next((Path(d) for d in (args.drafter, args.target) if (Path(d) / "tokenizer.json").is_file()), None)


def exit_job(code: int, *, destroy: bool = True) -> NoReturn:
    """End this rank's process with ``code``: the process group destroyed (``destroy``), logs and
    output flushed, then ``os._exit``, so that nothing is finalized after the group is gone.

    Objects that still hold the group (FSDP's modules, a `Ranks`'s mesh) would otherwise be freed
    at interpreter exit, after ``destroy_process_group``, where gloo's threads abort the process
    ("terminate called without an active exception", SIGABRT): two ranks exchanging a few objects
    and collectives through a mesh, then destroying the group and returning, aborted in 11 of 15
    runs, and 0 of 30 with this. For a service, whose objects are held all over, where dropping
    them all first (as `main` does) is not practical. Call it when nothing is left to do."""
    if destroy and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ranks = init_distributed()
    try:
        trainer, source = build_trainer(args, ranks)
        out = Path(args.out)
        losses = train(trainer, source, out=out / "work", steps=args.steps, batch_size=args.batch_size,
                       checkpoint_every=args.checkpoint_every)
        export_drafter(trainer.drafter, out, ranks)
        if ranks.is_main:
            if (tokenizer_dir := _tokenizer_dir(args)) is not None:
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    if (tokenizer_dir / name).is_file():
                        shutil.copyfile(tokenizer_dir / name, out / name)
            (out / "training.json").write_text(json.dumps(
                {"steps": trainer.num_steps, "world_size": ranks.world_size, "losses": losses,
                 "num_supervised_tokens": trainer.num_supervised_tokens, "skipped": dict(trainer.skipped)}, indent=1))
            print(f"saved the drafter to {out} after {trainer.num_steps} steps", flush=True)
        # Every rank tears gloo down together, and only after the objects that hold the process
        # group (FSDP's modules and mesh, the optimizer) are gone: destroy_process_group drops
        # only c10d's own references, so a group still held by a live object (FSDP modules hold
        # cycles, freed by the collector at interpreter exit) was destroyed during finalization,
        # where gloo's threads abort the process ("terminate called without an active
        # exception", SIGABRT after a finished run).
        del trainer, source
        gc.collect()
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
