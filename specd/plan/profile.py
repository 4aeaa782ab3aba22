"""Cost profiles: the simulator's input, as JSON; `load_profile` reads and checks one.

A profile holds what one target verifier pass and one D3D drafter pass cost, by batch rows and
new tokens per row, and what speculation earns per pass (acceptance per position, candidate hit
rate). `specd bench profile` (`specd.bench.profile`) measures one on this machine; for hardware we
do not have, write one by hand and say what it assumes in ``notes``
(``specd/plan/profiles/qwen3-8b-h200.json`` is such an example).

Schema (``version`` 1; fields marked * are required):

    {
      "version": 1,
      "machine": {...} or "text",          what it was measured on (free form)
      "notes": "...",                      assumptions (hand-written profiles must state theirs)
      "target"*:  {"batch"*: [1, 2, ...], "tokens"*: [1, 2, ...], "seconds"*: [[s per token count]
                   per batch], "context": 128, "name": "..."},
      "drafter"*: {"batch"*, "tokens"*, "seconds"* as above: Draft calls, "group_sizes": [5, 9, 17],
                   "calls": [...] (what was measured, informational), "name"},
      "speculate": {"batch"*, "tokens"*, "seconds"*: Speculate calls (default: the drafter table)},
      "block_size"*: 8,                    the block the acceptance was measured at
      "acceptance_per_pos"*: [0.8, 0.6, ...],   non-increasing, each in [0, 1]
      "confidence_per_pos": [0.9, 0.7, ...],   the drafter's mean confidence there (what the
                                           engine's cost model is shown); default: the acceptance
      "block_samples": {"confidence": [[...block_size values], ...], "accepted": [k, ...],
                        "prompt": [i, ...]},   verified full blocks: the drafter's confidence per
                                           position and the accepted length, together, and
                                           (optional) the index of the prompt in the profile's
                                           prompts (`specd bench serve`'s pool, in its order)
      "hit_rate"*: 0.6,                    P(a candidate was ready for the outcome), async mode
      "candidate_budget": 4,               outcomes drafted ahead per sequence when measured
      "by_block": {"4": {"acceptance_per_pos": [...], "hit_rate": 0.7}, ...},   optional
      "rpc_seconds": 0.0005,               one drafter round trip's fixed cost
      "overhead": {"step_seconds": 0.001, "seq_seconds": 0.0001,   the engine's, speculating
                   "plain_step_seconds": ..., "plain_seq_seconds": ...},   and decoding plain
      "padded_rows": true,                 each busy row is padded to the longest (specd's engine);
                                           false: the rows' real tokens only (packed)
      "serving": {"drafter_round_trips": true,   the drafter tables hold whole round trips through
                                           a replica (rpc_seconds: only what a network adds)
                  "verifier": {"rows"*: [1.0, 3.9, ...], "overhead_seconds"*: [...],
                               "target_scale"*: [...], ...},   optional: a verifier service's
                                           step time outside its pass, and its pass over the
                                           target table's, by mean rows (`services.calibrate`)
                  "speculative": {same columns, "draft_scale": [...]},   optional: the same for a
                                           verifier speculating (async) with a drafter replica
                                           (step time outside its pass and its blocking drafter
                                           calls), and its blocking Draft wait over the table's
                  "speculative_sync": {same columns, "draft_scale": [...]}},   optional: the
                                           same drafting synchronously
      "workload": {"prompt_tokens": [...], "output_tokens": [...], "max_tokens": 64}   optional
      "tensor_parallel": {"2": {"pass_scale": 0.56}, ...}   optional: a verifier of N ranks'
                                           target pass over the target table's (which is one
                                           GPU's); `specd plan --tensor-parallel N` assumes an
                                           ideal split plus all-reduce latency without it
    }

Axes are strictly increasing positive integers; a cost is read by bilinear interpolation,
clamped below the first point and extended linearly past the last (say so in ``notes`` if a
hand-written table is sparse). ``specd/plan/profiles/qwen3-8b-h200.json`` is a hand-written
example for a Qwen3-8B-class target on an H200-class GPU.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


@dataclass(kw_only=True, slots=True)
class CostTable:
    """Seconds of one pass by (batch rows, new tokens per row); see the module docstring."""

    batch: list[int]
    tokens: list[int]
    seconds: list[list[float]]  # [len(batch)][len(tokens)]
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __call__(self, batch: int, tokens: int) -> float:
        key = (batch, tokens)
        cost = self._memo.get(key)
        if cost is None:
            (i, wi), (j, wj) = _segment(self.batch, batch), _segment(self.tokens, tokens)
            s = self.seconds
            i2, j2 = min(i + 1, len(self.batch) - 1), min(j + 1, len(self.tokens) - 1)
            low = s[i][j] + wj * (s[i][j2] - s[i][j])
            high = s[i2][j] + wj * (s[i2][j2] - s[i2][j])
            cost = low + wi * (high - low)
            if batch > self.batch[-1] or tokens > self.tokens[-1]:
                # Past the table: never cheaper than its edge (a noisy last segment may slope down).
                cost = max(cost, self(min(batch, self.batch[-1]), min(tokens, self.tokens[-1])))
            cost = self._memo[key] = max(cost, 0.0)
        return cost

    def to_json(self) -> dict:
        return {"batch": self.batch, "tokens": self.tokens, "seconds": self.seconds}


def _segment(axis: list[int], x: float) -> tuple[int, float]:
    """(index, weight) of x on a sorted axis: clamped below, extended linearly above."""
    if len(axis) == 1 or x <= axis[0]:
        return 0, 0.0
    for i in range(len(axis) - 1):
        if x <= axis[i + 1]:
            return i, (x - axis[i]) / (axis[i + 1] - axis[i])
    i = len(axis) - 2
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


@dataclass(kw_only=True, slots=True)
class Acceptance:
    acceptance_per_pos: list[float]
    hit_rate: float


@dataclass(kw_only=True, slots=True)
class Serving:
    """A verifier service's costs beyond the in-process passes, by mean rows per pass (measured by
    `services.calibrate`; piecewise linear between the measured points, flat past them)."""

    rows: list[float]
    overhead_seconds: list[float]
    """Seconds of a step outside its target pass (admission, sampling, streaming deltas)."""
    target_scale: list[float]
    """The in-service target pass over the target table's cost for the same pass."""
    draft_scale: list[float] = field(default_factory=list)
    """A speculating service's blocking Draft wait over the drafter table's for the same calls
    (empty: 1)."""

    def overhead(self, rows: int) -> float:
        return _interp(rows, self.rows, self.overhead_seconds)

    def scale(self, rows: int) -> float:
        return _interp(rows, self.rows, self.target_scale)

    def draft(self, rows: int) -> float:
        return _interp(rows, self.rows, self.draft_scale) if self.draft_scale else 1.0


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(xs, ys)):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


