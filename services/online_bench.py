"""`specd bench online`: does live distillation make the serving drafter better on traffic it never saw?

It starts the real stack on this machine (`services.up.Stack`: Redis, the SpecOPD trainer, one
verifier, one drafter replica), starting from a drafter trained without one domain (by default
`d3d-smollm2-135m-unseen-code`), then sends that domain's training prompts through the
OpenAI-compatible API for ``--minutes`` of traffic, from ``--concurrency`` closed-loop clients.
Every finished request is a trace on the Redis stream; the trainer distils the drafter from them
(supervised by the verifier's ``Score``: the target is not copied into the trainer, so the
supervision load is part of the deployment), gates each candidate on its held-out traces and
publishes what passes; the drafter replica pulls each version and swaps it in.

Every ``--eval-minutes`` of traffic the clients stop (in-flight requests finish) and the *live*
drafter's τ is measured through the same verifier on held-out prompts of every domain: greedy,
a domain's prompts sent together, with ``store: false`` so that an evaluation never becomes
training data. τ is the verifier's own counters' tokens per sequence pass over those requests.
The verifier runs a fixed block (``--block``, default 4, the block the trainer trains for) unless
``--adaptive-block``: then the cost model's choices, which follow this machine's pass costs, move
τ as much as the drafter does. The trainer scores with the target's top 64 tokens per node
(``--score-top-k``) and replays kept traces while traffic is slower than it (``--replay-traces``).

The gate's held-out set is the traffic's: the trainer holds out about one trace in
``heldout_every`` by a hash of its id, so its domains come in the traffic's proportions (here,
the new domain alone). Forgetting is what the bench tracks on the other three.

Output: a table of τ per domain at each evaluation, JSON (``new_domain``, ``tau`` as
``{seconds, wall_seconds, version, domain, tau}`` measurements, ``versions`` with each gate
decision, ``failed_requests``, ``supervised_tokens_per_s``, ...) and a plot of τ per domain
against minutes of traffic with the published versions marked.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from matplotlib.figure import Figure  # object API: no pyplot state, no display backend
from tqdm import tqdm

from services.client import metrics, stream_completion
from services.common.config import ServiceConfig
from services.common.server import open_channel
from services.up import Stack, StackConfig, machine_cores, machine_split, stack_ports, zoo_model
from specd._proto.v1 import trainer_pb2, trainer_pb2_grpc
from specd.data import DOMAINS
from specd.engine import tau as tokens_per_pass
from specd.zoo import UNSEEN_DOMAIN, UNSEEN_DRAFTER

ACCEPTED = "specd:spec_decode_num_accepted_tokens_total"
PASSES = "specd:num_sequence_passes_total"


@dataclass(kw_only=True)
class OnlineSettings:
    new_domain: str = UNSEEN_DOMAIN
    minutes: float = 30.0
    """Minutes of traffic (evaluations pause it and are not counted)."""
    eval_minutes: float = 5.0
    """Minutes of traffic between two evaluations (one more at the start)."""
    eval_prompts: int = 8
    """Held-out prompts per domain per evaluation."""
    eval_max_tokens: int = 64
    concurrency: int = 2
    """Closed-loop traffic clients."""
    max_tokens: int = 128
    """Tokens per traffic request."""
    max_prompt_tokens: int = 192
    traffic_prompts: int = 1024
    """Distinct training prompts of the new domain the traffic cycles through."""
    temperature: float = 0.0
    """Of the traffic (evaluations are greedy)."""
    block: int = 4
    """The verifier's block and the trainer's: on a 2-core CPU a pass over 9 tokens costs ~2.1x a
    decode and over 5 ~1.8x, while the drafter's acceptance past the fourth position is ~0.03."""
    adaptive_block: bool = False
    score_top_k: int = 64
    """The trainer's ``--top-k``: Score answers with the 64 most likely tokens per node and the rest
    mass, 0.5 MB a step, instead of full distributions over SmolLM2's 49152 tokens (200 MB)."""
    steps_per_version: int = 10
    lr: float = 3e-4
    heldout_every: int = 6
    """The trainer's ``--heldout-every``: the gate needs 4 held-out traces before it publishes, and
    at the trainer's default (1 in 20) this machine's traffic would take ~10 minutes to bring them."""
    replay_traces: int = 256
    """The trainer's ``--replay-traces``: on a small machine traffic brings traces more slowly than
    the trainer steps, and without replay it waits most of the time (0: each trace trains once)."""
    trainer_args: tuple[str, ...] = ()
    """More trainer flags (``services.trainer --help``), after the bench's own."""
    offer_worse: bool = True
    """At the end, offer the gate a deliberately worse drafter (`offer_worse`)."""
    status_every: float = 2.0
    """Seconds between two reads of the trainer's Status (each gate decision is seen at the next)."""


