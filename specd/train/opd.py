"""`specd train opd`: the on-policy distillation loop around `specd.train.specopd`'s step.

Design choices:

- **Data is a `TrajectorySource`**: ``next_batch(n)`` hands out reference trajectories in a
  fixed order and ``state()``/``restore()`` save and restore a *cursor*, so a resumed run reads
  exactly the lines an uninterrupted one would. `FileSource` reads JSONL (three formats, see
  `parse_line`) and goes round again at the end; a line it cannot use is skipped, counted under
  its reason and logged, never raised (the trainer's `screen` does the same for ids outside the
  vocabulary, empty responses and trajectories longer than the context). Live traffic from the
  verifiers' Redis trace stream is the trainer service's job (``python -m services.trainer``:
  a consumer group, ack after checkpoint, a gate before publishing); ``redis://`` here is
  refused with a pointer to it.
- **One method flag, one step**: ``specopd``, ``sequential`` and ``offline`` are the three
  `DrafterDistiller` subclasses, so everything but where supervision comes from is shared.
  Offline distillation always uses KL (`OfflineDistillationTrainer`).
- **Checkpoints are the whole state**: the drafter's weights (safetensors), the optimizer, every
  RNG (torch's global one, numpy's, the trainer's anchor rng and its branch-sampling generator),
  the trainer's counters and the data cursor, written to a temporary directory and renamed, so a
  kill mid-write leaves the previous checkpoint. A run with more ``steps`` in the same ``out``
  resumes from it and reproduces the uninterrupted run bit for bit (`tests/unit/test_opd_resume.py`).
- **Held-out τ** goes through the serving engine (`SpeculativeEngine`, greedy, sync, fixed
  block): the figure the drafter is trained to raise, measured the way it is served. It draws on
  no training RNG, so evaluating does not change what is trained.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from specd.drafters.d3d import D3DDrafter
from specd.engine import EngineConfig, SpeculativeEngine
from specd.models.d3d import D3DModel
from specd.sampling import SamplingParams
from specd.train.rollout import OfflineDistillationTrainer, SequentialOPDTrainer
from specd.train.specopd import (
    DrafterDistiller,
    SpecOPDConfig,
    SpecOPDTrainer,
    Trajectory,
)

logger = logging.getLogger(__name__)

METHODS = {"specopd": SpecOPDTrainer, "sequential": SequentialOPDTrainer, "offline": OfflineDistillationTrainer}


# ---------------------------------------------------------------------------- data
class TrajectorySource(Protocol):
    """Reference trajectories in a fixed order, with a cursor a checkpoint can hold."""

    skipped: Counter
    """Records that could not be used, by reason."""

    def next_batch(self, size: int) -> list[Trajectory]: ...

    def state(self) -> dict: ...

    def restore(self, state: dict) -> None: ...


def parse_line(line: str, tokenizer=None) -> Trajectory | str:
    """One JSONL record -> a `Trajectory`, or the reason it cannot be one.

    Formats: ``{"prompt_ids": [...], "response_ids": [...]}``; ``{"prompt": "...", "response":
    "..."}`` (needs a tokenizer); the zoo's ``{"prompt_len": n, "ids": [...]}``. Ids are only
    checked to be integers here; the vocabulary and context limits are the trainer's `screen`.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return "invalid_json"
    if not isinstance(record, dict):
        return "unknown_format"
    if "prompt_ids" in record and "response_ids" in record:
        prompt, response = record["prompt_ids"], record["response_ids"]
    elif "ids" in record and "prompt_len" in record:
        ids, cut = record["ids"], record["prompt_len"]
        if not isinstance(ids, list) or not isinstance(cut, int) or isinstance(cut, bool) or not 0 <= cut <= len(ids):
            return "bad_prompt_len"
        prompt, response = ids[:cut], ids[cut:]
    elif "prompt" in record and "response" in record:
        if tokenizer is None:
            return "text_without_tokenizer"
        if not isinstance(record["prompt"], str) or not isinstance(record["response"], str):
            return "unknown_format"
        prompt, response = tokenizer.encode(record["prompt"]).ids, tokenizer.encode(record["response"]).ids
    else:
        return "unknown_format"
    if not isinstance(prompt, list) or not isinstance(response, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in [*prompt, *response]
    ):
        return "not_token_ids"
    return Trajectory(prompt=prompt, response=response)