@dataclass(kw_only=True, slots=True)
class Profile:
    """A validated profile (module docstring); build one with `load_profile` or `parse_profile`."""

    target: CostTable
    drafter: CostTable
    """Draft calls (a fresh block)."""
    speculate: CostTable
    """Speculate calls (candidates for the block under verification)."""
    block_size: int
    acceptance_per_pos: list[float]
    hit_rate: float
    confidence_per_pos: list[float] = field(default_factory=list)
    """The drafter's mean confidence per position at ``block_size`` (empty: its acceptance)."""
    sample_confidence: list[list[float]] = field(default_factory=list)
    """Verified full blocks at ``block_size``: the drafter's confidence per position ..."""
    sample_accepted: list[int] = field(default_factory=list)
    """... and the accepted length of each (empty: no samples) ..."""
    sample_prompt: list[int] = field(default_factory=list)
    """... and the index of the prompt it was decoding (empty: not recorded): acceptance is the
    prompt's as much as the drafter's, so a replayed request that names its prompt draws its own."""
    group_sizes: list[int] = field(default_factory=list)
    """The drafter's mask-group sizes (empty: a group is exactly block + 1)."""
    candidate_budget: int = 4
    by_block: dict[int, Acceptance] = field(default_factory=dict)
    rpc_seconds: float = 0.0005
    step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    plain_step_overhead_s: float | None = None
    """The engine's overhead decoding plain (no drafter); None: not measured."""
    plain_seq_overhead_s: float | None = None
    padded_rows: bool = True
    serving: Serving | None = None
    speculative_serving: Serving | None = None
    """A speculating (async) verifier service's costs (`serving.speculative`); None: not measured."""
    sync_serving: Serving | None = None
    """The same drafting synchronously (`serving.speculative_sync`); None: not measured."""
    drafter_round_trips: bool = False
    """The drafter tables are whole round trips through a replica (not bare passes)."""
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    tensor_parallel: dict[int, float] = field(default_factory=dict)
    """Ranks N -> measured pass scale: a tensor-parallel verifier's target pass over the table's."""
    notes: str = ""
    raw: dict = field(default_factory=dict, repr=False)

    def group_size(self, block: int) -> int:
        """Mask-group size the drafter uses for a block of ``block`` tokens (+1 bonus guess)."""
        fitting = [g for g in self.group_sizes if g >= block + 1]
        return min(fitting) if fitting else block + 1

    def acceptance(self, block: int) -> list[float]:
        """P(positions 0..i all accepted) for i < block: measured at this block when ``by_block``
        has it, else the top-level ``acceptance_per_pos``; made non-increasing, and carried on past
        its end at its last per-position conditional rate (an assumption `specd plan` repeats)."""
        source = self.by_block[block].acceptance_per_pos if block in self.by_block else self.acceptance_per_pos
        return _extended(source, block)

    def confidence(self, block: int) -> list[float]:
        """The drafter's confidence per position (what the engine's cost model weighs), measured
        at ``block_size`` and carried on past it like the acceptance; unmeasured: the acceptance."""
        if not self.confidence_per_pos:
            return self.acceptance(block)
        return _extended(self.confidence_per_pos, block)

    def hit_rate_for(self, block: int) -> float:
        return self.by_block[block].hit_rate if block in self.by_block else self.hit_rate