@dataclass(kw_only=True)
class Measurement:
    seconds: float
    """Seconds of traffic before this evaluation."""
    wall_seconds: float
    version: str
    """The drafter version the verifier saw last ("initial": the starting drafter)."""
    domain: str
    tau: float
    requests: int
    tokens: int


@dataclass(kw_only=True)
class GateRecord:
    seconds: float
    """Seconds of traffic when the bench saw the decision."""
    wall_seconds: float
    passed: bool
    version: str
    """The version published ("" for a refused candidate)."""
    candidate_tau: float
    live_tau: float
    steps: int


@dataclass(kw_only=True)
class WorseOffer:
    """A deliberately worse drafter offered to the trainer's gate at the end of the run."""

    published: bool
    candidate_tau: float
    live_tau: float
    live_before: str
    """The live version just before the offer."""
    live_after: str
    """The live version the trainer named in its answer (the trainer's own publishing goes on
    meanwhile, so it may be a later version of its own, never the offered one)."""
    reason: str


@dataclass(kw_only=True)
class OnlineResult:
    new_domain: str
    settings: dict
    tau: list[Measurement] = field(default_factory=list)
    versions: list[GateRecord] = field(default_factory=list)
    failed_requests: int = 0
    errors: list[str] = field(default_factory=list)
    traffic_requests: int = 0
    traffic_tokens: int = 0
    traffic_seconds: float = 0.0
    wall_seconds: float = 0.0
    trainer_steps: int = 0
    traces_consumed: int = 0
    versions_published: int = 0
    versions_refused: int = 0
    replay_steps: int = 0
    """Trainer steps on replayed traces (included in ``trainer_steps``)."""
    supervised_tokens: int = 0
    worse_offer: WorseOffer | None = None
    supervised_tokens_per_s: float = 0.0
    """Supervised tokens per second of the run's wall clock (evaluations included: the trainer
    kept training through them)."""

    def start_and_end(self, domain: str) -> tuple[float, float]:
        taus = [m.tau for m in self.tau if m.domain == domain]
        return (taus[0], taus[-1]) if taus else (math.nan, math.nan)

    def summary(self) -> dict:
        rows = {}
        for domain in DOMAINS:
            start, end = self.start_and_end(domain)
            best = max((m.tau for m in self.tau if m.domain == domain), default=math.nan)
            rows[domain] = {"start": start, "end": end, "end_vs_start": end / start if start else math.nan,
                            "best_vs_start": best / start if start else math.nan}
        return rows


