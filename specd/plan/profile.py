"""Cost profiles: the simulator's input, as JSON; `load_profile` reads and checks one.

A profile holds what one target verifier pass and one D3D drafter pass cost, by batch rows and
new tokens per row, and what speculation earns per pass (acceptance per position, candidate hit
rate). `specd bench profile` (`specd.bench.profile`) measures one on this machine; for hardware we
do not have, write one by hand and say what it assumes in ``notes``
(``specd/plan/profiles/qwen3-8b-h200.json`` is such an example, for a Qwen3-8B-class target on an
H200-class GPU).

The schema is the `Profile` model below (pydantic): one class per JSON object, one field per key,
each field's docstring saying what it holds; ``Profile.model_json_schema()`` gives it as JSON
Schema. Validation happens there and only there: `parse_profile` turns its first complaint into a
`ProfileError` that names the field (``serving.verifier.rows``) and what it must be. Informational
keys (``machine``, ``tau``, a table's ``calls``, a calibration's per-level columns) are typed too,
so what `specd bench profile` writes is the model's own JSON dump (`Profile.to_json`); unknown
keys are ignored.

Axes are strictly increasing positive integers; a cost is read by bilinear interpolation,
clamped below the first point and extended linearly past the last (say so in ``notes`` if a
hand-written table is sparse).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError,
                      field_validator, model_validator)

SCHEMA_VERSION = 1


class ProfileError(ValueError):
    """A profile lacks a field or has a bad one; the message names it and what to do."""


class FieldError(ValueError):
    """A check that fails below the field pydantic locates it at: ``where`` is the dotted path
    under it (empty: the field itself), ``what`` the complaint."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(what)
        self.where, self.what = where, what


# ====================================================================== field types
# Numbers as JSON writes them: a bool or a string is not a number, an int is a float, and no
# measured figure is infinite or NaN.
def _number(**bounds: float) -> Any:
    return Annotated[float, Field(strict=True, allow_inf_nan=False, **bounds)]


Probability = _number(ge=0.0, le=1.0)
NonNegative = _number(ge=0.0)
Seconds = _number(gt=0.0)
"""A pass: positive, finite seconds."""
SmallSeconds = _number(ge=0.0, le=10.0)
"""A fixed cost of a step or a round trip: seconds, at most 10."""
PassScale = _number(ge=1e-6, le=10.0)
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]


def _absent_if_empty(default: Any) -> BeforeValidator:
    """``null``, ``[]`` and ``{}`` read as the field's default (hand-written profiles write them)."""
    return BeforeValidator(lambda value: default() if not value else value)


def _increasing(values: list) -> list:
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError(f"must be strictly increasing, got {values!r}")
    return values


Axis = Annotated[list[PositiveInt], Field(min_length=1), AfterValidator(_increasing)]
"""A table's batch or token axis: a non-empty, strictly increasing list of positive integers."""
Probabilities = Annotated[list[Probability], Field(min_length=1)]
Column = Annotated[list[NonNegative], Field(min_length=1)]
"""One figure per measured level of a service calibration."""


def _ranks(ranks: int) -> int:
    if ranks < 2:
        raise ValueError("must map a rank count >= 2 to {pass_scale}")
    return ranks


class _Schema(BaseModel):
    # Attribute docstrings become the fields' descriptions (and the JSON Schema's).
    model_config = ConfigDict(use_attribute_docstrings=True)


# ====================================================================== cost tables
class TimedCall(_Schema):
    """What one column of a drafter table timed (informational)."""

    call: str
    """"draft" or "speculate"."""
    block: int
    tail: int | None = None
    """A Draft's context tokens the drafter had not seen (2: a miss; longer: a new sequence)."""
    candidates: int | None = None
    """A Speculate's outcomes drafted ahead (``c``)."""
    tokens: int
    """New nodes per row: ``tail + g`` for a Draft, ``B + c * (1 + g)`` for a Speculate."""


