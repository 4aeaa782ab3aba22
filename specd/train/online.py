"""Online SpecOPD: the trainer's decisions on live traffic, with no transport in them.

The trainer service (``services/trainer``) moves traces from a Redis stream into an
`OnlineLearner` and publishes what it decides; everything that can be decided without a socket is
here, so a unit test reaches it directly.

Design choices:

- **A trace is one finished request** (`Trace`): the prompt and the target's own output (decoding
  is lossless, so it is a reference trajectory), plus what serving measured. `Trace.to_fields` /
  `Trace.from_fields` are the one definition of its Redis stream entry, for the verifier that
  writes it and the trainer that reads it.
- **Held-out traces are chosen by a hash of the trace id** (`is_heldout`): every
  ``heldout_every``-th trace on average, and the same trace always lands on the same side, so a
  redelivered trace never moves from held-out into training. At most ``max_heldout`` are kept,
  the newest.
- **Idempotent training**: the learner remembers the ids of the traces trained into its weights
  (``trained_ids``, in training order, the newest ``remember_traces``), and skips a trace it has
  already trained on. With at-least-once delivery that is what keeps a trace out of one
  version twice: a trainer that saved a checkpoint and died before acknowledging its traces gets
  them again, and skips them. Traces trained after the last checkpoint are not in it, so after
  a restart they are trained again, into weights that never saw them.
- **The ledger** (`LedgerEntry`, `read_ledger`): each checkpoint records the trace ids taken in
  since the previous checkpoint of its lineage, trained and held out, inside the checkpoint's own
  state, so it is exactly as durable as the weights it describes. Restored with the checkpoint,
  the lineage goes on numbering from there; traces trained after the last checkpoint and lost in
  a crash are in no entry, and once redelivered and trained again they are in the next one. So
  every acknowledged trace is in exactly one entry (acknowledgement follows the checkpoint), which
  a fault test can check from disk alone. Bounded like ``trained_ids``: the newest entries that
  together hold at least ``remember_traces`` ids are kept (older ones are dropped whole; their
  ``checkpoint`` numbers are not reused). Held-out ids are remembered apart from the held-out
  trajectories the gate keeps (``heldout_ids``, bounded by ``remember_traces`` too): a killed
  trainer's successor is redelivered every trace of the window it never acknowledged, often more
  held-out ones than the gate keeps (``max_heldout``), and must skip each of them.
- **Replay, where traffic is slower than the trainer** (``replay_traces``, off by default): the
  newest trained trajectories are kept, and when the stream has nothing new the service steps on
  a batch drawn from them rather than wait. On a small machine a live stream brings a trace every
  few seconds while a step takes one or two; without replay the trainer idles most of the time.
  Replay changes no trace's accounting (a replayed trace is not taken in again) and the gate
  still guards serving against overfitting to the few traces kept.
- **A version is a checkpoint that passed the gate.** Every ``steps_per_version`` steps the
  online state is saved (`save`, atomically: `specd.train.opd.save_checkpoint`), and the service
  acknowledges the traces in it only then. The weights keep training whether or not a candidate
  is published: the gate protects serving, not the lineage.
- **The gate** (`expected_tau`, `gate`): τ = 1 + the drafter's expected accepted length on
  supervision built from the held-out traces, exactly as training builds it (anchors, branches
  sampled from *this* drafter, the target's p from the scorer) but from fixed seeds, so the live
  and the candidate drafter are measured on the same anchors with common random numbers, and
  no decoding is needed. A candidate is published iff its τ is not below the live one's; with
  too few held-out traces (``min_heldout``) there is no evidence and nothing is published.
- **A published version** is a directory ``<versions>/<name>`` in the layout
  `specd.models.loading.load_model` reads (``config.json`` + ``model.safetensors``, written by
  `save_model`), its name ``v<steps>-<sha256 prefix>`` (unique even when a trainer restarts from
  scratch), announced with every file's sha256. The newest ``keep_versions`` stay on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
import string
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specd.models.d3d import D3DModel
from specd.models.loading import file_sha256, load_model, save_model
from specd.train.data_parallel import TRAINER_STATE
from specd.train.opd import complete_checkpoint, load_checkpoint, recover_checkpoint, save_checkpoint
from specd.train.specopd import (
    SpecOPDConfig,
    SpecOPDTrainer,
    StepResult,
    Trajectory,
    TreeScorer,
    screen,
)

logger = logging.getLogger(__name__)

METHOD = "specopd-online"
"""The method name online checkpoints are saved under (`specd.train.opd.save_checkpoint`)."""
VERSION_NAME = re.compile(r"v\d{7,}-[0-9a-f]{12}")
"""Published version names: ``v<steps>-<sha256 of model.safetensors, 12 hex digits>``."""


@dataclass(kw_only=True, slots=True)
class OnlineConfig:
    batch_size: int = 4
    """Traces per SpecOPD step."""
    steps_per_version: int = 50
    """Steps between checkpoints (each one a candidate version for the gate)."""
    heldout_every: int = 20
    """About one trace in this many (by a hash of its id) is held out for the gate, never trained on."""
    max_heldout: int = 256
    """Held-out traces kept (the newest)."""
    min_heldout: int = 4
    """Held-out traces the gate needs before it publishes anything."""
    gate_batch_size: int = 8
    """Held-out traces per supervision batch when the gate measures τ."""
    gate_seed: int = 0
    """Seeds the gate's anchors and branches (the same for the live drafter and the candidate)."""
    remember_traces: int = 100_000
    """Trace ids remembered as trained, and apart as held out (the newest of each), to skip
    redelivered traces."""
    keep_versions: int = 5
    """Published version directories kept on disk (the live one always is)."""
    replay_traces: int = 0
    """0: each trace is trained once, when it arrives. N > 0: the newest N trained traces are kept,
    and whenever the stream has nothing new the learner steps on a batch drawn from them (a
    replay step): where traffic brings traces more slowly than the trainer can step, it keeps
    training instead of waiting. A replayed trace is no new trace: the ledger, the trained ids and
    the acknowledgements are unchanged by it."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "steps_per_version", "max_heldout", "min_heldout", "gate_batch_size",
                     "remember_traces", "keep_versions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replay_traces < 0:
            raise ValueError(f"replay_traces must be >= 0 (0: no replay), got {self.replay_traces}")
        if self.heldout_every < 2:
            raise ValueError(f"heldout_every must be >= 2 (one trace in N is held out), got {self.heldout_every}")
        if self.min_heldout > self.max_heldout:
            raise ValueError(f"min_heldout ({self.min_heldout}) cannot exceed max_heldout ({self.max_heldout})")


# ---------------------------------------------------------------------------- traces
@dataclass(kw_only=True, slots=True)
class Trace:
    """One finished request as the verifier records it in the trace stream."""

    trace_id: str
    """Hex id, unique per request (redeliveries and retries repeat it)."""
    prompt_ids: list[int]
    output_ids: list[int]
    """The committed output: the target's own tokens (decoding is lossless)."""
    accepted: list[int]
    """Accepted length k of every verification step (what serving measured)."""
    drafter_version: str
    """The drafter version that drafted for this request."""
    finish_reason: str
    """"stop" or "length"."""

    @property
    def trajectory(self) -> Trajectory:
        return Trajectory(prompt=self.prompt_ids, response=self.output_ids)

    def to_fields(self) -> dict[str, str]:
        """The stream entry: strings, lists as JSON (``XADD stream * field value ...``)."""
        return {
            "trace_id": self.trace_id,
            "prompt_ids": json.dumps(self.prompt_ids),
            "output_ids": json.dumps(self.output_ids),
            "accepted": json.dumps(self.accepted),
            "drafter_version": self.drafter_version,
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str | bytes, str | bytes]) -> Trace:
        """Parse a stream entry; ValueError naming the field and what is wrong with it."""
        values = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                  for k, v in fields.items()}
        missing = [name for name in ("trace_id", "prompt_ids", "output_ids") if name not in values]
        if missing:
            raise ValueError(f"trace entry lacks field(s) {', '.join(missing)} (has {sorted(values)})")
        trace_id = values["trace_id"]
        if not trace_id or len(trace_id) > 64 or any(c not in string.hexdigits for c in trace_id):
            raise ValueError(f"trace_id must be 1-64 hex digits, got {trace_id[:80]!r}")
        return cls(
            trace_id=trace_id,
            prompt_ids=_id_list(values, "prompt_ids"),
            output_ids=_id_list(values, "output_ids"),
            accepted=_id_list(values, "accepted") if "accepted" in values else [],
            drafter_version=values.get("drafter_version", ""),
            finish_reason=values.get("finish_reason", ""),
        )