# ---------------------------------------------------------------------------- traffic
class Traffic:
    """Closed-loop clients sending the new domain's prompts until told to stop."""

    def __init__(self, base_url: str, model: str, pool: list[list[int]], settings: OnlineSettings) -> None:
        self.base_url, self.model, self.pool, self.settings = base_url, model, pool, settings
        self.next = 0
        self.requests = self.tokens = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def run_for(self, seconds: float) -> None:
        """Every client sends requests until ``seconds`` have passed, then finishes the one in flight."""
        deadline = time.monotonic() + seconds

        def client() -> None:
            while time.monotonic() < deadline:
                with self._lock:
                    prompt = self.pool[self.next % len(self.pool)]
                    self.next += 1
                body = {"model": self.model, "prompt": prompt, "max_tokens": self.settings.max_tokens,
                        "temperature": self.settings.temperature}
                try:
                    result = stream_completion(self.base_url, "/v1/completions", body)
                except OSError as error:
                    with self._lock:
                        self.errors.append(f"traffic: {error}")
                    continue
                with self._lock:
                    if result.finish_reason not in ("stop", "length"):
                        self.errors.append(f"traffic: a request ended with finish_reason {result.finish_reason!r}")
                    self.requests += 1
                    self.tokens += result.completion_tokens

        threads = [threading.Thread(target=client, name=f"traffic-{i}") for i in range(self.settings.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def evaluate(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, int, list[str]]:
    """(τ, requests, tokens, errors) of greedy requests, all at once, with ``store: false``. With
    traffic paused they are the verifier's only sequences, so its counters are theirs; at a fixed
    block, τ does not depend on how many run together."""
    before = metrics(base_url)

    def one(prompt: list[int]) -> int | str:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "store": False}
        try:
            return stream_completion(base_url, "/v1/completions", body).completion_tokens
        except OSError as error:
            return f"evaluation: {error}"

    with ThreadPoolExecutor(max(1, len(prompts))) as pool:
        answers = list(pool.map(one, prompts))
    tokens = sum(a for a in answers if isinstance(a, int))
    errors = [a for a in answers if isinstance(a, str)]
    after = metrics(base_url)
    accepted = after.get(ACCEPTED, 0.0) - before.get(ACCEPTED, 0.0)
    passes = after.get(PASSES, 0.0) - before.get(PASSES, 0.0)
    return tokens_per_pass(accepted, passes), len(prompts) - len(errors), tokens, errors


def drafter_version(samples: dict[str, float]) -> str:
    """The version label of the verifier's ``specd:drafter_version`` info metric ("initial": none yet)."""
    for name in samples:
        if name.startswith("specd:drafter_version_info{"):
            version = name[name.index("{") + 1 : -1].partition("version=")[2].split(",")[0]
            return version or "initial"
    return "initial"


class StatusWatch:
    """Reads the trainer's Status every few seconds and records each gate decision it sees."""

    def __init__(self, address: str, every: float, clock) -> None:
        self.stub = trainer_pb2_grpc.TrainerStub(open_channel(address, ServiceConfig()))
        self.every, self.clock = every, clock
        self.records: list[GateRecord] = []
        self.first: trainer_pb2.StatusResponse | None = None
        self.last: trainer_pb2.StatusResponse | None = None
        self.read_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainer-status", daemon=True)

    def start(self) -> "StatusWatch":
        self.first = self.last = self.stub.Status(trainer_pb2.StatusRequest(), timeout=30)
        self._thread.start()
        return self

    def stop(self) -> trainer_pb2.StatusResponse | None:
        self._stop.set()
        self._thread.join()
        self.poll()
        return self.last

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.poll()

    def poll(self) -> None:
        try:
            status = self.stub.Status(trainer_pb2.StatusRequest(), timeout=10)
        except grpc.RpcError:
            self.read_errors += 1
            return
        last = self.last
        seconds, wall = self.clock()
        # One record per decision. Of several between two reads only the last one's τ values
        # are known (Status keeps the last decision); the others get NaN, and a published one
        # before the last its version unknown ("?").
        published = status.versions_published - last.versions_published
        refused = status.versions_refused - last.versions_refused
        last_passed = status.last_candidate_tau >= status.last_gate_live_tau if published and refused else published > 0
        for passed, count in ((True, published), (False, refused)):
            for i in range(count):
                known = i == count - 1 and passed == last_passed
                self.records.append(GateRecord(
                    seconds=seconds, wall_seconds=wall, passed=passed,
                    version=(status.live_version if i == count - 1 else "?") if passed else "",
                    candidate_tau=status.last_candidate_tau if known else math.nan,
                    live_tau=status.last_gate_live_tau if known else math.nan, steps=status.steps))
        self.last = status


def offer_worse(trainer_address: str, drafter: str, directory: Path, seed: int = 0) -> WorseOffer:
    """Offer the trainer the starting drafter with Gaussian noise added to every decoder-layer
    tensor (each tensor's own standard deviation: its variance doubled; the shared embedding and
    heads untouched). The gate must refuse it and the live version must stay."""
    import torch

    from specd.models.loading import load_model, save_model

    model = load_model(drafter)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.startswith("layers.") and tensor.numel() > 1:
                tensor.add_(torch.randn(tensor.shape, generator=generator) * tensor.float().std())
    save_model(model, directory)
    stub = trainer_pb2_grpc.TrainerStub(open_channel(trainer_address, ServiceConfig()))
    before = stub.Status(trainer_pb2.StatusRequest(), timeout=30).live_version
    answer = stub.Offer(trainer_pb2.OfferRequest(directory=str(directory)), timeout=600)
    return WorseOffer(published=answer.published, candidate_tau=answer.candidate_tau, live_tau=answer.live_tau,
                      live_before=before or "initial", live_after=answer.version or "initial", reason=answer.reason)


# ---------------------------------------------------------------------------- the run
def stack_config(settings: OnlineSettings, target: str, drafter: str, workdir: str = "") -> StackConfig:
    """One sync verifier and one drafter sharing this machine (`machine_split`), and the trainer."""
    verifier_args, drafter_args, pinned = machine_split("sync", 1, machine_cores())
    if not settings.adaptive_block:
        verifier_args = [*verifier_args, "--no-adaptive-block"]
    trainer_args = ["--steps-per-version", str(settings.steps_per_version), "--lr", str(settings.lr),
                    "--heldout-every", str(settings.heldout_every),
                    "--replay-traces", str(settings.replay_traces), "--top-k", str(settings.score_top_k),
                    *settings.trainer_args]
    return StackConfig(target=target, drafter=drafter, drafters=1, verifiers=1, trainer=True, mode="sync",
                       block_size=settings.block, pin=pinned,
                       max_num_seqs=max(4, settings.concurrency, settings.eval_prompts),
                       verifier_args=verifier_args, drafter_args=drafter_args, trainer_args=trainer_args,
                       workdir=workdir, **stack_ports())


def traffic_prompts(target: str, domain: str, count: int, max_prompt_tokens: int) -> list[list[int]]:
    """``count`` training prompts of ``domain`` in the target's chat template (seed 1: not the
    drafters' answer prompts, though the starting drafter saw none of this domain anyway)."""
    from specd import zoo
    from specd.data import load_tokenizer
    from specd.data.chat import ChatTemplate
    from specd.train.drafter import domain_prompts

    zoo.ensure("data")
    target_dir = Path(target)
    prompts = domain_prompts({domain: zoo.train_documents(domain)}, load_tokenizer(target_dir), count, seed=1,
                             template=ChatTemplate.from_dir(target_dir), max_prompt_tokens=max_prompt_tokens)
    return [ids for _, ids in prompts]


def bench_online(settings: OnlineSettings, target: str, drafter: str, workdir: str = "", *,
                 heldout: dict[str, list[list[int]]] | None = None,
                 pool: list[list[int]] | None = None) -> OnlineResult:
    """The run of the module docstring. ``heldout`` (domain -> prompts) and ``pool`` (the
    traffic's prompts) default to the zoo's held-out prompts and the new domain's training prompts."""
    from specd.bench.decode import heldout_prompts

    if settings.new_domain not in DOMAINS:
        raise ValueError(f"--new-domain must be one of {', '.join(DOMAINS)}, got {settings.new_domain!r}")
    if settings.minutes <= 0 or settings.eval_minutes <= 0:
        raise ValueError(f"--minutes and --eval-minutes must be > 0, got {settings.minutes} and "
                         f"{settings.eval_minutes}")
    if heldout is None:
        heldout = heldout_prompts(Path(target), per_domain=settings.eval_prompts,
                                  max_prompt_tokens=settings.max_prompt_tokens)
    if pool is None:
        pool = traffic_prompts(target, settings.new_domain, settings.traffic_prompts, settings.max_prompt_tokens)
    result = OnlineResult(new_domain=settings.new_domain, settings=asdict(settings))
    model = Path(target).name
    budget = settings.minutes * 60
    rounds = math.ceil(budget / (settings.eval_minutes * 60))
    progress = tqdm(total=rounds + 1, desc="bench online", unit="evaluation")
    with Stack(stack_config(settings, target, drafter, workdir)) as stack:
        base = stack.verifiers[0].http
        stack.wait_drafting()
        stream_completion(base, "/v1/completions", {"model": model, "prompt": pool[0], "max_tokens": 8,
                                                    "temperature": 0, "store": False})  # warm up
        traffic = Traffic(base, model, pool, settings)
        start, traffic_seconds, running_since = time.monotonic(), 0.0, None

        def clock() -> tuple[float, float]:
            """(seconds of traffic so far, the current stretch included; wall seconds)."""
            now = time.monotonic()
            return traffic_seconds + (now - running_since if running_since is not None else 0.0), now - start

        watch = StatusWatch(stack.trainer.grpc, settings.status_every, clock).start()

        def evaluation() -> None:
            for domain in DOMAINS:
                progress.set_postfix_str(f"evaluating {domain} at {traffic_seconds / 60:.1f} min")
                tau, requests, tokens, errors = evaluate(base, model, heldout[domain], settings.eval_max_tokens)
                result.errors += errors
                result.tau.append(Measurement(seconds=traffic_seconds, wall_seconds=time.monotonic() - start,
                                              version=drafter_version(metrics(base)), domain=domain, tau=tau,
                                              requests=requests, tokens=tokens))
            progress.update()

        evaluation()
        while traffic_seconds < budget - 1e-6:
            chunk = min(settings.eval_minutes * 60, budget - traffic_seconds)
            progress.set_postfix_str(f"traffic to {(traffic_seconds + chunk) / 60:.1f} min")
            running_since = time.monotonic()
            traffic.run_for(chunk)
            traffic_seconds += time.monotonic() - running_since
            running_since = None
            evaluation()
        status = watch.stop()  # the trainer's own decisions; the offer below is recorded apart
        if settings.offer_worse:
            progress.set_postfix_str("offering the trainer a worse drafter")
            result.worse_offer = offer_worse(stack.trainer.grpc, drafter, stack.workdir / "worse-drafter")
    progress.close()
    result.versions = watch.records
    result.errors += traffic.errors
    result.failed_requests = len(result.errors)
    result.traffic_requests, result.traffic_tokens = traffic.requests, traffic.tokens
    result.traffic_seconds, result.wall_seconds = traffic_seconds, time.monotonic() - start
    if status is not None:
        result.trainer_steps, result.traces_consumed = status.steps, status.traces_consumed
        result.replay_steps = status.replay_steps
        # Decisions since the bench started watching (the trainer made none before: no traced request).
        result.versions_published = status.versions_published - watch.first.versions_published
        result.versions_refused = status.versions_refused - watch.first.versions_refused
        result.supervised_tokens = status.supervised_tokens
        result.supervised_tokens_per_s = status.supervised_tokens / result.wall_seconds
    return result


# ---------------------------------------------------------------------------- output
def format_table(result: OnlineResult) -> str:
    times = sorted({m.seconds for m in result.tau})
    by = {(m.seconds, m.domain): m for m in result.tau}
    lines = ["| traffic min | version | " + " | ".join(f"τ {d}" + (" (new)" if d == result.new_domain else "")
                                                    for d in DOMAINS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in DOMAINS) + " |"]
    for seconds in times:
        row = [by.get((seconds, d)) for d in DOMAINS]
        version = next((m.version for m in row if m is not None), "")
        lines.append(f"| {seconds / 60:.1f} | {version} | "
                     + " | ".join(f"{m.tau:.3f}" if m is not None else "" for m in row) + " |")
    lines.append("")
    for domain, row in result.summary().items():
        lines.append(f"{domain}: τ {row['start']:.3f} -> {row['end']:.3f} ({row['end_vs_start']:.3f}x; "
                     f"best {row['best_vs_start']:.3f}x)")
    passed = sum(r.passed for r in result.versions)
    lines.append(f"gate: {passed} published, {len(result.versions) - passed} refused; failed requests "
                 f"{result.failed_requests}; {result.traffic_requests} traffic requests "
                 f"({result.traffic_tokens} tokens in {result.traffic_seconds:.0f} s); trainer {result.trainer_steps} "
                 f"steps ({result.replay_steps} replayed), {result.traces_consumed} traces, "
                 f"{result.supervised_tokens} supervised tokens ({result.supervised_tokens_per_s:.1f}/s)")
    if result.worse_offer is not None:
        w = result.worse_offer
        lines.append(f"a worse drafter offered: {'PUBLISHED' if w.published else 'refused'} ({w.reason}); live version "
                     f"{w.live_before} before, {w.live_after} after")
    return "\n".join(lines)


def plot(result: OnlineResult, path: Path) -> Path:
    figure = Figure(figsize=(7, 4))
    axes = figure.subplots()
    for domain in DOMAINS:
        points = [(m.seconds / 60, m.tau) for m in result.tau if m.domain == domain]
        label = f"{domain} (new)" if domain == result.new_domain else domain
        axes.plot(*zip(*points), marker="o", linewidth=2.5 if domain == result.new_domain else 1.2, label=label)
    for record in result.versions:
        if record.passed:
            axes.axvline(record.seconds / 60, color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("minutes of traffic (dotted: a version published)")
    axes.set_ylabel("τ of the live drafter (held-out prompts)")
    axes.set_title(f"online distillation on {result.new_domain} traffic")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def add_arguments(parser) -> None:
    d = OnlineSettings()
    parser.add_argument("--target", default="smollm2-135m", help="target directory or zoo name")
    parser.add_argument("--drafter", default="", help=f"starting drafter directory or zoo name (default: the zoo's "
                                                      f"{UNSEEN_DRAFTER}, for --new-domain {UNSEEN_DOMAIN})")
    parser.add_argument("--new-domain", default=d.new_domain, help=f"the traffic's domain, one of {', '.join(DOMAINS)}")
    parser.add_argument("--minutes", type=float, default=d.minutes, help="minutes of traffic")
    parser.add_argument("--eval-minutes", type=float, default=d.eval_minutes,
                        help="minutes of traffic between two evaluations of the live drafter")
    parser.add_argument("--eval-prompts", type=int, default=d.eval_prompts, help="held-out prompts per domain")
    parser.add_argument("--eval-max-tokens", type=int, default=d.eval_max_tokens)
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="closed-loop traffic clients")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per traffic request")
    parser.add_argument("--temperature", type=float, default=d.temperature, help="of the traffic")
    parser.add_argument("--block", type=int, default=d.block, help="the verifier's block (and the trainer's)")
    parser.add_argument("--adaptive-block", action="store_true",
                        help="let the verifier's cost model shorten blocks (default: a fixed block)")
    parser.add_argument("--steps-per-version", type=int, default=d.steps_per_version,
                        help="trainer steps between gated candidate versions")
    parser.add_argument("--lr", type=float, default=d.lr, help="the trainer's learning rate")
    parser.add_argument("--heldout-every", type=int, default=d.heldout_every,
                        help="the trainer holds out about one trace in N for its gate")
    parser.add_argument("--score-top-k", type=int, default=d.score_top_k,
                        help="the trainer's --top-k for Score (0: full distributions)")
    parser.add_argument("--replay-traces", type=int, default=d.replay_traces,
                        help="the trainer's --replay-traces (0: each trace trains once)")
    parser.add_argument("--trainer-arg", action="append", default=[],
                        help="one more trainer flag, e.g. --trainer-arg=--branches-per-anchor=2 (repeatable)")
    parser.add_argument("--no-offer-worse", dest="offer_worse", action="store_false",
                        help="skip offering the gate a deliberately worse drafter at the end")
    parser.add_argument("--workdir", default="", help="logs and trainer checkpoints (default: a temporary directory)")
    parser.add_argument("--json", default="out/bench/online.json", help="JSON path (the plot goes beside it)")


def run(args) -> int:
    settings = OnlineSettings(
        new_domain=args.new_domain, minutes=args.minutes, eval_minutes=args.eval_minutes,
        eval_prompts=args.eval_prompts, eval_max_tokens=args.eval_max_tokens, concurrency=args.concurrency,
        max_tokens=args.max_tokens, temperature=args.temperature, block=args.block,
        adaptive_block=args.adaptive_block, steps_per_version=args.steps_per_version, lr=args.lr,
        replay_traces=args.replay_traces, score_top_k=args.score_top_k, offer_worse=args.offer_worse,
        heldout_every=args.heldout_every,
        trainer_args=tuple(args.trainer_arg))
    target = zoo_model(args.target)
    if not args.drafter and settings.new_domain != UNSEEN_DOMAIN:
        raise ValueError(f"the zoo's starting drafter never saw {UNSEEN_DOMAIN!r}; for --new-domain "
                         f"{settings.new_domain} pass --drafter DIR, a drafter trained without that domain")
    drafter = zoo_model(args.drafter or UNSEEN_DRAFTER)
    result = bench_online(settings, target, drafter, args.workdir)
    print(format_table(result))
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**asdict(result), "summary": result.summary(), "target": Path(target).name,
               "drafter": Path(drafter).name}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {json_path}")
    print(f"wrote {plot(result, json_path.with_suffix('.png'))}")
    worse_published = result.worse_offer is not None and result.worse_offer.published
    return 0 if result.failed_requests == 0 and not worse_published else 1