class CostTable(_Schema):
    """Seconds of one pass by (batch rows, new tokens per row); see the module docstring."""

    model_config = ConfigDict(frozen=True)  # costs are memoised: a table never changes

    name: str | None = None
    """The model that was timed."""
    context: int | None = None
    """Cached tokens before each timed pass."""
    calls: list[TimedCall] | None = None
    """Which call gave each column (drafter tables)."""
    batch: Axis
    tokens: Axis
    seconds: list[list[Seconds]]
    """One row per batch of one value per token count: positive, finite seconds."""
    _memo: dict = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _one_value_per_point(self) -> CostTable:
        rows, columns = len(self.batch), len(self.tokens)
        if len(self.seconds) != rows or any(len(row) != columns for row in self.seconds):
            raise FieldError("seconds", f"must be a list of {rows} rows (one per batch) of {columns} numbers (one "
                                        "per token count)")
        return self

    def __call__(self, batch: int, tokens: int) -> float:
        # The simulator's innermost call: the memo is read from pydantic's private values directly,
        # as `self._memo` goes through a `__getattr__` that costs more than the lookup itself.
        memo = self.__pydantic_private__["_memo"]
        key = (batch, tokens)
        cost = memo.get(key)
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
            cost = memo[key] = max(cost, 0.0)
        return cost

    def to_json(self) -> dict:
        """The axes and the seconds (what `CostTable` takes back)."""
        return {"batch": self.batch, "tokens": self.tokens, "seconds": self.seconds}

    def with_seconds(self, seconds: list[list[float]]):
        """This table (its kind, axes and what it timed) with other seconds, checked anew."""
        return type(self).model_validate({**self.model_dump(exclude_unset=True), "seconds": seconds})


class DrafterTable(CostTable):
    """The drafter's Draft calls (a fresh block)."""

    group_sizes: list[Annotated[int, Field(strict=True, ge=2)]] = []
    """The drafter's mask-group sizes (empty: a group is exactly block + 1)."""


def _segment(axis: list[int], x: float) -> tuple[int, float]:
    """(index, weight) of x on a sorted axis: clamped below, extended linearly above."""
    if len(axis) == 1 or x <= axis[0]:
        return 0, 0.0
    for i in range(len(axis) - 1):
        if x <= axis[i + 1]:
            return i, (x - axis[i]) / (axis[i + 1] - axis[i])
    i = len(axis) - 2
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


# ====================================================================== what speculation earns
class Acceptance(_Schema):
    """Acceptance measured at one block size (``by_block``)."""

    acceptance_per_pos: Probabilities
    """P(positions 0..i all accepted), per position."""
    hit_rate: Probability
    """P(a candidate was ready for the outcome), async mode."""
    tau: float | None = None
    """The measured mean accepted length + 1 (informational)."""


class BlockSamples(_Schema):
    """Verified full blocks at ``block_size``, as measured: the drafter's confidence per position
    and the accepted length, together, and which prompt each came from."""

    confidence: list[list[Probability]]
    """Per sample, ``block_size`` confidences."""
    accepted: list[NonNegativeInt]
    """Per sample, the accepted length (0..block_size)."""
    prompt: Annotated[list[NonNegativeInt], _absent_if_empty(list)] = []
    """Per sample, the index of its prompt in the profile's prompts (`specd bench serve`'s pool,
    in its order), or empty: not recorded. Acceptance is the prompt's as much as the drafter's,
    so a replayed request that names its prompt draws its own."""

    @model_validator(mode="after")
    def _one_length(self) -> BlockSamples:
        if not self.accepted or len(self.confidence) != len(self.accepted):
            raise FieldError("", "must be {confidence: [[...], ...], accepted: [...]} of the same non-zero length")
        if self.prompt and len(self.prompt) != len(self.accepted):
            raise FieldError("prompt", "must be one prompt index (an integer >= 0) per sample, or absent")
        return self


# ====================================================================== the engine and the services
class Overhead(_Schema):
    """The engine's seconds per step outside target passes and blocking drafter calls:
    ``step_seconds + seq_seconds`` per running sequence, speculating, and decoding plain."""

    step_seconds: SmallSeconds = 0.0
    seq_seconds: SmallSeconds = 0.0
    plain_step_seconds: SmallSeconds | None = None
    """Decoding plain (no drafter); None: not measured."""
    plain_seq_seconds: SmallSeconds | None = None