def _extended(source: list[float], block: int) -> list[float]:
    """Probabilities per position, clipped to [0, 1], made non-increasing, and carried on past
    their end at the last per-position ratio."""
    values = [min(max(a, 0.0), 1.0) for a in source]
    for i in range(1, len(values)):  # counting noise must not make a later position likelier
        values[i] = min(values[i], values[i - 1])
    if not values:
        return [0.0] * block
    ratio = values[-1] / values[-2] if len(values) > 1 and values[-2] > 0 else values[-1]
    while len(values) < block:
        values.append(values[-1] * ratio)
    return values[:block]


def _serving(data: Any, where: str, number, required, fail) -> Serving:
    """One ``serving`` block: rows, overhead_seconds and target_scale of one length, rows increasing."""
    if not isinstance(data, dict):
        raise fail(where, "must be an object with rows, overhead_seconds and target_scale")
    columns = {}
    for name in ("rows", "overhead_seconds", "target_scale"):
        values = required(data, name, f"{where}.")
        if not isinstance(values, list) or not values:
            raise fail(f"{where}.{name}", f"must be a non-empty list of numbers, got {values!r}")
        columns[name] = [number(f"{where}.{name}", v, 0.0) for v in values]
    if len({len(v) for v in columns.values()}) != 1:
        raise fail(where, "needs rows, overhead_seconds and target_scale of one length")
    if any(b <= a for a, b in itertools.pairwise(columns["rows"])):
        raise fail(f"{where}.rows", f"must be strictly increasing, got {columns['rows']!r}")
    draft = data.get("draft_scale") or []
    if not isinstance(draft, list) or len(draft) not in (0, len(columns["rows"])):
        raise fail(f"{where}.draft_scale", f"must be a list of numbers as long as rows, got {draft!r}")
    return Serving(**columns, draft_scale=[number(f"{where}.draft_scale", v, 0.0) for v in draft])