def _id_list(values: Mapping[str, str], name: str) -> list[int]:
    try:
        parsed = json.loads(values[name])
    except json.JSONDecodeError as error:
        raise ValueError(f"trace field {name} is not JSON ({error}): {values[name][:80]!r}") from None
    if not isinstance(parsed, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in parsed):
        raise ValueError(f"trace field {name} must be a JSON list of integers, got {values[name][:80]!r}")
    return parsed


def is_heldout(trace_id: str, every: int) -> bool:
    """True for about one trace id in ``every``, the same answer every time (a hash, not a draw)."""
    digest = hashlib.sha256(trace_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % every == 0


# ---------------------------------------------------------------------------- the gate
@torch.no_grad()
def expected_tau(distiller: SpecOPDTrainer, heldout: Sequence[Trajectory], *, seed: int = 0,
                 batch_size: int = 8) -> float:
    """1 + the mean expected accepted length of ``distiller``'s drafter on held-out trajectories.

    Supervision is built as a SpecOPD step builds it — anchors, branches from this drafter, p from
    the distiller's scorer — from generators seeded with ``seed`` (the training ones are left
    untouched), and measured like `DrafterDistiller.evaluate`: Σ_k Π_{i<=k} α_i per branch. nan
    when no held-out trajectory is usable.
    """
    config = distiller.config
    kept, _ = screen(heldout, distiller.scorer.vocab_size, config.max_context, config.block_size)
    rng = np.random.default_rng(seed)
    generator = torch.Generator(device=distiller.drafter.embed_tokens.weight.device).manual_seed(seed)
    total, num_branches = 0.0, 0
    for start in range(0, len(kept), batch_size):
        supervision = distiller.supervise(kept[start : start + batch_size], rng=rng, generator=generator)
        if supervision is None or supervision.num_supervised_tokens == 0:
            continue
        _, accepted = distiller.evaluate(supervision)
        count = int(supervision.group.shape[0])
        total += accepted * count
        num_branches += count
    return 1.0 + total / num_branches if num_branches else math.nan


def gate(candidate_tau: float, live_tau: float) -> bool:
    """Publish iff the candidate is not worse than the live drafter; nan (no evidence) never passes."""
    return candidate_tau >= live_tau


@dataclass(kw_only=True, slots=True)
class GateDecision:
    passed: bool
    candidate_tau: float
    live_tau: float
    reason: str
    """Why, in words (for the log)."""


@dataclass(kw_only=True, slots=True)
class Published:
    """A version written under the versions directory."""

    version: str
    directory: Path
    sha256: dict[str, str]
    """File name -> hex sha256, for every file of the directory."""

    def announcement(self) -> str:
        """The JSON the live-version key holds and the update hint carries."""
        return json.dumps({"version": self.version, "sha256": self.sha256}, sort_keys=True)


def write_version(drafter: D3DModel, versions: Path, num_steps: int) -> Published:
    """Save ``drafter`` as a loadable model directory under ``versions``, renamed into place whole."""
    versions.mkdir(parents=True, exist_ok=True)
    for leftover in versions.glob(".partial-*"):  # from a write a crash interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    partial = versions / f".partial-{num_steps}"
    save_model(drafter, partial)
    sha256 = {path.name: file_sha256(path) for path in sorted(partial.iterdir()) if path.is_file()}
    version = f"v{num_steps:07d}-{sha256['model.safetensors'][:12]}"  # matches VERSION_NAME
    directory = versions / version
    if directory.exists():  # the same weights at the same step: already published as this name
        shutil.rmtree(partial)
    else:
        partial.rename(directory)
    return Published(version=version, directory=directory, sha256=sha256)


# ---------------------------------------------------------------------------- the ledger
@dataclass(kw_only=True, slots=True)
class LedgerEntry:
    """What one checkpoint of a lineage took in since the previous one (module docstring)."""

    checkpoint: int
    """1, 2, ... along the lineage (a restarted trainer goes on from its last checkpoint's number)."""
    num_steps: int
    """Optimizer steps of the weights this checkpoint holds."""
    trained: list[str]
    """Trace ids trained into the weights since the previous checkpoint, in training order."""
    heldout: list[str]
    """Trace ids held out for the gate since the previous checkpoint, in arrival order."""


def bounded_ledger(entries: list[LedgerEntry], keep_ids: int) -> list[LedgerEntry]:
    """The shortest suffix of ``entries`` that holds at least ``keep_ids`` trace ids (all of
    them when they hold fewer); the newest entry is always kept."""
    total = sum(len(e.trained) + len(e.heldout) for e in entries)
    start = 0
    while start < len(entries) - 1 and total - len(entries[start].trained) - len(entries[start].heldout) >= keep_ids:
        total -= len(entries[start].trained) + len(entries[start].heldout)
        start += 1
    return entries[start:]


def read_ledger(checkpoint_dir: Path) -> list[LedgerEntry]:
    """The ledger of the online checkpoint in ``checkpoint_dir``, oldest entry first, read from
    disk without a trainer. ``checkpoint_dir`` is the trainer's ``--checkpoint-dir`` (holding
    ``online/``) or the ``online/`` directory itself; one-process (``state.pt``) and data-parallel
    (``trainer.json``) checkpoints both work. FileNotFoundError when there is no checkpoint there,
    ValueError when it is not an online trainer's."""
    directory = Path(checkpoint_dir)
    # A trainer killed between the renames of its last save left the checkpoint under another name
    # (`complete_checkpoint`); read it there, without renaming under a trainer that may be running.
    candidates = [complete_checkpoint(path) for path in (directory / "online", directory)]
    for candidate in (c for c in candidates if c is not None):
        if (candidate / "state.pt").is_file():
            # Our own file: it holds numpy RNG state, which weights_only refuses.
            state = torch.load(candidate / "state.pt", weights_only=False, map_location="cpu")
            if state.get("method") != METHOD:
                raise ValueError(f"{candidate} is a {state.get('method')!r} checkpoint, not an online trainer's "
                                 f"({METHOD!r}): it has no ledger")
            data = state["data"]
            break
        if (candidate / TRAINER_STATE).is_file():
            data = json.loads((candidate / TRAINER_STATE).read_text())["data"]
            break
    else:
        raise FileNotFoundError(f"no online checkpoint in {directory} (looked for online/state.pt, online/{TRAINER_STATE}, "
                                f"state.pt and {TRAINER_STATE}): pass the trainer's --checkpoint-dir")
    if "ledger" not in data:
        raise ValueError(f"the checkpoint in {candidate} has no ledger: it is not an online trainer's, or was "
                         "written before checkpoints kept one")
    return [LedgerEntry(**entry) for entry in data["ledger"]]


# ---------------------------------------------------------------------------- the learner
@dataclass(kw_only=True, slots=True)
class OnlineCounters:
    """What the trainer reports (Status) and keeps across restarts."""

    traces_consumed: int = 0
    """Traces taken in: trained or held out (duplicates and dead letters not included)."""
    duplicates: int = 0
    """Traces skipped because their id was already trained into these weights or held out."""
    dead_letters: int = 0
    versions_published: int = 0
    versions_refused: int = 0
    live_version: str = ""
    """The published version serving now ("" = the initial drafter, nothing published yet)."""
    live_tau: float = math.nan
    """The live drafter's τ at the last gate; once a candidate passes, that candidate's."""
    last_candidate_tau: float = math.nan
    last_gate_live_tau: float = math.nan
    """The live drafter's τ in the last gate decision, what ``last_candidate_tau`` was compared with."""
    replay_steps: int = 0
    """Steps on replayed traces (`OnlineConfig.replay_traces`), included in the learner's steps."""


class OnlineLearner:
    """The online loop's state and decisions: which traces to train, hold out or skip; steps;
    checkpoints; the gate; published versions. See the module docstring.

    ``drafter`` is trained in place; ``live`` is the drafter serving now (the gate's reference),
    replaced by a copy of each published candidate. ``directory`` holds ``online/`` (the
    checkpoint) and ``versions/`` (published versions).
    """

    def __init__(self, scorer: TreeScorer, drafter: D3DModel, live: D3DModel, directory: Path, *,
                 config: SpecOPDConfig | None = None, online: OnlineConfig | None = None) -> None:
        self.config = config or SpecOPDConfig()
        self.online = online or OnlineConfig()
        self.scorer = scorer
        self.trainer = self._trainer(scorer, drafter)
        # The live drafter only ever evaluates; a distiller around it shares the scorer and config.
        self.live = SpecOPDTrainer(scorer, live.eval(), self.config)
        self.directory = Path(directory)
        self.counters = OnlineCounters()
        self.trained_ids: OrderedDict[str, None] = OrderedDict()
        self.heldout: OrderedDict[str, Trajectory] = OrderedDict()  # the gate's, the newest max_heldout
        self.heldout_ids: OrderedDict[str, None] = OrderedDict()  # every held-out id, the newest remember_traces
        self.replay: OrderedDict[str, Trajectory] = OrderedDict()  # the newest replay_traces trained
        self.published: OrderedDict[str, dict[str, str]] = OrderedDict()  # version -> sha256 map
        self.batch: list[Trace] = []
        self.steps_at_version = 0  # num_steps at the last checkpoint
        self.ledger: list[LedgerEntry] = []  # the newest checkpoints' entries (module docstring)
        self.num_checkpoints = 0  # checkpoints of this lineage so far (the last entry's number)
        self._new_trained: list[str] = []  # ids trained since the last checkpoint: its next entry
        self._new_heldout: list[str] = []

    def _trainer(self, scorer: TreeScorer, drafter: D3DModel) -> SpecOPDTrainer:
        """What trains ``drafter`` (a subclass trains it over data-parallel ranks)."""
        return SpecOPDTrainer(scorer, drafter, self.config)

    def weights(self) -> D3DModel:
        """The weights being trained, whole: what the gate judges and a version holds by default."""
        return self.trainer.drafter

    def idle(self) -> None:
        """Called by the service between polls (a subclass keeps other ranks waiting here alive)."""

    def close(self) -> None:
        """Called by the service once it has saved for the last time (a subclass releases its ranks)."""

    # ------------------------------------------------------------------ paths
    @property
    def checkpoint_dir(self) -> Path:
        return self.directory / "online"

    @property
    def versions_dir(self) -> Path:
        return self.directory / "versions"

    def version_dir(self, version: str) -> Path | None:
        """The directory of a published version, None when it is not one (never a path from input)."""
        return self.versions_dir / version if version in self.published else None

    # ------------------------------------------------------------------ traces in
    def add(self, trace: Trace) -> str:
        """Take one trace: "train" (queued for the next step), "heldout" or "duplicate" (skipped)."""
        trace_id = trace.trace_id
        if trace_id in self.trained_ids or trace_id in self.heldout_ids or any(t.trace_id == trace_id for t in self.batch):
            self.counters.duplicates += 1
            return "duplicate"
        self.counters.traces_consumed += 1
        if is_heldout(trace_id, self.online.heldout_every):
            self.heldout[trace_id] = trace.trajectory
            self.heldout_ids[trace_id] = None
            self._new_heldout.append(trace_id)
            while len(self.heldout) > self.online.max_heldout:
                self.heldout.popitem(last=False)
            while len(self.heldout_ids) > self.online.remember_traces:
                self.heldout_ids.popitem(last=False)
            return "heldout"
        self.batch.append(trace)
        return "train"

    @property
    def ready(self) -> bool:
        """A full batch is queued."""
        return len(self.batch) >= self.online.batch_size

    def step(self) -> StepResult:
        """One SpecOPD step on the queued batch; its traces count as trained into these weights.

        When the scorer raises (e.g. no verifier reachable) the batch stays queued and nothing
        counts, so the caller may retry.
        """
        result = self._train([trace.trajectory for trace in self.batch])
        for trace in self.batch:
            self.trained_ids[trace.trace_id] = None
            self._new_trained.append(trace.trace_id)
            if self.online.replay_traces:
                self.replay[trace.trace_id] = trace.trajectory
        while len(self.trained_ids) > self.online.remember_traces:
            self.trained_ids.popitem(last=False)
        while len(self.replay) > self.online.replay_traces:
            self.replay.popitem(last=False)
        self.batch = []
        return result

    @property
    def can_replay(self) -> bool:
        """Replay is on and a batch of trained traces is kept to draw from."""
        return self.online.replay_traces > 0 and len(self.replay) >= self.online.batch_size

    def replay_step(self) -> StepResult:
        """One step on ``batch_size`` kept traces drawn without replacement, seeded by the step
        number (a resumed lineage draws what it would have); nothing else changes."""
        rng = np.random.default_rng((self.config.seed, self.trainer.num_steps))
        kept = list(self.replay.values())
        picks = rng.choice(len(kept), size=self.online.batch_size, replace=False)
        result = self._train([kept[int(i)] for i in picks])
        self.counters.replay_steps += 1
        return result

    def _train(self, trajectories: list[Trajectory]) -> StepResult:
        result = self.trainer.step(trajectories)
        if result.num_supervised_tokens == 0:
            self.trainer.num_steps += 1  # a batch with nothing usable still counts as a step (as in train_opd)
        return result

    def count_dead_letter(self) -> None:
        self.counters.dead_letters += 1

    @property
    def num_steps(self) -> int:
        return self.trainer.num_steps

    @property
    def version_due(self) -> bool:
        return self.trainer.num_steps - self.steps_at_version >= self.online.steps_per_version

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """Write the online checkpoint (weights, optimizer, RNGs, trained ids, held-out traces,
        counters, the ledger with this checkpoint's entry) to a temporary directory and rename it
        into place."""
        self.steps_at_version = self.trainer.num_steps
        entry = LedgerEntry(checkpoint=self.num_checkpoints + 1, num_steps=self.trainer.num_steps,
                            trained=list(self._new_trained), heldout=list(self._new_heldout))
        before = self.ledger
        self.ledger = bounded_ledger([*before, entry], self.online.remember_traces)
        self.num_checkpoints += 1
        try:
            self._save_checkpoint()
        except BaseException:  # not saved: the entry is not part of the lineage; the next save records its ids
            self.ledger = before
            self.num_checkpoints -= 1
            raise
        self._new_trained, self._new_heldout = [], []

    def _save_checkpoint(self) -> None:
        save_checkpoint(self.checkpoint_dir, self.trainer, self, METHOD, {})

    def load(self) -> bool:
        """Load the online checkpoint when there is one (and the live version's weights as the
        gate's reference); False when starting fresh."""
        if not self._load_checkpoint():
            return False
        self.batch = []
        self.steps_at_version = self.trainer.num_steps
        live = self.counters.live_version
        if live:
            if not (self.versions_dir / live / "model.safetensors").is_file():
                raise ValueError(f"the online checkpoint says version {live} is live, but {self.versions_dir / live} "
                                 "is missing: restore that directory, or start over with an empty checkpoint directory")
            self.live.drafter.load_state_dict(load_model(self.versions_dir / live).state_dict())
        return True

    def adopt(self, version: str) -> bool:
        """Make ``version`` live if it is a complete directory this learner wrote under its
        versions directory: the service published it, then stopped before the checkpoint that
        records it. False (nothing changes) otherwise."""
        directory = self.versions_dir / version
        if not VERSION_NAME.fullmatch(version) or not (directory / "model.safetensors").is_file():
            return False
        self.published[version] = {path.name: file_sha256(path) for path in sorted(directory.iterdir()) if path.is_file()}
        self.published.move_to_end(version)
        self.live.drafter.load_state_dict(load_model(directory).state_dict())
        self.counters.live_version = version
        self.counters.versions_published += 1
        return True

    def _load_checkpoint(self) -> bool:
        recover_checkpoint(self.checkpoint_dir)
        if (self.checkpoint_dir / TRAINER_STATE).is_file():
            raise ValueError(f"{self.checkpoint_dir} holds a data-parallel checkpoint ({TRAINER_STATE} + dcp/): "
                             "resume it with --data-parallel N under torchrun, or use another checkpoint directory")
        if not (self.checkpoint_dir / "state.pt").is_file():
            return False
        load_checkpoint(self.checkpoint_dir, self.trainer, self, METHOD)
        return True

    # `save_checkpoint` / `load_checkpoint` keep a data source's cursor with its state() and
    # restore(); for the online trainer the learner is that source.
    def state(self) -> dict:
        """The stream-side state a checkpoint holds (what a `TrajectorySource` cursor is offline)."""
        return {
            "counters": asdict(self.counters),
            "trained_ids": list(self.trained_ids),
            "heldout": [(i, t.prompt, t.response) for i, t in self.heldout.items()],
            "heldout_ids": list(self.heldout_ids),
            "replay": [(i, t.prompt, t.response) for i, t in self.replay.items()],
            "published": list(self.published.items()),
            "ledger": [asdict(entry) for entry in self.ledger],
            "num_checkpoints": self.num_checkpoints,
        }

    def restore(self, state: dict) -> None:
        self.counters = OnlineCounters(**state["counters"])
        self.trained_ids = OrderedDict.fromkeys(state["trained_ids"])
        self.heldout = OrderedDict((i, Trajectory(prompt=p, response=r)) for i, p, r in state["heldout"])
        # A checkpoint written before held-out ids were kept apart remembers the gate's traces only.
        self.heldout_ids = OrderedDict.fromkeys(state.get("heldout_ids", list(self.heldout)))
        self.replay = OrderedDict((i, Trajectory(prompt=p, response=r)) for i, p, r in state.get("replay", []))
        self.published = OrderedDict(state["published"])
        # A checkpoint written before the ledger existed starts one (numbered from 1).
        self.ledger = [LedgerEntry(**entry) for entry in state.get("ledger", [])]
        self.num_checkpoints = state.get("num_checkpoints", len(self.ledger))
        self._new_trained, self._new_heldout = [], []

    # ------------------------------------------------------------------ the gate and versions
    def judge(self, candidate: D3DModel | None = None) -> GateDecision:
        """Gate ``candidate`` (default: the weights being trained, `weights`) against the live drafter."""
        heldout = list(self.heldout.values())
        if len(heldout) < self.online.min_heldout:
            decision = GateDecision(passed=False, candidate_tau=math.nan, live_tau=math.nan,
                                    reason=f"{len(heldout)} held-out traces, the gate needs {self.online.min_heldout}")
        else:
            distiller = self.trainer if candidate is None else SpecOPDTrainer(self.scorer, candidate, self.config)
            kwargs = {"seed": self.online.gate_seed, "batch_size": self.online.gate_batch_size}
            candidate_tau = expected_tau(distiller, heldout, **kwargs)
            live_tau = expected_tau(self.live, heldout, **kwargs)
            passed = gate(candidate_tau, live_tau)
            decision = GateDecision(passed=passed, candidate_tau=candidate_tau, live_tau=live_tau,
                                    reason=f"held-out τ {candidate_tau:.4f} vs live {live_tau:.4f} on {len(heldout)} traces")
        self.counters.last_candidate_tau = decision.candidate_tau
        self.counters.last_gate_live_tau = decision.live_tau
        if not math.isnan(decision.live_tau):
            self.counters.live_tau = decision.live_tau
        if not decision.passed:
            self.counters.versions_refused += 1
        return decision

    def write(self, candidate: D3DModel | None = None) -> Published:
        """Write ``candidate`` (default: the weights being trained) as a version directory."""
        return write_version(self.weights() if candidate is None else candidate, self.versions_dir, self.num_steps)

    def serve(self, published: Published) -> None:
        """Make ``published`` fetchable (`version_dir` knows it). Called before the live key names
        it: a drafter that reads the key at once must find the version, not NOT_FOUND."""
        self.published[published.version] = published.sha256
        self.published.move_to_end(published.version)

    def make_live(self, published: Published, decision: GateDecision, candidate: D3DModel | None = None) -> None:
        """Record ``published`` as the live version (once the service has announced it) and make
        its weights the gate's new reference; prune old version directories."""
        source = self.weights() if candidate is None else candidate
        self.live.drafter.load_state_dict(source.state_dict())
        self.serve(published)
        self.counters.live_version = published.version
        self.counters.live_tau = decision.candidate_tau
        self.counters.versions_published += 1
        while len(self.published) > self.online.keep_versions:
            version, _ = self.published.popitem(last=False)
            shutil.rmtree(self.versions_dir / version, ignore_errors=True)