class Serving(_Schema):
    """A verifier service's costs beyond the in-process passes, by mean rows per pass (measured by
    `services.calibrate`; piecewise linear between the measured points, flat past them). The
    columns hold one figure per measured concurrency level; the ones the simulator reads are
    ``rows``, ``overhead_seconds``, ``target_scale`` and ``draft_scale``, the rest record the
    calibration run."""

    concurrency: list[int] | None = None
    """The closed loop's clients."""
    trace: list[list[list[int | None]]] | None = None
    """Per level, its requests in the order sent: ``[prompt tokens, output tokens, prompt index]``."""
    requests: list[int] | None = None
    rows: Annotated[Column, AfterValidator(_increasing)]
    """Mean rows per target pass: strictly increasing."""
    passes: list[int] | None = None
    target_seconds: list[float] | None = None
    """Mean seconds of an in-service target pass."""
    overhead_seconds: Column
    """Seconds of a step outside its target pass (admission, sampling, streaming deltas; a
    speculating service's blocking drafter calls left out too)."""
    tokens_per_s: list[float] | None = None
    """Output tokens/s the clients saw."""
    tokens_per_row: list[float] | None = None
    """Speculating: 1 + the mean verified block, the pass's shape."""
    draft_seconds: list[float] | None = None
    """Speculating: the mean wait for one blocking Draft call."""
    rounds_target_seconds: list[list[float]] | None = None
    """Per level, every calibration round's mean pass seconds (the columns are the median round's)."""
    target_scale: Column
    """The in-service target pass over the target table's cost for the same pass."""
    draft_scale: Annotated[list[NonNegative], _absent_if_empty(list)] = []
    """A speculating service's blocking Draft wait over the drafter table's for the same calls
    (empty: 1)."""

    @model_validator(mode="after")
    def _one_length(self) -> Serving:
        if not len(self.rows) == len(self.overhead_seconds) == len(self.target_scale):
            raise FieldError("", "needs rows, overhead_seconds and target_scale of one length")
        if self.draft_scale and len(self.draft_scale) != len(self.rows):
            raise FieldError("draft_scale", f"must be a list of numbers as long as rows, got {self.draft_scale!r}")
        return self

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


class ServiceCosts(_Schema):
    """``serving``: what the services cost beyond the in-process passes (`services.calibrate`)."""

    drafter_round_trips: bool = False
    """The drafter tables hold whole round trips through a replica (``rpc_seconds``: only what a
    network adds), not bare passes."""
    verifier: Serving | None = None
    """A plain verifier service; None: not measured."""
    speculative: Serving | None = None
    """The same verifier speculating (async) with a drafter replica; None: not measured."""
    speculative_sync: Serving | None = None
    """The same drafting synchronously; None: not measured (sync borrows async's)."""


class ObservedWorkload(_Schema):
    """The lengths the acceptance run saw (`specd plan`'s default workload)."""

    prompt_tokens: list[PositiveInt] = []
    output_tokens: list[PositiveInt] = []
    max_tokens: int | None = None


class TensorParallel(_Schema):
    """A verifier of N ranks, measured."""

    pass_scale: PassScale
    """Its target pass over the target table's (which is one GPU's)."""


