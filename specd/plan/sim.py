"""A discrete-event simulation (SimPy) of specd's serving pipeline at cluster scale.

It models what the services do, step by step, with costs from a profile (`specd.bench.profile`):

- **Verifiers** (``verifiers`` replicas) are `specd.serving.ServingEngine` loops. Each step admits
  waiting requests into free rows (up to ``max_num_seqs``), then runs ONE target pass over every
  running sequence. A row's new tokens are 1 (the last committed token) + the verified block
  ``L``, or prompt + ``L`` in a sequence's first step (prefill rides in the same pass, as in
  `SpeculativeEngine`). The pass covers the busy rows only (the engine hands rows out lowest
  first and passes the busy prefix); with ``padded_rows`` (specd's engine: each row padded to the
  longest) it costs ``target(running, longest row)``; without (a packed, vLLM-style engine)
  ``target(running, mean tokens per row)``, the same total tokens. Then the step's time outside
  the pass. Where the profile measured a verifier service (``serving.verifier``, by mean rows
  per pass), the pass costs the table times the service's measured in-service ratio and the
  step adds the service's measured overhead (admission, sampling, streaming deltas to clients)
  plus, when speculating, what speculation adds to the engine's step in process (verification,
  candidate bookkeeping: its speculating overhead line minus its plain one) — or, where the
  profile measured a speculating verifier service too (``serving.speculative``: async;
  ``serving.speculative_sync``: sync, else sync borrows async's), that service's pass ratio and
  overhead, and — sync — its blocking Draft calls cost the drafter table times that service's
  measured ratio (``draft_scale``: its wait for a Draft over the simulator's replay of the same
  level). An async service's ratio is measured too but not applied: applying it moved the
  simulated async rows away from `specd bench serve`'s, so that wait is spent somewhere the
  simulator already prices or does not model, an open question (the figures: README, "Deploying,
  and choosing the drafter:verifier split"). Otherwise the engine's in-process line
  ``step_seconds + seq_seconds * rows``.
- **Blocks.** ``L`` is the configured block, or with ``adaptive_block`` (the verifier's default)
  what the engine's own `specd.cost_model.CostModel` picks, one per verifier, fed as the engine
  feeds it: each pass's simulated seconds against ``1 + L`` tokens per row (passes that prefill
  a prompt left out, as the engine leaves them out), each sequence's accepted length against the
  confidence of its verified positions, with the drafter's mean confidence per position from the profile (where
  measured; else its acceptance) as each block's confidence, calibrated against the accepted
  lengths as the engine calibrates it. Every ``explore_every``-th choice verifies twice the
  chosen length (the cost model's exploration).
- **Accepted length** ``k`` per sequence per step is drawn from the profile's acceptance per
  position ``a_i = P(positions 0..i accepted)``: ``P(k >= i + 1) = a_i``, i.e. the conditional
  ``P(accept i | all before) = a_i / a_{i-1}``. The step commits ``k + 1`` tokens (fewer at the
  end of the output). Draws are independent across steps and sequences. Where the profile has
  ``block_samples`` (verified blocks as measured: the drafter's confidence per position and the
  accepted length, together), each sequence's step draws one instead (a request that names its
  prompt, ``TraceRequest.prompt``, draws one of that prompt's): its confidence goes to the
  cost model and ``min(its accepted length, L)`` is accepted — the engine verifies long where
  the drafter is confident, and that is where tokens are accepted.
- **async** (D3D): a Speculate call goes out with the pass and the step waits for
  ``max(pass, Speculate reply)``; afterwards each sequence *hits* with probability ``hit_rate``
  (independent of k: an assumption) and keeps its next block, or misses and needs a blocking
  Draft before its next pass. A new request's first step always needs a blocking Draft.
  **sync**: every step waits for a Draft round trip of every sequence before its pass.
  **plain**: one token per pass, no drafter.
- **Drafters** (``drafters`` replicas) run one packed pass at a time, first come first served
  (the drafter service's lock). With ``drafter_devices`` set, the replicas share that many devices
  (replica i runs on device i mod n; a device runs one pass at a time): two replica processes on
  one CPU core, or on one GPU, split a step into two passes that take turns, each paying its own
  fixed cost — where one replica would have run one pass over both parts. A call's part for one replica costs ``drafter(rows, tokens)``
  for a Draft and ``speculate(rows, tokens)`` for a Speculate over the part's sequences, padded
  to the longest row or packed (the mean) like the target. A row's
  tokens: Draft ``tail + g`` (tail = the prompt for a new sequence, 1 after an async miss — the
  accepted tokens were known nodes of the last Speculate pass — and ``k + 1`` in sync mode),
  Speculate ``L + c * (1 + g)`` for ``c = candidate_budget`` outcomes, ``g`` the mask group for
  the block. Each call pays ``rpc_seconds`` (half each way): a profile whose drafter tables are
  round trips through a replica (``serving.drafter_round_trips``) already holds loopback gRPC, and
  its ``rpc_seconds`` is only what a network adds.
- **Placement** (`services.verifier.drafter_pool`): a sequence sticks to the replica that had the
  fewest of this verifier's live sequences when it arrived (ties: a random one of them), so one
  verifier's step is split across replicas and its parts run concurrently (``spread``).
  ``affinity`` pins each verifier to one replica instead — a what-if, not what the pool does.
- **Clients**: a closed loop of ``concurrency`` clients (each sends its next request when the
  previous finishes, as `specd bench serve` does), Poisson arrivals at ``rate`` requests/s, or a
  trace of (arrival, prompt, output) lengths. Requests reach a verifier round robin (or the least
  loaded) after one network hop; tokens reach the client one hop after the step that made them.

Reported like `specd bench serve`: output tokens/s over the whole run (first arrival to last
finish), TTFT and TPOT p50/p99 (TPOT = (finish - first token) / (tokens - 1)), plus drafter and
verifier utilisation, τ, hit rate, and blocking Draft calls.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import simpy

from specd.cost_model import CostModel
from specd.plan.profile import Profile

MODES = ("async", "sync", "plain")
PLACEMENTS = ("spread", "affinity")
BALANCERS = ("round_robin", "least_loaded")


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One deployment to simulate; None fields take the profile's value."""

    mode: str = "async"
    """"async" (D3D: draft during verification), "sync" (draft after it) or "plain"."""
    verifiers: int = 1
    drafters: int = 1
    block_size: int = 8
    """Most drafted tokens verified per sequence per pass (the verifier's --block-size)."""
    max_num_seqs: int = 16
    """Verifier rows (--max-num-seqs)."""
    candidate_budget: int = 4
    drafter_devices: int = 0
    """Devices the drafter replicas share (0: one each); replica i runs on device i mod n."""
    adaptive_block: bool = True
    explore_every: int = 16
    padded_rows: bool | None = None
    placement: str = "spread"
    balancer: str = "round_robin"
    rpc_seconds: float | None = None
    hit_rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer must be one of {BALANCERS}, got {self.balancer!r}")
        if self.verifiers < 1:
            raise ValueError(f"a deployment needs at least one verifier, got {self.verifiers}")
        if self.mode != "plain" and self.drafters < 1:
            raise ValueError(f"{self.mode} mode needs at least one drafter replica; use mode 'plain' for none")
        if self.mode != "plain" and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 with a drafter, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.drafter_devices < 0:
            raise ValueError(f"drafter_devices must be >= 0 (0: one device per replica), got {self.drafter_devices}")
        if self.hit_rate is not None and not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be in [0, 1], got {self.hit_rate}")


