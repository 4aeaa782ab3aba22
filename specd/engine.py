"""In-process decoding loops over a target model.

`autoregressive` is plain decoding, written as simply as possible: the reference for "greedy
speculative output == plain greedy output", and for a seeded sampled request "speculative output ==
plain output with the same seed" (keyed sampling, `specd.sampling`). It batches ragged prompts: one
prefill pass, then one decode pass per step for the sequences still running.

`SpeculativeEngine` is the serving loop: continuous batching of many sequences (admitted and
finished by `specd.scheduler.Scheduler`), block verification with the rejection sampler, cache
commit of the accepted path, drafting of the next block's candidates overlapped with
verification, and a cost model that picks the block length per step (down to plain decoding).
With no drafter it *is* plain decoding, in the same code path as everything it is compared with.

`tau` is τ, defined here once for every report of it (`EngineStats.tau`, a request's usage).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.cost_model import CostModel
from specd.cuda_graphs import GraphRunner
from specd.drafters.base import (
    Drafter,
    DrafterUnavailable,
    DraftRequest,
    SpeculateRequest,
    check_block_size,
)
from specd.sampling import (
    SamplingParams,
    VerifyResult,
    keyed_sample,
    process_logits,
    sample,
    target_probs,
    verify_batch,
    verify_block,
    verify_greedy,
    verify_greedy_tokens,
    verify_keyed,
)
from specd.scheduler import Generation, RunningSequence, Scheduler


def check_prompt(prompt: Sequence[int], vocab_size: int, params: SamplingParams | None = None) -> None:
    """Reject prompts (and the token ids the params name) the model cannot take, with a message
    that says what was wrong."""
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    try:  # vectorised: a hostile prompt may hold hundreds of thousands of ids
        ids = torch.as_tensor(prompt, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        ids = None  # not plain ints (or too big for int64): looked at one by one below
    if ids is None or ids.dim() != 1:
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    else:
        bad = ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()
    if bad:
        raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    bad = [t for t in (params.token_ids if params is not None else ()) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"token ids {bad[:5]} in stop_token_ids or logit_bias are outside the vocabulary [0, {vocab_size})"
        )


@torch.no_grad()
def autoregressive(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> list[Generation]:
    """Plain decoding of a batch of prompts, one token per sequence per pass (a seeded sampled
    request's token at position t is its keyed choice there: `specd.sampling.keyed_sample`)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    vocab_size = model.config.vocab_size
    for prompt, p in zip(prompts, params):
        check_prompt(prompt, vocab_size, p)
    device = next(model.parameters()).device
    generators = [p.generator(device) for p in params]
    outputs = [Generation() for _ in prompts]
    longest = max(len(p) for p in prompts) + max(p.max_tokens for p in params)
    cache = model.new_cache(len(prompts), capacity=longest)
    new_tokens: list[list[int]] = [list(map(int, p)) for p in prompts]
    running = [True] * len(prompts)
    while any(running):
        chains = [tokens if run else [] for tokens, run in zip(new_tokens, running)]
        batch = ForwardBatch.from_chains(chains, cache.lengths, device)
        logits = model(batch, cache)  # [num_seqs, max_new, vocab]
        cache.commit(batch, [list(range(len(c))) for c in chains])
        last = logits[torch.arange(len(prompts)), batch.last_index()]  # [num_seqs, vocab]
        best = last.argmax(-1).tolist()  # plain greedy rows: one reduction for the batch
        for b, out in enumerate(outputs):
            if not running[b]:
                continue
            if params[b].greedy and not params[b].processes_logits:
                token = best[b]  # the argmax: what sampling the one-hot greedy probabilities gives
            else:
                probs = target_probs(process_logits(last[b : b + 1], params[b], prompts[b], out.token_ids), params[b])
                if params[b].keyed:
                    token = int(keyed_sample(probs, params[b].seed, len(prompts[b]) + len(out.token_ids)))
                else:
                    token = int(sample(probs, generators[b]))
            out.token_ids.append(token)
            out.num_passes += 1
            new_tokens[b] = [token]
            if token in params[b].stop_token_ids:
                out.finish_reason, running[b] = "stop", False
            elif len(out.token_ids) >= params[b].max_tokens:
                running[b] = False
    return outputs


# ====================================================================== speculative decoding
@dataclass(kw_only=True, slots=True)
class EngineConfig:
    max_num_seqs: int = field(default=16, metadata={"help": "sequences decoded together"})
    """Sequences decoded together (rows of the target's cache)."""
    block_size: int = field(default=8, metadata={"help": "most drafted tokens verified per sequence per pass"})
    """Most drafted tokens verified per sequence per pass."""
    mode: str = field(default="async", metadata={"help": "async: draft during verification (D3D); sync: after"})
    """"async": the drafter drafts candidates for the next block while the target verifies
    (D3D); "sync": it drafts after verification (what a drafter reading target states must do)."""
    candidate_budget: int = field(default=4, metadata={"help": "most outcomes (k, c) drafted ahead per sequence"})
    """Most outcomes (k, c) per sequence the drafter drafts a next block for, in async mode. The
    engine drafts fewer while the candidate pass outlasts the verification beside it (it then
    sits on the critical path) and returns to this many once it fits again."""
    adaptive_block: bool = field(default=True, metadata={"help": "let the cost model shorten blocks"})
    """Let the cost model shorten blocks (down to plain decoding) when that is faster."""
    selective_drafting: bool = field(default=False, metadata={
        "help": "at batch > 1, draft only for the sequences whose drafts paid (off: all or none)"})
    """With ``adaptive_block``, at batch > 1: draft for a sequence only while its drafts pay
    (`CostModel.worth_drafting`), the others decoding plain in the same pass. Off by default, as
    measured on SmolLM2 (2-core Xeon): at batch 16 D3D sync went 0.935x/0.954x -> 0.948x/0.944x
    plain (noise), and at batch 4 D3D + prompt lookup ran 1.04x with it against 1.21x/1.09x
    before and 1.10x with it off (bursty lookup matches are missed while a row waits for its
    next look)."""
    drafter_retry_seconds: float | None = field(default=None, metadata={
        "help": "pause before retrying a failed drafter (none = never again)"})
    """After the drafter fails: decode plain for this long, then try it again (None = never again,
    right for a one-shot batch; a long-running server sets it so a drafter that comes back is used)."""
    draft_headroom: int | None = field(default=None, metadata={
        "help": "draft blocks of at most the cost model's last chosen length + this many tokens (0 = full blocks)",
        "none": 0})
    """With ``adaptive_block``: draft blocks (and candidate blocks) of at most the length the cost
    model last chose plus this many tokens, not the full ``block_size`` — the drafter's pass costs
    tokens (on a CPU, in proportion), and tokens drafted past what is verified are wasted. The
    headroom lets the chosen length grow by that much per step. None: always the full block."""
    async_target_threads: int | None = field(default=None, metadata={
        "help": "async: the target's intra-op threads while a candidate pass runs beside it (none = unchanged)",
        "none": 0})
    """Async mode with a drafter on the same CPU (in process, or a drafter service on the same
    machine): the intra-op threads of a target pass that runs beside the drafter's candidate pass,
    so the two share the cores instead of fighting over them. A step with no candidate pass beside
    it (a plain step, or one the cost model drafts after verification) runs on the threads the
    engine was built with, all of them. None: the engine never changes the thread count (a GPU,
    or a drafter on cores of its own)."""
    cuda_graphs: bool = field(default=False, metadata={
        "help": "replay decode/verification passes from CUDA graphs at fixed row buckets (full-attention targets)"})
    """Replay the target's decode and verification passes from CUDA graphs at fixed row buckets
    (`specd.cuda_graphs`; full-attention targets only). Off by default: on the CPU it only runs the
    same padded static pass eagerly (what the tests check)."""

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {self.mode!r}")
        if self.block_size < 0:
            raise ValueError(f"block_size must be >= 0, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.async_target_threads is not None and self.async_target_threads < 1:
            raise ValueError(f"async_target_threads must be >= 1 (or None), got {self.async_target_threads}")
        if self.draft_headroom is not None and self.draft_headroom < 1:
            raise ValueError(f"draft_headroom must be >= 1 (or None for full blocks), got {self.draft_headroom}")


def tau(num_accepted_tokens: float, num_sequence_passes: float) -> float:
    """τ: mean tokens a verification pass commits per sequence — the drafted tokens it accepts,
    plus the one the target adds (its correction, or the bonus token). ``num_sequence_passes``
    counts every sequence in every pass, plain steps (no drafted block) included; 1.0 before any
    pass, plain decoding's value. Counters may be metric deltas, hence floats."""
    return num_accepted_tokens / num_sequence_passes + 1 if num_sequence_passes else 1.0


@dataclass(kw_only=True, slots=True)
class EngineStats:
    """Counters named like vLLM's spec-decode metrics, plus the candidate hit rate and timings."""

    num_steps: int = 0
    num_sequence_passes: int = 0
    """Sequences verified, summed over target passes (each running sequence once per pass,
    with or without a drafted block): τ's denominator."""
    num_drafts: int = 0
    """Verification passes over a drafted block, one per sequence (vLLM's meaning: a plain
    step of a sequence is not a draft)."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_per_pos: list[int] = field(default_factory=list)
    block_samples: list[tuple[list[float], int, int]] | None = None
    """When a list: every verified block's (confidence per position, accepted length, sequence id —
    the prompt's index in `SpeculativeEngine.generate`) is appended
    (`specd bench profile` keeps a sample for the simulator: which blocks get verified long, and
    how much of them is accepted, go together)."""
    confidence_sum_per_pos: list[float] = field(default_factory=list)
    """Sum over verified blocks of the drafter's confidence at each position (what the cost model
    is shown), beside what was accepted there."""
    num_emitted_tokens: int = 0
    num_target_passes: int = 0
    num_drafter_calls: int = 0
    num_drafter_blocking_calls: int = 0
    """Drafter calls the target pass waited for (fresh blocks after a miss): the critical path."""
    num_candidate_lookups: int = 0
    num_candidate_hits: int = 0
    seconds_total: float = 0.0
    seconds_target: float = 0.0
    seconds_drafter_blocking: float = 0.0
    full_batch_tokens: int = 0
    full_batch_seconds: float = 0.0
    """Tokens committed by, and seconds of, the steps in which every cache row was busy: the
    rate a server sustains at this concurrency while requests keep coming. A finite batch of
    requests also drains at its end, and speculation drains unevenly (sequences finish at
    different steps, the last ones in small passes) where plain decoding of equal lengths
    finishes every row at once."""

    @property
    def full_batch_rate(self) -> float:
        """Tokens per second of full-batch steps (0.0 before any)."""
        return self.full_batch_tokens / self.full_batch_seconds if self.full_batch_seconds else 0.0

    @property
    def tau(self) -> float:
        """τ over every pass so far (`tau`)."""
        return tau(self.num_accepted_tokens, self.num_sequence_passes)

    @property
    def hit_rate(self) -> float:
        return self.num_candidate_hits / self.num_candidate_lookups if self.num_candidate_lookups else 0.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.num_accepted_tokens_per_pos, self.num_drafts_per_pos)]

    @property
    def confidence_per_pos(self) -> list[float]:
        """The drafter's mean confidence per position, over the blocks verified there."""
        return [c / d if d else 0.0 for c, d in zip(self.confidence_sum_per_pos, self.num_drafts_per_pos)]

    def count_confidence(self, confidence: list[float]) -> None:
        while len(self.confidence_sum_per_pos) < len(confidence):
            self.confidence_sum_per_pos.append(0.0)
        for i, value in enumerate(confidence):
            self.confidence_sum_per_pos[i] += value

    @property
    def overhead_per_step(self) -> float:
        """Seconds per step spent outside target passes and blocking drafter calls."""
        outside = self.seconds_total - self.seconds_target - self.seconds_drafter_blocking
        return outside / self.num_steps if self.num_steps else 0.0

    def count_block(self, drafted: int, accepted: int) -> None:
        """One sequence's verification: ``drafted`` tokens verified (0: a plain step), ``accepted`` kept."""
        self.num_sequence_passes += 1
        if not drafted:
            return
        while len(self.num_drafts_per_pos) < drafted:
            self.num_drafts_per_pos.append(0)
            self.num_accepted_tokens_per_pos.append(0)
        for i in range(drafted):
            self.num_drafts_per_pos[i] += 1
            self.num_accepted_tokens_per_pos[i] += int(i < accepted)
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted


class SpeculativeEngine:
    """Lossless speculative decoding of a batch of sequences over one target model.

    Each step is one target pass over every running sequence: the uncached context tail plus
    the drafted block (a chain), ragged across sequences. The rejection sampler
    (`specd.sampling.verify_block`; `verify_keyed` for a seeded sampled request, which then gives
    plain decoding's tokens for its seed) decides the accepted length k and the next token c; the
    target cache commits the accepted path. In async mode the drafter drafts the next block
    for likely outcomes (k, c) *during* the target pass (in a worker thread: torch releases
    the GIL); a hit is used at once, a miss asks for a fresh block, and a drafter that fails
    is dropped for plain decoding — a request never fails for speed's sake.

    Sequences come and go through `start` (a new one in a free cache row) and `release` (a
    finished one leaves the drafter); which row, and when, is a `specd.scheduler.Scheduler`'s call
    (`generate`'s own, or the serving loop's).
    """

    clock: Callable[[], float] = staticmethod(time.perf_counter)
    """What the engine times its steps, passes and drafts with (the cost model's inputs). A test
    swaps in a simulated clock that only the costs it charges move, so the decisions it checks do
    not depend on how loaded the machine is."""

    def __init__(self, target: nn.Module, drafter: Drafter | None = None, config: EngineConfig | None = None) -> None:
        self.target = target.eval()
        self.drafter = drafter
        self.config = config or EngineConfig()
        if drafter is not None and drafter.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the drafter's vocabulary ({drafter.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}): they must share one tokenizer"
            )
        if drafter is not None:
            check_block_size(self.config.block_size, drafter.max_block)
        self.device = next(target.parameters()).device
        # Whether the target's passes cost their real tokens, not their padded grid (`ForwardBatch.real_index`).
        self._packed = self.device.type == "cpu" and getattr(target, "packs_padding", False)
        self.cache = target.new_cache(self.config.max_num_seqs)
        self._graphs = None
        if self.config.cuda_graphs:
            # Decode (1) and every verification length the adaptive block can pick (1 + L).
            self._graphs = GraphRunner(target, self.cache, tokens=tuple(range(1, self.config.block_size + 2)))
        self.cost_model = CostModel()
        self._chosen_length = self.config.block_size  # the cost model's last choice (draft_headroom)
        self._budget = self.config.candidate_budget  # outcomes drafted ahead (async), adapted per step
        self.stats = EngineStats()
        self._threads = torch.get_num_threads()  # a plain step's, with async_target_threads
        self._last_speculative: bool | None = None  # how the last step ran
        self._last_overlap: bool | None = None  # (None: plain)
        self._overlap_explored = False  # this step tried the losing way to speculate
        self._gain_explored = False  # this step drafted before the cost model could weigh drafts
        self._pool = None
        if self.config.mode == "async":
            shared = self.config.async_target_threads
            self._pool = ThreadPoolExecutor(max_workers=1, initializer=None if shared is None else torch.set_num_threads,
                                            initargs=() if shared is None else (shared,))
        self._parked_drafter = None  # a drafter that failed, until its retry time
        self._drafter_retry_at = 0.0
        # The last verification pass, for the commit that follows it (and a DFlash drafter's states).
        self._last_batch: ForwardBatch | None = None
        self._last_hidden: Tensor | None = None

    # ------------------------------------------------------------------ public
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """Decode all prompts (at most ``max_num_seqs`` at a time, continuous batching)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        for prompt, p in zip(prompts, params):
            check_prompt(prompt, self.target.config.vocab_size, p)
        scheduler: Scheduler[int] = Scheduler(self.config.max_num_seqs)  # waiting: prompt indices
        scheduler.waiting.extend(range(len(prompts)))
        results: list[Generation | None] = [None] * len(prompts)
        began = self.clock()
        while scheduler.has_work:
            scheduler.admit(lambda i, row: self.start(i, prompts[i], params[i], row))
            self.step(scheduler.running)
            for seq in scheduler.finish_done():
                results[seq.seq_id] = seq.generation
                self.release(seq.seq_id)
        self.stats.seconds_total += self.clock() - began
        return results

    def start(self, seq_id: int, prompt: Sequence[int], params: SamplingParams, row: int) -> RunningSequence:
        """A new sequence decoding ``prompt`` in cache row ``row`` (a free row, emptied here), known
        to the drafter as ``seq_id``. Raises what seeding the request's generator raises."""
        generator = params.generator(self.device)
        self._reset_row(row)
        return RunningSequence(seq_id=seq_id, row=row, params=params, generator=generator,
                               context=list(map(int, prompt)), num_prompt=len(prompt))

    def release(self, seq_id: int) -> None:
        """A sequence finished: the drafter forgets it (its cache row is the scheduler's to free)."""
        if self.drafter is None:
            return
        try:
            self.drafter.release(seq_id)
        except DrafterUnavailable:
            self._drafter_failed()

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self, running: list[RunningSequence]) -> None:
        """One target pass over every running sequence."""
        self.stats.num_steps += 1
        began = self.clock()
        emitted_before = self.stats.num_emitted_tokens
        # A step that prefills some prompt measures prefill, not what speculation is worth.
        prefill = any(len(s.context) - s.cached > 1 for s in running)
        self._unpark_drafter()
        # A step that prefills a prompt makes no blocking drafter call: the new request's first
        # token waits for nothing but its prefill (TTFT), and its prompt reaches the drafter with
        # its first draft, after that token is out. The others verify blocks in hand (async
        # candidates drafted during the last pass) or decode plain this one step.
        in_hand = prefill and any(s.block is not None for s in running)
        speculative = (not prefill or in_hand) and self._speculates(len(running))
        self._gain_explored = False
        if speculative:
            if not prefill:
                self._ensure_blocks(running)
            lengths = self._verify_lengths(running)
            self._chosen_length = max(lengths)
        else:
            for seq in running:
                seq.block = None  # drafted for the context this plain step moves past
            lengths = [0] * len(running)
        blocks = [s.block.tokens[:n] if s.block is not None else [] for s, n in zip(running, lengths)]
        self._overlap_explored = False
        overlap = speculative and not prefill and self._overlaps(len(running))
        self._share_cores(overlap)
        future = self._speculate_async(running, blocks) if overlap else None
        start = self.clock()
        logits = self._verify_pass(running, blocks)
        pass_seconds = self.clock() - start
        self.stats.seconds_target += pass_seconds
        self.stats.num_target_passes += 1
        if not prefill:  # a prompt's pass costs the prompt, not the block
            self.cost_model.observe_pass(len(running), self._tokens_per_sequence(blocks), pass_seconds)
        joined = self.clock()
        candidates = self._join(future)
        if future is not None:
            self._adapt_budget(self.clock() - joined, pass_seconds)
        results = self._verify_all(running, blocks, logits)
        paths = [None] * self.config.max_num_seqs
        selective = self._selective(len(running))
        for i, (seq, block, result) in enumerate(zip(running, blocks, results)):
            if isinstance(result, Exception):
                # One request's sampling failed (what validation at the door should have caught):
                # it ends with its error, its row stays uncommitted, every other sequence goes on.
                self.fail(seq, result)
                continue
            paths[seq.row] = list(range(len(seq.context) - seq.cached + result.num_accepted))
            if self._drafter_reads_target():
                committed = len(paths[seq.row])
                self.drafter.observe(seq.seq_id, (seq.context[seq.cached :] + block)[:committed],
                                     self._last_hidden[seq.row, :committed])
            self._emit(seq, block[: result.num_accepted] + [result.next_token])
            seq.generation.accepted_lengths.append(result.num_accepted)
            if seq.block is not None and selective:  # what drafting delivered (`CostModel.worth_drafting`)
                observed = float(result.num_accepted)
                drafted = len(seq.block.tokens)
                if result.num_accepted == len(block) < drafted:
                    # Cut short by the cost model, not by the target: worth what the calibration
                    # expects of the whole block (early on, before it is learnt, a step verifies little).
                    observed = max(observed, self.cost_model.expected_accepted(list(seq.block.confidence), drafted))
                gain = seq.draft_gain
                seq.draft_gain = observed if gain is None else 0.7 * gain + 0.3 * observed
            self.stats.count_block(len(block), result.num_accepted)
            if seq.block is not None and block:
                verified = list(seq.block.confidence[: len(block)])
                self.stats.count_confidence(verified)
                if self.stats.block_samples is not None:
                    self.stats.block_samples.append((verified, result.num_accepted, seq.seq_id))
                self.cost_model.observe_acceptance(verified, result.num_accepted)
            outcome = (result.num_accepted, result.next_token)
            seq.block = None
            if candidates is not None:
                self.stats.num_candidate_lookups += 1
                next_block = candidates[i].get(outcome)  # drafted for this outcome during the pass
                if next_block is not None:
                    self.stats.num_candidate_hits += 1
                    seq.block = next_block
        self.cache.commit(self._last_batch, paths[: self._last_batch.num_seqs])
        for seq in running:
            seq.cached = len(seq.context) - 1 if not seq.done else seq.cached
        if len(running) == self.config.max_num_seqs:
            self.stats.full_batch_tokens += self.stats.num_emitted_tokens - emitted_before
            self.stats.full_batch_seconds += self.clock() - began
        if not prefill:
            # Steady-state steps only: a step's cost depends on how the one before it ran (the
            # first speculative step after plain ones drafts blocking, catching up on the context).
            tokens, seconds = self.stats.num_emitted_tokens - emitted_before, self.clock() - began
            # (Nor a step that tried the losing way to speculate: it measures that way; nor one that
            # drafted for sequences not yet known to be worth it: `_ensure_blocks` soon skips some.)
            if speculative == self._last_speculative and not self._overlap_explored and not self._gain_explored:
                self.cost_model.observe_step(len(running), speculative, tokens, seconds, verified=any(lengths))
            if speculative and self._last_overlap == overlap:
                self.cost_model.observe_overlap(len(running), overlap, tokens, seconds)
        self._last_speculative, self._last_overlap = speculative, (overlap if speculative else None)

    def _speculates(self, num_seqs: int) -> bool:
        """Whether this step drafts: with a drafter, always, unless the cost model, shown what
        whole speculative and plain steps delivered at this batch, finds plain steps faster."""
        if self.drafter is None or self.config.block_size == 0:
            return False
        if not self.config.adaptive_block:
            return True
        if self._selective(num_seqs) and self.cost_model.needs_plain_pass(num_seqs):
            return False  # a plain pass prices what a sequence's draft saves (`_ensure_blocks`)
        return self.cost_model.should_speculate(num_seqs)

    def _selective(self, num_seqs: int) -> bool:
        """Whether this step drafts per sequence (`EngineConfig.selective_drafting`)."""
        return self.config.adaptive_block and self.config.selective_drafting and num_seqs > 1

    def _overlaps(self, num_seqs: int) -> bool:
        """A speculative step in async mode: whether the drafter drafts the next block's
        candidates during this verification, or (as sync mode does) after it, when the cost
        model measured that to deliver more (`CostModel.should_overlap`)."""
        if self._pool is None or self.drafter is None or not self.drafter.can_speculate:
            return False
        if not self.config.adaptive_block:
            return True
        overlap = self.cost_model.should_overlap(num_seqs)
        self._overlap_explored = self.cost_model.exploring_overlap(num_seqs)
        return overlap

    def _drafter_reads_target(self) -> bool:
        """Whether the drafter (if any is in use) gets the target's hidden states after each pass."""
        return self.drafter is not None and self.drafter.needs_target_hidden

    def _ensure_blocks(self, running: list[RunningSequence]) -> None:
        """A fresh block for every running sequence that has none (first step, or a miss) and,
        with the adaptive block at batch > 1, whose drafts have paid for their cost
        (`CostModel.worth_drafting`): the others decode plain this step."""
        need = [s for s in running if s.block is None]
        if self.drafter is None or not need or self.config.block_size == 0:
            return
        if self._selective(len(running)):
            wanted = []
            # A step that drafts before the cost model can weigh drafts is no measure of what
            # speculating delivers. Looks and first drafts are: they are what it costs (at batch 16
            # on SmolLM2, left out, they hid 3-5 ms a step of drafts from the speculate-or-not duel).
            self._gain_explored = not self.cost_model.prices_drafting(len(running))
            for seq in need:
                if self.cost_model.worth_drafting(len(running), seq.draft_gain):
                    seq.draft_skipped, seq.draft_looks = 0, 0
                    wanted.append(seq)
                elif seq.draft_skipped >= self.cost_model.look_after(seq.draft_looks):
                    # A look: its text may have changed (an answer turns to code).
                    seq.draft_skipped, seq.draft_looks = 0, seq.draft_looks + 1
                    wanted.append(seq)
                else:
                    seq.draft_skipped += 1
            need = wanted
            if not need:
                return
        requests = [
            DraftRequest(seq_id=s.seq_id, context=s.context, block_size=self._draft_size(), params=s.params)
            for s in need
        ]
        start = self.clock()
        try:
            blocks = self.drafter.draft(requests)
        except DrafterUnavailable:
            self._drafter_failed()  # plain decoding until it comes back
            return
        finally:
            self.stats.seconds_drafter_blocking += self.clock() - start
            self.stats.num_drafter_calls += 1
            self.stats.num_drafter_blocking_calls += 1
        self.cost_model.observe_drafting(len(running), self.clock() - start, len(need))
        for seq, block in zip(need, blocks):
            seq.block = block

    def _draft_size(self) -> int:
        """Tokens per drafted block: the full block, or the last chosen length + headroom."""
        headroom = self.config.draft_headroom
        if headroom is None or not self.config.adaptive_block:
            return self.config.block_size
        return min(self.config.block_size, self._chosen_length + headroom)

    def _verify_lengths(self, running: list[RunningSequence]) -> list[int]:
        """Per sequence, the drafted tokens this step verifies: all of them, or the cost model's choice."""
        drafted = [len(s.block.tokens) if s.block is not None else 0 for s in running]
        if not self.config.adaptive_block:
            return drafted
        confidences = [s.block.confidence if s.block is not None else [] for s in running]
        return self.cost_model.choose_lengths(confidences, max(drafted), packed=self._packed)

    def _tokens_per_sequence(self, blocks: list[list[int]]) -> float:
        """What a pass over these blocks costs, in tokens per sequence (`CostModel`'s line): the
        mean where the target skips padding, the longest where it computes it."""
        if self._packed:
            return 1 + sum(map(len, blocks)) / len(blocks)
        return 1 + max(map(len, blocks))

    def _speculate_async(self, running: list[RunningSequence], blocks: list[list[int]]):
        """The drafter's candidate pass for the next blocks, on the pool's thread (called where
        `_overlaps` said yes: there is a pool and a drafter that speculates)."""
        selective = self._selective(len(running))
        requests = [
            SpeculateRequest(
                # The context itself, not a copy: nothing appends to it before `_join` returns.
                seq_id=s.seq_id, context=s.context, block=block, block_size=self._draft_size(),
                # No candidates for a sequence whose drafts do not pay (`_ensure_blocks`).
                budget=self._budget if not selective or self.cost_model.worth_drafting(len(running), s.draft_gain) else 0,
                params=s.params,
            )
            for s, block in zip(running, blocks)
        ]
        self.stats.num_drafter_calls += 1
        return self._pool.submit(self.drafter.speculate, requests)

    def _share_cores(self, overlap: bool) -> None:
        """With ``async_target_threads``: that many threads for a pass with a candidate pass
        beside it, all the engine's for one without (set before the candidate pass starts)."""
        shared = self.config.async_target_threads
        if shared is None or self._pool is None:
            return
        wanted = shared if overlap else self._threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def _adapt_budget(self, waited: float, pass_seconds: float) -> None:
        """Keep the candidate pass inside the verification pass it runs beside: one outcome fewer
        after a step that waited for it, one more (up to ``candidate_budget``) after one that
        did not. A candidate is worth a blocking draft only while it costs the step nothing."""
        if waited > 0.05 * pass_seconds:
            self._budget = max(1, self._budget - 1)
        elif waited < 0.01 * pass_seconds:
            self._budget = min(self.config.candidate_budget, self._budget + 1)

    def _join(self, future):
        if future is None:
            return None
        start = self.clock()
        try:
            return future.result()
        except DrafterUnavailable:
            self._drafter_failed()
            return None
        finally:
            self.stats.seconds_drafter_blocking += self.clock() - start

    @torch.no_grad()
    def _verify_pass(self, running: list[RunningSequence], blocks: list[list[int]]) -> Tensor:
        """The target's pass over every sequence's uncached tail plus its block; returns the logits
        that verification reads, packed: ``[sum(len(block) + 1), vocab]``, sequence ``i``'s
        ``len(blocks[i]) + 1`` rows after those of the sequences before it, its row ``j`` the
        target's distribution after its last committed token and ``block[:j]``. Packed, not padded
        to the longest block: at batch 16 one sequence verifying 16 tokens beside 15 plain ones
        would run SmolLM2's head over 16 x 17 positions (15 GFLOP, half the pass) for 31 read."""
        # Rows past the highest busy one stay out of the pass when the cache allows it.
        rows = len(self.cache.lengths)
        if self.cache.supports_row_prefix:
            rows = max(s.row for s in running) + 1
        lengths = self.cache.lengths[:rows].tolist()
        tails: list[list[int]] = [[] for _ in range(rows)]
        for seq, block in zip(running, blocks):
            tails[seq.row] = seq.context[seq.cached :] + block
        batch = ForwardBatch.from_chains(tails, lengths, self.device)
        self._last_batch = batch
        # Where each sequence's verified columns start in the pass: its last committed token.
        firsts = torch.tensor([len(s.context) - s.cached - 1 for s in running], dtype=torch.long)
        counts = torch.tensor([len(b) + 1 for b in blocks], dtype=torch.long)
        starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)  # each row's first packed index
        columns = torch.repeat_interleave(firsts, counts) + torch.arange(int(counts.sum())) - starts
        where = (torch.repeat_interleave(torch.tensor([s.row for s in running], dtype=torch.long), counts), columns)
        with torch.inference_mode():  # no autograd bookkeeping per op: ~4% of a SmolLM2 decode step
            return self._target_logits(batch, where)

    def _target_logits(self, batch: ForwardBatch, where: tuple[Tensor, Tensor]) -> Tensor:
        """`_verify_pass`'s target pass over ``batch``: the logits at ``(rows, columns) = where``.
        The LM head runs over those positions only, not over every new token: a prefill step
        reads one column per prompt, and a SmolLM2 head over a 150-token prompt at batch 16 would
        be 2400 rows of 49152 logits (470 MB) for the 16 that verification reads."""
        rows, columns = (index.to(self.device) for index in where)
        if self._drafter_reads_target():
            self._last_hidden = self.target.hidden_states(batch, self.cache)  # [rows, max_new, hidden]
            return self.target.lm_head(self._last_hidden[rows, columns])
        if self._graphs is not None:
            return self._graphs(batch)[rows, columns]  # replayed where the shape fits
        return self.target.lm_head(self.target.hidden_states(batch, self.cache)[rows, columns])

    def _verify_all(self, running: list[RunningSequence], blocks: list[list[int]],
                    logits: Tensor) -> list[VerifyResult | Exception]:
        """Every sequence's verification of its block against its ``len(block) + 1`` rows of the
        target's logits (`_verify_pass`'s, packed), the rows batched by kind: plain greedy
        rows by argmax (one over the whole pass when every row is one), unseeded sampled rows
        through the batched rejection sampler (`verify_batch`), seeded rows keyed. A row whose
        sampling fails gets its exception, and the other rows go on."""
        results: list[VerifyResult | Exception | None] = [None] * len(running)
        counts = [len(b) + 1 for b in blocks]
        plain_greedy = [s.params.greedy and not s.params.processes_logits for s in running]
        if all(plain_greedy):
            best = logits.argmax(-1).tolist()  # every verified position: one reduction for the batch
            start = 0
            for i, (block, count) in enumerate(zip(blocks, counts)):
                results[i] = verify_greedy_tokens(block, best[start : start + count])
                start += count
            return results
        views = logits.split(counts)
        sampled: list[int] = []
        sampled_probs: list[Tensor] = []
        for i, (seq, block) in enumerate(zip(running, blocks)):
            try:
                if plain_greedy[i]:
                    results[i] = verify_greedy(block, views[i])
                    continue
                probs = self._target_probs(seq, block, views[i])
                if seq.params.keyed:
                    # Seeded: the tokens plain decoding with this seed gives, whatever was drafted
                    # (the block continues the committed context: its first token sits at len(context)).
                    results[i] = verify_keyed(block, probs, seq.params.seed, len(seq.context))
                else:
                    sampled.append(i)
                    sampled_probs.append(probs)
            except (ValueError, RuntimeError, IndexError) as err:
                results[i] = err
        if sampled:
            for i, result in zip(sampled, self._verify_sampled(running, blocks, sampled, sampled_probs)):
                results[i] = result
        return results

    def _verify_sampled(self, running: list[RunningSequence], blocks: list[list[int]], rows: list[int],
                        probs: list[Tensor]) -> list[VerifyResult | Exception]:
        """Unseeded sampled rows through `verify_batch` (each row draws from its own generator
        what `verify_block` would); should that raise, row by row, so only a bad row fails."""
        drafted = [self._draft_probs(running[i], blocks[i]) for i in rows]
        tokens = [torch.tensor(blocks[i], dtype=torch.long) for i in rows]
        try:
            cu = torch.tensor([0] + [len(blocks[i]) for i in rows], dtype=torch.long).cumsum(0)
            draft_probs = None
            if any(q is not None for q in drafted):
                vocab = probs[0].shape[-1]
                draft_probs = torch.cat([
                    q if q is not None else torch.nn.functional.one_hot(t, vocab).float()
                    for q, t in zip(drafted, tokens)
                ]) if int(cu[-1]) else None
            return verify_batch(torch.cat(tokens), cu, draft_probs, torch.cat(probs),
                                [running[i].generator for i in rows])
        except (ValueError, RuntimeError, IndexError):
            out: list[VerifyResult | Exception] = []
            for i, t, q, p in zip(rows, tokens, drafted, probs):
                try:
                    out.append(verify_block(t, q, p, running[i].generator))
                except (ValueError, RuntimeError, IndexError) as err:
                    out.append(err)
            return out

    @staticmethod
    def _draft_probs(seq: RunningSequence, block: list[int]) -> Tensor | None:
        """The drafter's distributions over the verified block (None: it drafted deterministically)."""
        if block and seq.block is not None and seq.block.probs is not None:
            return seq.block.probs[: len(block)]
        return None

    def _target_probs(self, seq: RunningSequence, block: list[int], logits: Tensor) -> Tensor:
        """The request's distributions ``[len(block) + 1, vocab]`` from the target's logits there:
        its logits processors (row r as if ``block[:r]`` were output), then its sampling."""
        if seq.params.processes_logits:  # else no prompt copy per step: most requests set none
            logits = process_logits(logits, seq.params, seq.context[: seq.num_prompt], seq.generation.token_ids, block)
        return target_probs(logits, seq.params)

    def _emit(self, seq: RunningSequence, tokens: list[int]) -> None:
        """Append committed tokens to the output, stopping at a stop token or max_tokens."""
        out = seq.generation
        out.num_passes += 1
        for token in tokens:
            seq.context.append(token)
            out.token_ids.append(token)
            self.stats.num_emitted_tokens += 1
            if token in seq.params.stop_token_ids:
                out.finish_reason, seq.done = "stop", True
            elif len(out.token_ids) >= seq.params.max_tokens:
                out.finish_reason, seq.done = "length", True
            if seq.done:
                return

    def fail(self, seq: RunningSequence, err: BaseException) -> None:
        """End one sequence with an error of its own (its row is reset when it is reused)."""
        seq.generation.finish_reason = "error"
        seq.generation.error = f"{type(err).__name__}: {err}"
        seq.done = True
        seq.block = None

    def _drafter_failed(self) -> None:
        """The drafter is unreachable: decode plain, and park it for a retry if configured."""
        if self.config.drafter_retry_seconds is not None:
            self._parked_drafter = self.drafter
            self._drafter_retry_at = time.monotonic() + self.config.drafter_retry_seconds
        self.drafter = None

    def _unpark_drafter(self) -> None:
        if self._parked_drafter is not None and time.monotonic() >= self._drafter_retry_at:
            self.drafter, self._parked_drafter = self._parked_drafter, None

    def _reset_row(self, row: int) -> None:
        lengths = self.cache.lengths.clone()
        lengths[row] = 0
        self.cache.rollback(lengths)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.config.async_target_threads is not None:
            torch.set_num_threads(self._threads)  # the caller's, as the engine found them