class FileSource:
    """A JSONL file of trajectories, read in order and round again; the cursor is the next line."""

    def __init__(self, path: str | Path, tokenizer=None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"no trajectory file at {self.path}")
        self.lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        if not self.lines:
            raise ValueError(f"{self.path} holds no trajectories")
        self.tokenizer = tokenizer
        self.position = 0  # lines consumed in all, across passes over the file
        self.skipped: Counter = Counter()

    def next_batch(self, size: int) -> list[Trajectory]:
        batch, misses = [], 0
        while len(batch) < size:
            index = self.position % len(self.lines)
            self.position += 1
            item = parse_line(self.lines[index], self.tokenizer)
            if isinstance(item, Trajectory):
                batch.append(item)
                misses = 0
                continue
            self.skipped[item] += 1
            logger.warning("skipping line %d of %s: %s", index + 1, self.path, item)
            misses += 1
            if misses >= len(self.lines):  # a whole pass without one usable line
                raise ValueError(f"no usable trajectory in {self.path} (skipped: {dict(self.skipped)})")
        return batch

    def state(self) -> dict:
        return {"position": self.position, "skipped": dict(self.skipped)}

    def restore(self, state: dict) -> None:
        self.position = int(state["position"])
        self.skipped = Counter(state["skipped"])


class ListSource:
    """Trajectories already in memory (benchmarks, tests), in order and round again, with a cursor."""

    def __init__(self, trajectories: Sequence[Trajectory]) -> None:
        if not trajectories:
            raise ValueError("no trajectories")
        self.items = list(trajectories)
        self.position = 0
        self.skipped: Counter = Counter()

    def next_batch(self, size: int) -> list[Trajectory]:
        batch = [self.items[(self.position + i) % len(self.items)] for i in range(size)]
        self.position += size
        return batch

    def state(self) -> dict:
        return {"position": self.position}

    def restore(self, state: dict) -> None:
        self.position = int(state["position"])


def open_source(spec: str, tokenizer=None) -> TrajectorySource:
    """``FILE`` (JSONL) -> `FileSource`; ``redis://...`` is refused: live traffic is the trainer service's."""
    if spec.startswith("redis://"):
        raise ValueError(
            f"trajectory source {spec!r}: `specd train opd` reads JSONL files; to distil continuously from "
            "live traffic run the trainer service (`python -m services.trainer --redis-url ...`, or `specd up`)"
        )
    return FileSource(spec, tokenizer)


# ---------------------------------------------------------------------------- held-out tau
@torch.no_grad()
def heldout_tau(target: nn.Module, drafter: D3DModel, prompts: dict[str, list[list[int]]], *,
                block_size: int = 8, max_tokens: int = 48) -> dict[str, float]:
    """τ per domain: greedy speculative decoding through the engine (sync, fixed block)."""
    was_training = drafter.training
    taus = {}
    for domain, domain_prompts in prompts.items():
        num_seqs = max(1, min(len(domain_prompts), 8))
        config = EngineConfig(max_num_seqs=num_seqs, block_size=block_size, mode="sync", adaptive_block=False)
        engine = SpeculativeEngine(target, D3DDrafter(drafter, max_num_seqs=num_seqs), config)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=target.config.stop_token_ids)
        try:
            engine.generate(domain_prompts, params)
        finally:
            engine.close()
        taus[domain] = engine.stats.tau
    drafter.train(was_training)
    return taus