# ====================================================================== the profile
class Profile(_Schema):
    """A validated profile (module docstring); read one with `load_profile` or `parse_profile`."""

    version: int = SCHEMA_VERSION
    machine: str | dict[str, Any] | None = None
    """What it was measured on (free form)."""
    notes: Annotated[str, BeforeValidator(lambda v: v if isinstance(v, str) else json.dumps(v))] = ""
    """Assumptions (a hand-written profile must state its own) and how it was measured."""
    target: CostTable
    """The target's verification passes."""
    drafter: DrafterTable
    """The drafter's Draft calls (a fresh block)."""
    speculate: CostTable | None = None
    """The drafter's Speculate calls (candidates for the block under verification); None: the
    Draft table stands in (`speculate_table`)."""
    block_size: PositiveInt
    """The block the acceptance was measured at."""
    acceptance_per_pos: Probabilities
    """P(positions 0..i all accepted) at ``block_size``."""
    confidence_per_pos: Annotated[list[Probability], _absent_if_empty(list)] = []
    """The drafter's mean confidence per position at ``block_size`` (what the engine's cost model
    is shown); empty: its acceptance."""
    block_samples: Annotated[BlockSamples | None, _absent_if_empty(lambda: None)] = None
    hit_rate: Probability
    """P(a candidate was ready for the outcome), async mode."""
    tau: float | None = None
    """The measured mean accepted length + 1 (informational)."""
    candidate_budget: Annotated[int, Field(ge=0)] = 4
    """Outcomes drafted ahead per sequence when measured."""
    by_block: Annotated[dict[Annotated[int, Field(ge=0)], Acceptance], _absent_if_empty(dict)] = {}
    """Acceptance measured at other block sizes."""
    rpc_seconds: SmallSeconds = 0.0005
    """One drafter round trip's fixed cost."""
    overhead: Annotated[Overhead, _absent_if_empty(Overhead)] = Field(default_factory=Overhead)
    padded_rows: bool = True
    """Each busy row is padded to the longest (specd's engine); false: the rows' real tokens only
    (packed)."""
    workload: Annotated[ObservedWorkload, _absent_if_empty(ObservedWorkload)] = Field(default_factory=ObservedWorkload)
    drafter_pass: CostTable | None = None
    """With ``serving.drafter_round_trips``: the bare Draft passes the round trips replaced."""
    speculate_pass: CostTable | None = None
    """... and the bare Speculate passes."""
    serving: ServiceCosts = Field(default_factory=ServiceCosts)
    tensor_parallel: Annotated[dict[Annotated[int, AfterValidator(_ranks)], TensorParallel],
                               _absent_if_empty(dict)] = {}
    """Ranks N -> a tensor-parallel verifier's measured pass; `specd plan --tensor-parallel N`
    assumes an ideal split plus all-reduce latency without it."""

    @field_validator("version", mode="before")
    @classmethod
    def _readable(cls, version: Any) -> int:
        if version != SCHEMA_VERSION:
            raise ValueError(f"is {version!r}; this specd reads version {SCHEMA_VERSION}")
        return version

    @model_validator(mode="after")
    def _samples_fit_the_block(self) -> Profile:
        samples = self.block_samples
        for row, accepted in zip(samples.confidence, samples.accepted) if samples is not None else ():
            if len(row) != self.block_size:
                raise FieldError("block_samples.confidence",
                                 f"each row must hold block_size ({self.block_size}) probabilities, got {row!r}")
            if accepted > self.block_size:
                raise FieldError("block_samples.accepted", f"each must be an integer in 0..{self.block_size}, "
                                                           f"got {accepted!r}")
        return self

    @property
    def speculate_table(self) -> CostTable:
        """What a Speculate call costs: the ``speculate`` table, else the Draft table."""
        return self.drafter if self.speculate is None else self.speculate

    def group_size(self, block: int) -> int:
        """Mask-group size the drafter uses for a block of ``block`` tokens (+1 bonus guess)."""
        fitting = [g for g in self.drafter.group_sizes if g >= block + 1]
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

    def to_json(self) -> dict:
        """The profile as its JSON object: the keys it was given or built with, no others."""
        return self.model_dump(mode="json", exclude_unset=True)


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