# ====================================================================== workloads
@dataclass(kw_only=True, slots=True)
class Lengths:
    """A token-count distribution: ``fixed`` n, ``uniform`` lo..hi, ``geometric`` with a mean
    (capped at ``high``), or ``empirical`` draws from observed values."""

    kind: str
    values: tuple[int, ...]

    @staticmethod
    def parse(text: str | int | Sequence[int]) -> Lengths:
        """``"64"``, ``"uniform:16:128"``, ``"geometric:64[:512]"``, or a list of observed lengths."""
        if isinstance(text, int):
            text = str(text)
        if not isinstance(text, str):
            values = tuple(int(v) for v in text)
            if not values or min(values) < 1:
                raise ValueError(f"observed lengths must be a non-empty list of positive integers, got {list(text)[:8]}")
            return Lengths(kind="empirical", values=values)
        kind, _, rest = text.partition(":")
        try:
            if not rest:
                lengths = Lengths(kind="fixed", values=(int(kind),))
            elif kind == "uniform":
                low, high = (int(v) for v in rest.split(":"))
                lengths = Lengths(kind="uniform", values=(low, high))
            elif kind == "geometric":
                parts = [int(v) for v in rest.split(":")]
                lengths = Lengths(kind="geometric", values=(parts[0], parts[1] if len(parts) > 1 else 1 << 30))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad length spec {text!r}: use N, uniform:LOW:HIGH or geometric:MEAN[:MAX]") from None
        if min(lengths.values) < 1 or (lengths.kind == "uniform" and lengths.values[0] > lengths.values[1]):
            raise ValueError(f"bad length spec {text!r}: lengths are positive and LOW <= HIGH")
        return lengths

    def sample(self, rng: np.random.Generator, num: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(num, self.values[0], dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.values[0], self.values[1] + 1, num)
        if self.kind == "geometric":
            return np.minimum(rng.geometric(1.0 / self.values[0], num), self.values[1])
        return rng.choice(np.asarray(self.values, dtype=np.int64), num)


@dataclass(kw_only=True, slots=True)
class TraceRequest:
    arrival_seconds: float | None
    prompt_tokens: int
    output_tokens: int
    prompt: int | None = None
    """The prompt's index in the profile's block samples (``block_samples.prompt``): its steps
    draw that prompt's verified blocks. None: any prompt's."""


def replayed(trace: list[list[int | None]]) -> list[TraceRequest]:
    """A measured run's requests, in the order it sent them — ``[prompt tokens, output tokens]``
    or ``[prompt tokens, output tokens, prompt index]`` each (`specd bench serve`'s rows and the
    profile's calibration levels) — as a closed loop replays them."""
    return [TraceRequest(arrival_seconds=None, prompt_tokens=int(entry[0]), output_tokens=max(int(entry[1]), 1),
                         prompt=int(entry[2]) if len(entry) > 2 and entry[2] is not None else None)
            for entry in trace]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """JSONL, one request a line: ``arrival_seconds`` (optional) and either ``prompt_tokens`` /
    ``output_tokens`` counts or ``prompt_ids`` / ``output_ids`` lists (specd's trace records).
    Older traces name the arrival ``arrival_s``; it is read too."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt_tokens"] if "prompt_tokens" in item else len(item["prompt_ids"])
            output = item["output_tokens"] if "output_tokens" in item else len(item["output_ids"])
            arrival = item.get("arrival_seconds", item.get("arrival_s"))
            requests.append(TraceRequest(arrival_seconds=None if arrival is None else float(arrival),
                                         prompt_tokens=int(prompt), output_tokens=int(output)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{number}: a trace line needs prompt_tokens|prompt_ids and "
                             f"output_tokens|output_ids (and optionally arrival_seconds): {err!r}") from None
        if requests[-1].prompt_tokens < 1 or requests[-1].output_tokens < 1:
            raise ValueError(f"{path}:{number}: prompt and output need at least one token")
    if not requests:
        raise ValueError(f"{path}: the trace is empty")
    return requests


@dataclass(kw_only=True, slots=True)
class Workload:
    """Who sends what: exactly one of ``concurrency`` (closed loop), ``rate`` (Poisson) or a
    ``trace`` with arrival times; a trace without them is replayed in order by the closed loop."""

    requests: int = 256
    concurrency: int = 0
    rate: float = 0.0
    trace: list[TraceRequest] | None = None
    prompt_tokens: Lengths = field(default_factory=lambda: Lengths.parse(96))
    output_tokens: Lengths = field(default_factory=lambda: Lengths.parse(64))

    def __post_init__(self) -> None:
        timed = self.trace is not None and all(t.arrival_seconds is not None for t in self.trace)
        if sum((self.concurrency > 0, self.rate > 0, timed)) != 1:
            raise ValueError("give exactly one of: concurrency (closed loop), rate (Poisson arrivals), "
                             "or a trace with arrival_seconds on every line")
        if self.concurrency < 0 or self.rate < 0 or self.requests < 1:
            raise ValueError("concurrency and rate must be >= 0 and requests >= 1")


# ====================================================================== results
@dataclass(kw_only=True, slots=True)
class SimResult:
    mode: str
    verifiers: int
    drafters: int
    block_size: int
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    tau: float
    """Mean accepted length + 1 per sequence per target pass, as the engine counts it."""
    hit_rate: float
    target_passes: int
    target_seconds_per_pass: float
    """Mean seconds of one target pass (the profile's cost of the pass's shape)."""
    overhead_seconds_per_step: float
    """Mean seconds of a step outside the target pass and drafter waits."""
    blocking_draft_calls: int
    draft_wait_seconds_per_call: float
    """Mean seconds a verifier waited for one blocking Draft call (round trip and queueing)."""
    mean_batch: float
    verifier_utilisation: float
    drafter_utilisation: float
    """Mean busy fraction of the drafter replicas (0 without drafters)."""
    drafter_utilisation_max: float


def _percentile(values: list[float], q: float) -> float:
    """Nearest rank, as `specd bench serve` computes it."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ====================================================================== the simulation
class _Request:
    __slots__ = ("arrival", "done", "emitted", "finish", "first_token", "key", "output", "prompt")

    def __init__(self, prompt: int, output: int, arrival: float, done: simpy.Event, key: int | None = None) -> None:
        self.prompt, self.output, self.arrival, self.done, self.key = prompt, output, arrival, done, key
        self.first_token = self.finish = None
        self.emitted = 0


class _Seq:
    __slots__ = ("has_block", "new", "replica", "request", "tail")

    def __init__(self, request: _Request) -> None:
        self.request = request
        self.new = True  # its first pass prefills the prompt
        self.has_block = False
        self.replica: _Drafter | None = None
        self.tail = request.prompt  # context tokens its drafter has not seen


class _Drafter:
    __slots__ = ("busy", "device", "index", "lock")

    def __init__(self, env: simpy.Environment, index: int, device: simpy.Resource | None) -> None:
        self.index, self.lock, self.busy = index, simpy.Resource(env, capacity=1), 0.0
        self.device = device  # shared with other replicas, or None: its own


class _Verifier:
    __slots__ = ("busy", "cost", "draws", "index", "placed", "running", "steps", "waiting", "wake")

    def __init__(self, index: int, num_drafters: int, explore_every: int) -> None:
        self.index = index
        self.waiting: deque[_Request] = deque()
        self.running: list[_Seq] = []
        self.wake: simpy.Event | None = None
        self.steps = 0
        self.busy = 0.0
        self.placed = [0] * num_drafters  # this verifier's live sequences per drafter replica
        self.cost = CostModel(explore_every=explore_every)  # the engine's block chooser
        self.draws: np.ndarray | None = None  # this step's block sample per running sequence


class Simulation:
    """One run of one deployment under one workload (module docstring)."""

    def __init__(self, profile: Profile, config: SimConfig, workload: Workload) -> None:
        self.profile, self.config, self.workload = profile, config, workload
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(config.seed)
        self.padded = profile.padded_rows if config.padded_rows is None else config.padded_rows
        self.hop = (profile.rpc_seconds if config.rpc_seconds is None else config.rpc_seconds) / 2
        self.speculative = config.mode != "plain" and config.block_size > 0
        block = config.block_size if self.speculative else 0
        self.acceptance = np.asarray(profile.acceptance(block) if block else [], dtype=np.float64)
        self.hit_rate = config.hit_rate if config.hit_rate is not None else profile.hit_rate_for(block)
        self.group = profile.group_size(block) if block else 0
        # The verifier service's measured costs: speculating, the one measured in this mode where
        # there is one (sync borrows async's where only that was measured); else the plain one's.
        services = profile.serving
        measured = {"sync": (services.speculative_sync, services.speculative),
                    "async": (services.speculative,)}.get(config.mode, ()) if self.speculative else ()
        self.serving = next((s for s in measured if s is not None), services.verifier)
        self.serving_speculative = self.serving is not None and self.serving is not services.verifier
        self.verifiers = [_Verifier(i, config.drafters, config.explore_every) for i in range(config.verifiers)]
        # What the engine's cost model is shown: the drafter's own confidence, where measured.
        self.confidence = profile.confidence(block) if block else []
        # Verified blocks as measured (confidence per position, accepted length), drawn per
        # sequence per step: the engine verifies long where the drafter is confident, and that is
        # where it is accepted. Without samples (or past their length): mean confidence, and
        # independent draws from the acceptance.
        self.samples = None
        self.by_prompt: dict[int, np.ndarray] = {}  # prompt index -> its samples' rows
        samples = profile.block_samples
        if block and samples is not None and block <= len(samples.confidence[0]):
            confidence = np.asarray(samples.confidence, dtype=np.float64)[:, :block]
            self.samples = (confidence, np.minimum(np.asarray(samples.accepted), block))
            prompts = np.asarray(samples.prompt, dtype=np.int64)
            for prompt in np.unique(prompts):
                self.by_prompt[int(prompt)] = np.flatnonzero(prompts == prompt)
        num_drafters = config.drafters if self.speculative else 0
        shared = [simpy.Resource(self.env, capacity=1) for _ in range(config.drafter_devices)]
        self.drafters = [_Drafter(self.env, i, shared[i % len(shared)] if shared else None) for i in range(num_drafters)]
        self.finished: list[_Request] = []
        self.target_seconds = self.overhead_seconds = self.draft_wait_seconds = 0.0
        self.passes = self.pass_seqs = self.accepted = self.committed = self.lookups = self.hits = self.blocking = 0
        self._next_verifier = 0

    # ------------------------------------------------------------------ clients
    def _requests(self) -> list[tuple[float | None, int, int, int | None]]:
        w = self.workload
        if w.trace is not None:
            return [(t.arrival_seconds, t.prompt_tokens, t.output_tokens, t.prompt) for t in w.trace]
        prompts = w.prompt_tokens.sample(self.rng, w.requests)
        outputs = w.output_tokens.sample(self.rng, w.requests)
        return [(None, int(p), int(o), None) for p, o in zip(prompts, outputs)]

    def _submit(self, prompt: int, output: int, key: int | None = None):
        request = _Request(prompt, output, self.env.now, self.env.event(), key)
        yield self.env.timeout(self.hop)
        if self.config.balancer == "least_loaded":
            verifier = min(self.verifiers, key=lambda v: len(v.waiting) + len(v.running))
        else:
            verifier = self.verifiers[self._next_verifier]
            self._next_verifier = (self._next_verifier + 1) % len(self.verifiers)
        verifier.waiting.append(request)
        if verifier.wake is not None and not verifier.wake.triggered:
            verifier.wake.succeed()
        return request

    def _closed_client(self, queue: deque):
        while queue:
            _, prompt, output, key = queue.popleft()
            request = yield self.env.process(self._submit(prompt, output, key))
            yield request.done

    def _open_arrivals(self, items: list[tuple[float | None, int, int, int | None]]):
        if self.workload.rate > 0:
            gaps = self.rng.exponential(1.0 / self.workload.rate, len(items))
            times = np.cumsum(gaps) - gaps[0]
        else:
            times = [t for t, _, _, _ in items]
        order = sorted(range(len(items)), key=lambda i: times[i])
        for i in order:
            if times[i] > self.env.now:
                yield self.env.timeout(times[i] - self.env.now)
            self.env.process(self._submit(*items[i][1:]))

    # ------------------------------------------------------------------ the verifier loop
    def _verifier(self, v: _Verifier):
        env, config = self.env, self.config
        while True:
            while v.waiting and len(v.running) < config.max_num_seqs:
                self._admit(v, v.waiting.popleft())
            if not v.running:
                v.wake = env.event()
                yield v.wake
                continue
            start = env.now
            v.steps += 1
            running = v.running
            if self.speculative and config.mode == "sync":
                for seq in running:
                    seq.has_block = False
            need = [s for s in running if not s.has_block] if self.speculative else []
            if need:
                self.blocking += 1
                waiting = env.now
                # A measured sync service prices its blocking Drafts as its own client waited for
                # them (async's measured ratio is recorded, not applied: module docstring).
                scale = self.serving.draft(len(running)) if self.serving_speculative and config.mode == "sync" else 1.0
                yield from self._call(need, "draft", 0, scale)
                self.draft_wait_seconds += env.now - waiting
                for seq in need:
                    seq.has_block, seq.tail = True, 0
            rows = len(running)  # the engine passes the busy rows only (handed out lowest first)
            length = self._verify_length(v, rows) if self.speculative else 0
            tokens = _row_tokens([(s.request.prompt if s.new else 1) + length for s in running], self.padded)
            cost = self.profile.target(rows, tokens)
            if self.serving is not None:
                cost *= self.serving.scale(rows)
            if self.speculative and not any(s.new for s in running):  # as the engine: no prefill passes
                v.cost.observe_pass(rows, length + 1, cost)
            self.target_seconds += cost
            target = env.timeout(cost)
            if self.speculative and config.mode == "async":
                yield target & env.process(self._call(running, "speculate", length))
            else:
                yield target
            overhead = self._overhead(len(running))
            if overhead > 0:
                self.overhead_seconds += overhead
                yield env.timeout(overhead)
            self._commit(v, length)
            v.busy += env.now - start

    def _overhead(self, rows: int) -> float:
        """A step's time outside its pass. Where the profile measured a verifier service (plain),
        that by rows, plus — when speculating — what speculation adds to the engine's step in
        process (its speculating line minus its plain one); else the engine's in-process line."""
        p = self.profile.overhead
        if self.serving is None:
            return p.step_seconds + p.seq_seconds * rows
        overhead = self.serving.overhead(rows)
        if self.serving_speculative:
            return overhead  # measured speculating: nothing to add
        if self.speculative and p.plain_step_seconds is not None:
            extra = (p.step_seconds - p.plain_step_seconds) + (p.seq_seconds - (p.plain_seq_seconds or 0.0)) * rows
            overhead += max(extra, 0.0)
        return overhead

    def _admit(self, v: _Verifier, request: _Request) -> None:
        seq = _Seq(request)
        if self.drafters:
            if self.config.placement == "affinity":
                index = v.index % len(self.drafters)
            else:
                fewest = min(v.placed)
                ties = [i for i, n in enumerate(v.placed) if n == fewest]
                index = ties[int(self.rng.integers(len(ties)))] if len(ties) > 1 else ties[0]
            v.placed[index] += 1
            seq.replica = self.drafters[index]
        v.running.append(seq)

    def _verify_length(self, v: _Verifier, rows: int) -> int:
        if self.samples is not None:
            v.draws = self.rng.integers(len(self.samples[1]), size=rows)
            for i, seq in enumerate(v.running[:rows]):  # a request that names its prompt draws its own
                own = self.by_prompt.get(seq.request.key)
                if own is not None:
                    v.draws[i] = own[self.rng.integers(len(own))]
        if not self.config.adaptive_block:
            return self.config.block_size
        if self.samples is not None:
            return v.cost.choose_length(self.samples[0][v.draws].tolist(), self.config.block_size)
        return v.cost.choose_length([self.confidence] * rows, self.config.block_size)

    def _commit(self, v: _Verifier, length: int) -> None:
        running = v.running
        num = len(running)
        if not length:
            accepted = np.zeros(num, dtype=np.int64)
        elif self.samples is not None:
            accepted = np.minimum(self.samples[1][v.draws], length)
        else:
            accepted = (self.rng.random(num)[:, None] < self.acceptance[None, :length]).sum(axis=1)
        hits = self.rng.random(num) < self.hit_rate if self.config.mode == "async" else np.zeros(num, dtype=bool)
        arrive = self.env.now + self.hop
        self.passes += 1
        self.pass_seqs += num
        self.accepted += int(accepted.sum())
        if length and self.config.adaptive_block:
            if self.samples is not None:
                shown = self.samples[0][v.draws, :length].tolist()
            else:
                shown = [list(self.confidence[:length])] * num
            for confidence, k in zip(shown, accepted.tolist()):
                v.cost.observe_acceptance(confidence, k)
        keep = []
        for seq, k, hit in zip(running, accepted.tolist(), hits.tolist()):
            request = seq.request
            emitted = min(k + 1, request.output - request.emitted)
            request.emitted += emitted
            self.committed += emitted
            if request.first_token is None:
                request.first_token = arrive
            seq.new = False
            if request.emitted >= request.output:
                request.finish = arrive
                self.finished.append(request)
                if seq.replica is not None:
                    v.placed[seq.replica.index] -= 1
                self.env.process(self._deliver(request))
                continue
            if self.speculative:
                self.lookups += self.config.mode == "async"
                self.hits += hit
                seq.has_block = hit
                # A miss: async, the accepted tokens were known nodes of the Speculate pass and
                # only the correction is new to the drafter; sync, all k + 1 are.
                seq.tail = 1 if self.config.mode == "async" else k + 1
            keep.append(seq)
        v.running = keep

    def _deliver(self, request: _Request):
        yield self.env.timeout(self.hop)
        request.done.succeed()

    # ------------------------------------------------------------------ drafter calls
    def _call(self, seqs: list[_Seq], kind: str, length: int, scale: float = 1.0):
        """One engine drafter call: split by replica, parts concurrent, wait for all; each part's
        pass costs the table times ``scale``."""
        parts: dict[_Drafter, list[_Seq]] = {}
        for seq in seqs:
            parts.setdefault(seq.replica, []).append(seq)
        if len(parts) == 1:
            ((replica, part),) = parts.items()
            yield from self._part(replica, part, kind, length, scale)
        else:
            yield self.env.all_of([self.env.process(self._part(r, p, kind, length, scale)) for r, p in parts.items()])

    def _part(self, replica: _Drafter, part: list[_Seq], kind: str, length: int, scale: float = 1.0):
        env = self.env
        if self.hop:
            yield env.timeout(self.hop)
        rows = len(part)
        if kind == "draft":
            cost = self.profile.drafter(rows, _row_tokens([s.tail + self.group for s in part], self.padded))
        else:
            cost = self.profile.speculate_table(rows, length + self.config.candidate_budget * (1 + self.group))
        cost *= scale
        with replica.lock.request() as turn:
            yield turn
            if replica.device is None:
                replica.busy += cost
                yield env.timeout(cost)
            else:
                with replica.device.request() as device:
                    yield device
                    replica.busy += cost
                    yield env.timeout(cost)
        if self.hop:
            yield env.timeout(self.hop)

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        env = self.env
        for v in self.verifiers:
            env.process(self._verifier(v))
        items = self._requests()
        if self.workload.concurrency:
            queue = deque(items)
            for _ in range(self.workload.concurrency):
                env.process(self._closed_client(queue))
        else:
            env.process(self._open_arrivals(items))
        env.run()
        return self._result(len(items))

    def _result(self, num_requests: int) -> SimResult:
        done = self.finished
        if len(done) != num_requests:
            raise RuntimeError(f"simulation ended with {num_requests - len(done)} requests unfinished (a bug)")
        start = min(r.arrival for r in done)
        seconds = max(r.finish for r in done) - start
        ttfts = [r.first_token - r.arrival for r in done]
        tpots = [(r.finish - r.first_token) / (r.output - 1) for r in done if r.output > 1]
        busy = [d.busy / seconds for d in self.drafters] if seconds > 0 else [0.0]
        c = self.config
        return SimResult(
            mode=c.mode, verifiers=c.verifiers, drafters=len(self.drafters), block_size=c.block_size if self.speculative else 0,
            requests=len(done), output_tokens=self.committed, seconds=seconds,
            tokens_per_s=self.committed / seconds if seconds > 0 else float("inf"),
            ttft_p50=_percentile(ttfts, 0.5), ttft_p99=_percentile(ttfts, 0.99),
            tpot_p50=_percentile(tpots, 0.5), tpot_p99=_percentile(tpots, 0.99),
            tau=self.accepted / self.pass_seqs + 1 if self.pass_seqs else 1.0,
            hit_rate=self.hits / self.lookups if self.lookups else 0.0,
            target_passes=self.passes,
            target_seconds_per_pass=self.target_seconds / self.passes if self.passes else 0.0,
            overhead_seconds_per_step=self.overhead_seconds / self.passes if self.passes else 0.0,
            blocking_draft_calls=self.blocking,
            draft_wait_seconds_per_call=self.draft_wait_seconds / self.blocking if self.blocking else 0.0,
            mean_batch=self.pass_seqs / self.passes if self.passes else 0.0,
            verifier_utilisation=sum(v.busy for v in self.verifiers) / (seconds * len(self.verifiers)) if seconds > 0 else 0.0,
            drafter_utilisation=float(np.mean(busy)) if self.drafters else 0.0,
            drafter_utilisation_max=float(np.max(busy)) if self.drafters else 0.0,
        )


def _row_tokens(tokens: list[int], padded: bool) -> int:
    """Tokens per row a pass costs: the longest row's when rows are padded to it, else the mean
    (a packed pass over the same total tokens)."""
    return max(tokens) if padded else -(-sum(tokens) // len(tokens))


def simulate(profile: Profile, config: SimConfig, workload: Workload) -> SimResult:
    """Run one simulation (see the module docstring)."""
    return Simulation(profile, config, workload).run()