# ---------------------------------------------------------------------------- the loop
@dataclass(kw_only=True, slots=True)
class OPDResult:
    steps: int
    """Optimizer steps taken in all (resumed runs included)."""
    losses: list[float]
    """The loss of every step, from the first (nan for a step with nothing usable)."""
    num_supervised_tokens: int
    seconds: float
    """Training seconds in all, evaluation excluded."""
    evaluations: list[dict] = field(default_factory=list)
    """{"step", "seconds", "tau": {domain: τ}} every ``eval_every`` steps."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Records and trajectories skipped, by reason (the source's and the trainer's)."""


def make_trainer(method: str, target: nn.Module, drafter: D3DModel, config: SpecOPDConfig) -> DrafterDistiller:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    return METHODS[method](target, drafter, config)


def train_opd(
    target: nn.Module,
    drafter: D3DModel,
    data: TrajectorySource,
    *,
    method: str = "specopd",
    config: SpecOPDConfig | None = None,
    out: Path,
    steps: int,
    batch_size: int = 4,
    checkpoint_every: int = 50,
    eval_every: int = 0,
    eval_prompts: dict[str, list[list[int]]] | None = None,
    eval_max_tokens: int = 48,
    progress: bool = True,
) -> OPDResult:
    """Train ``drafter`` in place for ``steps`` steps in all, resuming from ``out/checkpoint``.

    The checkpoint is written every ``checkpoint_every`` steps and at the end, so calling again
    with more steps continues where this call stopped. Evaluation results go to
    ``out/eval.jsonl`` as well as the result.
    """
    config = config or SpecOPDConfig()
    trainer = make_trainer(method, target, drafter, config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {"losses": [], "seconds": 0.0, "evaluations": []}
    recover_checkpoint(out / "checkpoint")
    if (out / "checkpoint").is_dir():
        state = load_checkpoint(out / "checkpoint", trainer, data, method)
        logger.info("resuming %s from step %d", method, trainer.num_steps)
    losses, evaluations = state["losses"], state["evaluations"]
    seconds = state["seconds"]
    bar = tqdm(total=steps, initial=trainer.num_steps, desc=f"opd {method}", unit="step", disable=not progress)
    while trainer.num_steps < steps:
        start = time.perf_counter()
        result = trainer.step(data.next_batch(batch_size))
        if result.num_supervised_tokens == 0:
            # Nothing usable in this batch: `train_on` took no step, so count it here to keep
            # going (and keep losses one per step); the reasons are in the skip counters.
            trainer.num_steps += 1
        losses.append(result.loss)
        seconds += time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss:.4f}", tokens=trainer.num_supervised_tokens)
        if eval_every and eval_prompts and trainer.num_steps % eval_every == 0:
            taus = heldout_tau(target, drafter, eval_prompts, block_size=config.block_size, max_tokens=eval_max_tokens)
            record = {"step": trainer.num_steps, "seconds": seconds, "tau": taus}
            evaluations.append(record)
            with (out / "eval.jsonl").open("a") as file:
                file.write(json.dumps(record) + "\n")
            bar.write(f"step {trainer.num_steps}: held-out tau " + ", ".join(f"{d} {t:.3f}" for d, t in taus.items()))
        if trainer.num_steps % checkpoint_every == 0 or trainer.num_steps == steps:
            save_checkpoint(out / "checkpoint", trainer, data, method,
                            {"losses": losses, "seconds": seconds, "evaluations": evaluations})
    bar.close()
    drafter.eval()
    skipped = Counter(data.skipped) + Counter(trainer.skipped)
    return OPDResult(steps=trainer.num_steps, losses=losses, num_supervised_tokens=trainer.num_supervised_tokens,
                     seconds=seconds, evaluations=evaluations, skipped=dict(skipped))