# ====================================================================== acceptance from a benchmark
def bench_acceptance(bench: dict, *, method: str, temperature: float = 0.0, source: str = "bench decode JSON") -> dict:
    """What `specd bench decode` measured a method to accept, as profile fields: the mean over
    domains of ``accept_per_pos`` at the longest block that method's rows verified, at
    ``temperature``, from its smallest batch. Rows of ``--fixed-block`` runs are preferred: they
    verify every block at full length, so position i's rate is P(positions 0..i all accepted), the
    profile's meaning; the cost model's rows verify shorter blocks and see the later positions less.
    An async method's measured hit rate comes along (``hit_rate``; None for sync methods)."""
    rows = [r for r in bench.get("rows", []) if r.get("method") == method
            and abs(float(r.get("temperature", -1)) - temperature) < 1e-9 and r.get("accept_per_pos")]
    if not rows:
        seen = sorted({(r.get("method"), r.get("temperature")) for r in bench.get("rows", [])}, key=str)
        raise ProfileError(f"{source} has no rows of method {method!r} at temperature {temperature:g} with an "
                           f"acceptance per position (it has {seen or 'no rows'}): run `specd bench decode "
                           f"--methods {method} --fixed-block --block-sizes 16 --temperatures {temperature:g}`")
    if any(r.get("fixed_block") for r in rows):
        rows = [r for r in rows if r.get("fixed_block")]
    batch = min(r["batch"] for r in rows)
    rows = [r for r in rows if r["batch"] == batch]
    block = max(r["block"] for r in rows)
    rows = [r for r in rows if r["block"] == block]
    per_domain = [r["accept_per_pos"][:block] + [0.0] * (block - len(r["accept_per_pos"])) for r in rows]
    acceptance = [sum(values) / len(values) for values in zip(*per_domain)]
    hits = [r["hit_rate"] for r in rows if isinstance(r.get("hit_rate"), (int, float)) and r["hit_rate"] == r["hit_rate"]]
    return {"block_size": block, "acceptance_per_pos": acceptance, "tau": sum(r["tau"] for r in rows) / len(rows),
            "hit_rate": sum(hits) / len(hits) if method.endswith("async") and hits else None,
            "domains": sorted({r["domain"] for r in rows}), "batch": batch,
            "fixed_block": bool(rows[0].get("fixed_block"))}


def with_acceptance(profile: Profile, measured: dict, *, label: str) -> Profile:
    """The profile's costs with ``measured`` acceptance (`bench_acceptance`) in place of its own:
    a projection of that drafter's acceptance onto the profile's hardware. The per-block tables and
    the confidence samples are dropped (they described the old drafter); the hit rate is the
    measured one where the method had candidates, else the profile's at that block."""
    data = profile.to_json()
    for key in ("by_block", "confidence_per_pos", "block_samples"):
        data.pop(key, None)
    block = measured["block_size"]
    hit_rate = measured["hit_rate"] if measured["hit_rate"] is not None else profile.hit_rate_for(block)
    data.update(block_size=block, acceptance_per_pos=measured["acceptance_per_pos"], tau=measured["tau"],
                hit_rate=hit_rate, notes=f"PROJECTION: acceptance {label}; costs: {profile.notes}")
    return parse_profile(data, source=label)


# ====================================================================== reading one
def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile JSON file (the schema: `Profile`)."""
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
    """Validate a profile's JSON object; ProfileError names the first missing or bad field."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile is a JSON object, got {type(data).__name__}")
    try:
        return Profile.model_validate(data)
    except ValidationError as err:
        raise ProfileError(_describe(err, source)) from None


def _describe(err: ValidationError, source: str) -> str:
    """pydantic's first error as ``field 'a.b' [at item [i]]: what it must be, got what it was``."""
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = list(first["loc"])
    if "[key]" in loc:  # a bad key of a mapping: the key is the field
        loc = loc[:loc.index("[key]")]
    named = max((i + 1 for i, part in enumerate(loc) if isinstance(part, str)), default=len(loc))
    path, items = [str(part) for part in loc[:named]], loc[named:]  # trailing integers index a list
    error = first.get("ctx", {}).get("error")
    if isinstance(error, FieldError):
        path += [part for part in error.where.split(".") if part]
    at = f" at item {''.join(f'[{i}]' for i in items)}" if items else ""
    if first["type"] == "missing":
        what = f"{at} is missing"
    elif isinstance(error, ValueError):  # one of the checks above: its own words
        what = f"{at}: {error}"
    elif first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        what = f"{at}: must be an object, got {_short(first['input'])}"
    else:
        what = f"{at}: {first['msg'][0].lower()}{first['msg'][1:]}, got {_short(first['input'])}"
    more = f"; {len(errors) - 1} more problem(s)" if len(errors) > 1 else ""
    return f"{source}: field {'.'.join(path)!r}{what}{more} (schema: specd/plan/profile.py)"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