def _samples(data: Any, block_size: int, fail) -> dict:
    """``block_samples`` -> Profile fields, checked: rows of ``block_size`` probabilities, one
    accepted length in 0..block_size each."""
    if not data:
        return {}
    confidence, accepted = (data.get(k) if isinstance(data, dict) else None for k in ("confidence", "accepted"))
    if not isinstance(confidence, list) or not isinstance(accepted, list) or len(confidence) != len(accepted) or not accepted:
        raise fail("block_samples", "must be {confidence: [[...], ...], accepted: [...]} of the same non-zero length")
    for row, k in zip(confidence, accepted):
        if not isinstance(row, list) or len(row) != block_size or not all(
                isinstance(x, (int, float)) and 0.0 <= x <= 1.0 for x in row):
            raise fail("block_samples.confidence", f"each row must hold block_size ({block_size}) probabilities, got {row!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= block_size:
            raise fail("block_samples.accepted", f"each must be an integer in 0..{block_size}, got {k!r}")
    prompt = data.get("prompt") or []
    if not isinstance(prompt, list) or len(prompt) not in (0, len(accepted)) or not all(
            isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in prompt):
        raise fail("block_samples.prompt", "must be one prompt index (an integer >= 0) per sample, or absent")
    return {"sample_confidence": [[float(x) for x in row] for row in confidence], "sample_accepted": list(accepted),
            "sample_prompt": list(prompt)}


class ProfileError(ValueError):
    """A profile lacks a field or has a bad one; the message names it and what to do."""


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile JSON file (schema in the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"no profile at {path}: write one with `specd bench profile --json {path}` "
                           "or by hand (schema in specd/plan/profile.py)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path} is not JSON: {err}") from None
    return parse_profile(data, source=str(path))


def parse_profile(data: Any, *, source: str = "profile") -> Profile:
    """Validate a profile dict; ProfileError names the first missing or bad field."""

    def fail(name: str, what: str) -> ProfileError:
        return ProfileError(f"{source}: field {name!r} {what} (schema: specd/plan/profile.py)")

    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile is a JSON object, got {type(data).__name__}")
    version = data.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise fail("version", f"is {version!r}; this specd reads version {SCHEMA_VERSION}")

    def number(name: str, value: Any, low: float, high: float = math.inf) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise fail(name, f"must be a number in [{low}, {high}], got {value!r}")
        return float(value)

    def required(obj: dict, name: str, prefix: str = "") -> Any:
        if name not in obj:
            raise fail(prefix + name, "is missing")
        return obj[name]

    def table(name: str) -> CostTable:
        obj = required(data, name)
        if not isinstance(obj, dict):
            raise fail(name, "must be an object with batch, tokens and seconds")
        axes = {}
        for axis in ("batch", "tokens"):
            values = required(obj, axis, f"{name}.")
            if (not isinstance(values, list) or not values
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
                    or any(b <= a for a, b in itertools.pairwise(values))):
                raise fail(f"{name}.{axis}", f"must be a non-empty, strictly increasing list of positive integers, got {values!r}")
            axes[axis] = values
        seconds = required(obj, "seconds", f"{name}.")
        shape = (len(axes["batch"]), len(axes["tokens"]))
        if (not isinstance(seconds, list) or len(seconds) != shape[0]
                or not all(isinstance(row, list) and len(row) == shape[1] for row in seconds)):
            raise fail(f"{name}.seconds", f"must be a list of {shape[0]} rows (one per batch) of {shape[1]} numbers (one per token count)")
        for row in seconds:
            for value in row:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise fail(f"{name}.seconds", f"must hold positive finite seconds, got {value!r}")
        return CostTable(batch=axes["batch"], tokens=axes["tokens"], seconds=[[float(v) for v in row] for row in seconds])

    def acceptance(name: str, values: Any) -> list[float]:
        if not isinstance(values, list) or not values:
            raise fail(name, f"must be a non-empty list of probabilities, got {values!r}")
        return [number(name, v, 0.0, 1.0) for v in values]

    target, drafter = table("target"), table("drafter")
    speculate = table("speculate") if "speculate" in data else drafter
    block_size = required(data, "block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise fail("block_size", f"must be a positive integer, got {block_size!r}")
    by_block = {}
    for key, entry in (data.get("by_block") or {}).items():
        if not str(key).isdigit() or not isinstance(entry, dict):
            raise fail(f"by_block.{key}", "must map a block size to {acceptance_per_pos, hit_rate}")
        by_block[int(key)] = Acceptance(
            acceptance_per_pos=acceptance(f"by_block.{key}.acceptance_per_pos", required(entry, "acceptance_per_pos", f"by_block.{key}.")),
            hit_rate=number(f"by_block.{key}.hit_rate", required(entry, "hit_rate", f"by_block.{key}."), 0.0, 1.0))
    overhead = data.get("overhead") or {}
    workload = data.get("workload") or {}
    lengths = {}
    for name in ("prompt_tokens", "output_tokens"):
        values = workload.get(name, [])
        if not isinstance(values, list) or not all(isinstance(v, int) and v >= 1 for v in values):
            raise fail(f"workload.{name}", f"must be a list of positive integers, got {values!r}")
        lengths[name] = values
    group_sizes = data["drafter"].get("group_sizes", [])
    if not isinstance(group_sizes, list) or not all(isinstance(g, int) and g >= 2 for g in group_sizes):
        raise fail("drafter.group_sizes", f"must be a list of integers >= 2, got {group_sizes!r}")
    serving, speculative, sync, round_trips = None, None, None, False
    if "serving" in data:
        block = data["serving"]
        if not isinstance(block, dict):
            raise fail("serving", "must be an object")
        round_trips = bool(block.get("drafter_round_trips", False))
        if "verifier" in block:
            serving = _serving(block["verifier"], "serving.verifier", number, required, fail)
        if "speculative" in block:
            speculative = _serving(block["speculative"], "serving.speculative", number, required, fail)
        if "speculative_sync" in block:
            sync = _serving(block["speculative_sync"], "serving.speculative_sync", number, required, fail)
    tensor_parallel = {}
    for key, entry in (data.get("tensor_parallel") or {}).items():
        if not str(key).isdigit() or int(key) < 2 or not isinstance(entry, dict):
            raise fail(f"tensor_parallel.{key}", "must map a rank count >= 2 to {pass_scale}")
        scale = required(entry, "pass_scale", f"tensor_parallel.{key}.")
        tensor_parallel[int(key)] = number(f"tensor_parallel.{key}.pass_scale", scale, 1e-6, 10.0)
    notes = data.get("notes", "")
    return Profile(
        target=target, drafter=drafter, speculate=speculate, block_size=block_size,
        acceptance_per_pos=acceptance("acceptance_per_pos", required(data, "acceptance_per_pos")),
        confidence_per_pos=acceptance("confidence_per_pos", data["confidence_per_pos"]) if data.get("confidence_per_pos") else [],
        **_samples(data.get("block_samples"), block_size, fail),
        hit_rate=number("hit_rate", required(data, "hit_rate"), 0.0, 1.0),
        group_sizes=sorted(group_sizes), by_block=by_block,
        candidate_budget=int(number("candidate_budget", data.get("candidate_budget", 4), 0)),
        rpc_seconds=number("rpc_seconds", data.get("rpc_seconds", 0.0005), 0.0, 10.0),
        step_overhead_s=number("overhead.step_seconds", overhead.get("step_seconds", 0.0), 0.0, 10.0),
        seq_overhead_s=number("overhead.seq_seconds", overhead.get("seq_seconds", 0.0), 0.0, 10.0),
        plain_step_overhead_s=(number("overhead.plain_step_seconds", overhead["plain_step_seconds"], 0.0, 10.0)
                               if "plain_step_seconds" in overhead else None),
        plain_seq_overhead_s=(number("overhead.plain_seq_seconds", overhead["plain_seq_seconds"], 0.0, 10.0)
                              if "plain_seq_seconds" in overhead else None),
        padded_rows=bool(data.get("padded_rows", True)), serving=serving, speculative_serving=speculative,
        sync_serving=sync,
        drafter_round_trips=round_trips,
        prompt_tokens=lengths["prompt_tokens"], output_tokens=lengths["output_tokens"],
        tensor_parallel=tensor_parallel, notes=notes if isinstance(notes, str) else json.dumps(notes), raw=data,
    )