# ---------------------------------------------------------------------------- checkpoints
def complete_checkpoint(directory: Path) -> Path | None:
    """Where the newest complete checkpoint written by `swap_in` to ``directory`` is, None if none.

    `swap_in` writes ``NAME.partial`` whole, then renames ``NAME`` to ``NAME.old``, ``NAME.partial``
    to ``NAME``, and removes ``NAME.old``. A crash between the two renames leaves no ``NAME``:
    then ``NAME.partial`` is complete (``NAME`` was moved aside only after it was written) and
    newer than ``NAME.old``. Without ``NAME.old`` a lone ``NAME.partial`` is a write that was cut
    short, never a checkpoint."""
    directory = Path(directory)
    partial, old = _partial(directory), _old(directory)
    if directory.exists():
        return directory
    if old.exists():
        return partial if partial.exists() else old
    return None


def recover_checkpoint(directory: Path) -> None:
    """Finish a `swap_in` a crash interrupted, so that ``directory`` is the newest complete checkpoint
    again (nothing to do after a clean swap). Call it before looking for a checkpoint to resume."""
    directory = Path(directory)
    complete = complete_checkpoint(directory)
    if complete is not None and complete != directory:
        complete.rename(directory)
    if directory.exists():
        shutil.rmtree(_old(directory), ignore_errors=True)


def swap_in(partial: Path, directory: Path) -> None:
    """Make the complete checkpoint ``partial`` (``directory``'s `_partial`) the checkpoint at
    ``directory``, replacing the previous one; a crash at any point leaves a complete checkpoint
    that `recover_checkpoint` finds."""
    old = _old(directory)
    shutil.rmtree(old, ignore_errors=True)  # a leftover would make the rename below fail
    if directory.exists():
        directory.rename(old)
    partial.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


def _partial(directory: Path) -> Path:
    return directory.with_name(directory.name + ".partial")


def _old(directory: Path) -> Path:
    return directory.with_name(directory.name + ".old")


def save_checkpoint(directory: Path, trainer: DrafterDistiller, data: TrajectorySource, method: str, log: dict) -> None:
    """Weights (safetensors) + everything else (``state.pt``), swapped in by renames (`swap_in`)."""
    partial = _partial(directory)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weights = {k: v.detach().contiguous().clone() for k, v in trainer.drafter.state_dict().items()}
    # Tied weights are one tensor under two names: safetensors refuses shared storage, so clone.
    save_file(weights, str(partial / "drafter.safetensors"), metadata={"format": "pt"})
    torch.save({
        "method": method,
        "config": asdict(trainer.config),
        "optimizer": trainer.optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "anchor_rng": trainer.rng.bit_generator.state,
        "sampling_generator": trainer.generator.get_state(),
        "num_steps": trainer.num_steps,
        "num_supervised_tokens": trainer.num_supervised_tokens,
        "trainer_skipped": dict(trainer.skipped),
        "data": data.state(),
        "log": log,
    }, partial / "state.pt")
    swap_in(partial, directory)


def load_checkpoint(directory: Path, trainer: DrafterDistiller, data: TrajectorySource, method: str) -> dict:
    """Restore everything `save_checkpoint` wrote; returns its log (losses, seconds, evaluations)."""
    state = torch.load(directory / "state.pt", weights_only=False)
    if state["method"] != method:
        raise ValueError(f"{directory} is a {state['method']!r} checkpoint, not {method!r}: use another --out")
    if state["config"] != asdict(trainer.config):
        raise ValueError(f"{directory} was written with another configuration: {state['config']}")
    trainer.drafter.load_state_dict(load_file(str(directory / "drafter.safetensors")))
    trainer.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["numpy_rng"])
    trainer.rng.bit_generator.state = state["anchor_rng"]
    trainer.generator.set_state(state["sampling_generator"])
    trainer.num_steps = state["num_steps"]
    trainer.num_supervised_tokens = state["num_supervised_tokens"]
    trainer.skipped = Counter(state["trainer_skipped"])
    data.restore(state["data"])
    return state["log"]


def mean_tau(taus: dict[str, float]) -> float:
    return sum(taus.values()) / len(taus) if taus else math.nan
