"""How many drafted tokens to verify this step: expected tokens per second, measured, not guessed.

A target pass over ``t`` tokens per sequence at batch ``n`` costs ``c_n(t) ~ a_n + b_n * t``
seconds; the line is fitted online from the drafted passes the engine times (exponentially
weighted least squares; prefill passes are left out, their cost is the prompt's), and plain
passes (``t = 1``) are priced by their own measurements apart, starting from a prior
slope of ``b/a = n/16``: a pass's cost follows its *total* tokens once they are past what the
weights' reads hide (a small model on a CPU at batch 1 shows about 1/16; at batch 16 every
drafted token per sequence adds 16 to the pass; a GPU is flatter, and the fit learns that
within a few steps).

Verifying ``L`` drafted tokens of a sequence whose drafter believes position ``i`` and all before
it are accepted with probability ``a_i`` (`DraftBlock.confidence`) is expected to commit
``E(L) = 1 + sum_{i<=L} g(a)_i`` tokens, where ``g`` maps the drafter's confidence to how often
the target accepted such positions (`Calibration`: per bin of the conditional confidence
``a_i / a_{i-1}``, learnt from every verified block). A drafter's confidence is rarely a
probability: prompt lookup's Laplace estimate says 0.44 for the second token of a match seen
once, where the target accepts it far more often, and a scale alone cannot fix a shape. Where the
target pads its passes (a GPU, a hybrid model), one ``L`` is chosen for the whole batch (the
longest block is the cost), maximising ``sum_s E_s(L) / c_n(L + 1)``; ``L = 0`` is plain decoding,
chosen when speculation does not pay. Where it computes real tokens only (Qwen3 and Llama on a
CPU), the cost is the mean tokens per sequence and each sequence gets its own ``L_s``
(`CostModel.choose_lengths`).
So that the fit keeps seeing lengths beyond its choice, the first choice and every
``explore_every``-th after it verify twice the chosen length (at least 1, at most the block)
instead: where passes turn out flat a long block is found in a few doublings, and an exploration
at batch 16 on a CPU costs a pass of two tokens per sequence, not of seventeen (with per-sequence
lengths, at least ``explore_tokens`` drafted tokens in all: 8 at batch 64, not 64).

That choice is made after the step's blocks were drafted, so it cannot save the drafter's own
cost: a blocking draft (sync mode, or a miss), or the drafter's speculation beside the pass
taking the target's core. Whether to speculate at all is decided before that, by what whole
steps delivered (`should_speculate`): committed tokens per second of a step (drafting, target
pass, verification and all) measured for speculative and for plain steps of the same batch
bucket, the better arm taken, the other tried again after ``explore_every`` decisions, then
after gaps that double while it keeps losing (an exploration is two whole losing steps, and only
steady-state steps are compared). Nothing there is a constant of a machine: on a CPU at batch 16
a plain step wins and speculation turns itself off; at batch 1, or where passes are flat, it
stays on.

With `EngineConfig.selective_drafting` (off by default: not faster where measured, see the
README), within a speculative step at batch > 1 each sequence is drafted for only while its own drafts
pay (`worth_drafting`): the tokens the target accepted from them per drafted step, each worth a
``1/n`` share of a plain pass, against a draft's measured cost per sequence. The others decode
plain in the same pass and are looked at again after ``explore_every``, then twice as many,
skipped steps (`look_after`). At batch 16 on a CPU a drafter right for a few sequences (code,
repeated text) is then used there, where all-or-none drafting turned it off for every one.

In async mode a speculative step asks one more question the same way (`should_overlap`): draft
the next block's candidates during verification, the two passes sharing the cores, or after it
as sync mode does, the target on all of them. On a GPU, or a CPU whose one thread runs a pass
nearly as fast as two, overlapping wins; on a CPU where the target's pass takes twice as long on
half the cores, drafting after wins, and an async engine is then no slower than a sync one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class _Line:
    """Exponentially weighted least squares of cost against tokens per sequence."""

    decay: float = 0.95
    weight: float = 0.0
    sum_t: float = 0.0
    sum_c: float = 0.0
    sum_tt: float = 0.0
    sum_tc: float = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        d = self.decay
        self.weight = d * self.weight + 1
        self.sum_t = d * self.sum_t + tokens
        self.sum_c = d * self.sum_c + seconds
        self.sum_tt = d * self.sum_tt + tokens * tokens
        self.sum_tc = d * self.sum_tc + tokens * seconds

    def predict(self, tokens: float, prior_slope_ratio: float) -> float | None:
        if self.weight == 0:
            return None
        mean_t, mean_c = self.sum_t / self.weight, self.sum_c / self.weight
        var_t = self.sum_tt / self.weight - mean_t * mean_t
        if var_t > 1e-6:
            # A pass is never cheaper for more tokens: a slope below zero is timing noise on flat passes.
            slope = max(0.0, (self.sum_tc / self.weight - mean_t * mean_c) / var_t)
            intercept = mean_c - slope * mean_t
            if intercept > 0:
                return intercept + slope * tokens
        # One distinct length seen so far: scale the prior line through the observed mean.
        base = mean_c / (1 + prior_slope_ratio * mean_t)
        return base * (1 + prior_slope_ratio * tokens)


@dataclass(kw_only=True, slots=True)
class _Rate:
    """Exponentially weighted tokens per second of whole steps: sum of tokens over sum of seconds."""

    decay: float = 0.8
    tokens: float = 0.0
    seconds: float = 0.0
    count: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        self.count += 1
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + seconds

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(kw_only=True, slots=True)
class Calibration:
    """g: the drafter's confidence -> the measured rate at which the target accepts each position
    (the position and every one before it, as ``confidence`` means).

    What is calibrated is the drafter's *conditional* confidence at each position, ``c_i / c_{i-1}``
    (the chance it gives position ``i`` once every earlier one was accepted; D3D's per-position
    ``E_q[q]``, prompt lookup's agreeing share of the matches): its ratios fall in ``bins`` equal
    bins of [0, 1], and each bin keeps exponentially weighted counts of positions verified after
    an accepted one and of those accepted, starting from ``prior`` pseudo-positions accepted at
    the bin's middle value (an unmeasured drafter is taken at its word). A position's calibrated
    rate is the product of its and the earlier positions' bins, so rates never increase along a
    block. Conditionals repeat across positions (a match seen once gives 2/3 at every position),
    so what the first position teaches holds for the fourth: a block verified short still learns
    what a longer one would be worth, which cumulative bins (seen only where verified) did not."""

    bins: int = 20
    prior: float = 2.0
    decay: float = 0.98
    """Per observation of a bin: about the last 50 positions of each bin count."""
    accepted: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.seen:
            self.seen = [self.prior] * self.bins
            self.accepted = [self.prior * (b + 0.5) / self.bins for b in range(self.bins)]

    def _bins(self, confidence: list[float]) -> list[int]:
        out, before = [], 1.0
        for c in confidence:
            ratio = c / before if before > 0 else 0.0
            out.append(min(self.bins - 1, max(0, int(ratio * self.bins))))
            before = c
        return out

    def rates(self, confidence: list[float]) -> list[float]:
        """Calibrated chance that each position (and every one before it) is accepted."""
        out, running = [], 1.0
        for b in self._bins(confidence):
            running *= self.accepted[b] / self.seen[b]
            out.append(running)
        return out

    def observe(self, confidence: list[float], accepted: int) -> None:
        """A verified block: its first ``accepted`` positions were accepted, the next rejected
        (the ones after it say nothing about their conditional chance)."""
        for i, b in enumerate(self._bins(confidence)[: accepted + 1]):
            self.seen[b] = self.decay * self.seen[b] + 1
            self.accepted[b] = self.decay * self.accepted[b] + (1.0 if i < accepted else 0.0)


@dataclass(kw_only=True, slots=True)
class _Duel:
    """Two ways to run a step (arms ``True`` and ``False``), each scored by the committed tokens
    per second of the whole steps that took it; see `CostModel.should_speculate`."""

    rates: dict[bool, _Rate] = field(default_factory=dict)
    decisions: int = 0
    gap: int = 0
    """Decisions until the losing arm is tried again (doubles while it keeps losing)."""
    next_explore: int = 0
    better: bool | None = None
    """The arm that delivered more at the last decision."""
    exploring: int = 0
    """Decisions left in the current exploration of the losing arm."""
    explored: bool = False
    """Whether the last decision tried the arm that is not the better one (or not yet measured)."""

    def choose(self, *, first: bool, first_steps: int, runs: int, explore_every: int, max_explore_every: int) -> bool:
        self.decisions += 1
        self.explored = False
        if self.exploring:
            self.exploring -= 1
            self.explored = True
            return not self.better
        mine, other = self.rates.get(first), self.rates.get(not first)
        if mine is None or mine.count < first_steps:
            return first
        if other is None:
            self.explored = True
            return not first
        better = mine.value >= other.value if first else other.value >= mine.value
        if self.better is not None and self.better != better:  # the arms swapped: watch closely again
            self.gap, self.next_explore = explore_every, self.decisions + explore_every
        self.better = better
        if not self.gap:
            self.gap, self.next_explore = explore_every, self.decisions + explore_every
        if self.decisions < self.next_explore:
            return better
        self.gap = min(2 * self.gap, max_explore_every)
        self.next_explore = self.decisions + self.gap
        self.exploring = runs - 1
        self.explored = True
        return not better

    def observe(self, arm: bool, tokens: int, seconds: float) -> None:
        self.rates.setdefault(arm, _Rate()).add(tokens, seconds)


@dataclass(kw_only=True, slots=True)
class CostModel:
    prior_slope_ratio: float = 1 / 16
    """b/a of the cost line at batch 1 before any measurement (times the batch at larger ones)."""
    lines: dict[int, _Line] = field(default_factory=dict)
    """Batch bucket -> the cost line of passes that verified drafted tokens."""
    plain_passes: dict[int, _Line] = field(default_factory=dict)
    """Batch bucket -> passes of one token per sequence, apart: a pass with any drafted token in
    it may cost a step more than the line through plain passes says (another product shape, a
    second attention call), so plain passes price plain steps and drafted ones the rest."""
    calibration: Calibration = field(default_factory=Calibration)
    """g: the drafter's confidence -> the target's measured acceptance."""
    explore_every: int = 16
    """Every this many choices verify twice the chosen length, so the fit keeps seeing longer passes."""
    explore_tokens: int = 8
    """Packed passes: an exploration verifies at least this many drafted tokens in all (or one per
    sequence at a smaller batch) when twice the choice is fewer. Not one per sequence at any
    batch: at batch 64 on a CPU, where a pass costs its tokens, that doubled every 16th pass (sync
    D3D + prompt lookup on SmolLM2 at 64 rows, `bench/results/smollm2/xeon-avx512/serve-c64.json`:
    passes 13% dearer than plain ones with τ 1.04, these explorations a part of it)."""
    steps: int = 0
    max_explore_every: int = 128
    """Longest gap between explorations of the losing arm (see `should_speculate`)."""
    speculate_duels: dict[int, _Duel] = field(default_factory=dict)
    """Batch bucket -> speculative against plain steps."""
    overlap_duels: dict[int, _Duel] = field(default_factory=dict)
    """Batch bucket -> speculative steps with the candidate pass beside verification, or without."""
    free_drafting: float = 0.02
    """A blocking draft that costs at most this share of a plain pass is free: a step that
    drafted so and verified nothing is scored as a plain step (`observe_step`)."""
    drafting_seconds: dict[int, float] = field(default_factory=dict)
    """Batch bucket -> seconds of a step's blocking draft (EMA)."""
    drafting_per_seq: dict[int, float] = field(default_factory=dict)
    """Batch bucket -> seconds a blocking draft costs per sequence drafted for (EMA)."""

    @staticmethod
    def _bucket(num_seqs: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(num_seqs, 1))))

    def observe_pass(self, num_seqs: int, tokens_per_seq: float, seconds: float) -> None:
        passes = self.plain_passes if tokens_per_seq <= 1 else self.lines
        passes.setdefault(self._bucket(num_seqs), _Line()).add(tokens_per_seq, seconds)

    def observe_step(self, num_seqs: int, speculative: bool, tokens: int, seconds: float, *,
                     verified: bool = True) -> None:
        """A whole step (drafting, pass, verification) committed ``tokens`` in ``seconds`` (the
        engine reports a step that ran as the one before it did: see `should_speculate`).
        ``verified``: whether it verified any drafted token. A speculative step that verified
        none after a free draft (`drafting_is_free`) was a plain step and is scored as one."""
        arm = speculative and (verified or not self.drafting_is_free(num_seqs))
        self.speculate_duels.setdefault(self._bucket(num_seqs), _Duel()).observe(arm, tokens, seconds)

    def observe_drafting(self, num_seqs: int, seconds: float, drafted: int | None = None) -> None:
        """A step at batch ``num_seqs`` waited ``seconds`` for its blocking draft, for ``drafted``
        of its sequences together (default: all of them)."""
        bucket = self._bucket(num_seqs)
        last = self.drafting_seconds.get(bucket)
        self.drafting_seconds[bucket] = seconds if last is None else 0.8 * last + 0.2 * seconds
        per_seq = seconds / max(1, num_seqs if drafted is None else drafted)
        last = self.drafting_per_seq.get(bucket)
        self.drafting_per_seq[bucket] = per_seq if last is None else 0.8 * last + 0.2 * per_seq

    def worth_drafting(self, num_seqs: int, gain: float | None) -> bool:
        """Whether a blocking draft for one sequence of a step at batch ``num_seqs`` pays for
        itself: the drafted tokens the target accepted from it per drafted step (``gain``) save
        a ``1/num_seqs`` share of a plain pass each, against the draft's measured cost per
        sequence. A step of 16 rows on a CPU drafts for the rows whose drafts the target takes
        (code, repeated text) and decodes the others plain, instead of all rows or none.
        Yes while either is unmeasured and where drafting is free (`drafting_is_free`); when
        to look again at a sequence whose drafts did not pay is the engine's (`look_after`)."""
        if gain is None or not self.prices_drafting(num_seqs) or self.drafting_is_free(num_seqs):
            return True
        return gain * self.pass_cost(num_seqs, 1) / num_seqs > self.drafting_per_seq[self._bucket(num_seqs)]

    def look_after(self, looks: int) -> int:
        """Skipped steps before a sequence whose drafts do not pay is drafted for again, after
        ``looks`` such looks that found them still not paying: ``explore_every``, then twice as
        many each time, up to ``max_explore_every``. A look is a blocking draft: at batch 16,
        looks every 16 steps put a draft call in most steps (measured on SmolLM2: 2-8 ms a
        step of ~90, for rows drafted in 2-3% of their passes)."""
        return min(self.explore_every << min(looks, 16), self.max_explore_every)

    def prices_drafting(self, num_seqs: int) -> bool:
        """Whether `worth_drafting` weighs measured figures at this batch: a draft's cost per
        sequence and a plain pass's (not the prior slope's guess, which can be off by 2x)."""
        bucket = self._bucket(num_seqs)
        return bucket in self.drafting_per_seq and bucket in self.plain_passes

    def needs_plain_pass(self, num_seqs: int) -> bool:
        """Whether drafting at this batch was timed and a plain pass not yet: the engine then runs
        a plain step (the baseline, nothing lost) so that `worth_drafting` can weigh drafts."""
        bucket = self._bucket(num_seqs)
        return bucket in self.drafting_per_seq and bucket not in self.plain_passes

    def drafting_is_free(self, num_seqs: int) -> bool:
        """Whether a blocking draft at this batch costs at most ``free_drafting`` of a plain pass.

        Prompt lookup drafts in a fraction of a millisecond and, where it finds no match, the step
        verifies nothing: a plain step. Scored as a speculative one, a stretch without matches
        made speculating lose the whole-step comparison, and it was then tried again only after
        16, 32, ... 128 plain steps, through the next matches."""
        seconds = self.drafting_seconds.get(self._bucket(num_seqs))
        return seconds is not None and seconds <= self.free_drafting * self.pass_cost(num_seqs, 1)

    def step_rate(self, num_seqs: int, speculative: bool) -> float | None:
        """Measured committed tokens per second of such steps at this batch, None before any."""
        duel = self.speculate_duels.get(self._bucket(num_seqs))
        rate = duel.rates.get(speculative) if duel is not None else None
        return rate.value if rate is not None else None

    def should_speculate(self, num_seqs: int) -> bool:
        """Whether this step drafts at all (see the module docstring): the arm whose whole steps
        delivered more tokens per second at this batch; arms not yet measured are tried
        (two speculative steps first, then plain ones). The losing arm is tried again after
        ``explore_every`` decisions, then after twice as many each time it is still the loser
        (up to ``max_explore_every``), and again after ``explore_every`` once the arms swap: an
        exploration costs whole losing steps (at high batch, a blocking draft for every
        sequence), so a loser that keeps losing is looked at less and less. An exploration lasts
        two steps and the engine reports steady-state steps only (`observe_step` after a step of
        the same kind): the first speculative step after plain ones drafts blocking, catching up
        on the context, where the next one in async mode has its candidates ready."""
        duel = self.speculate_duels.setdefault(self._bucket(num_seqs), _Duel())
        return duel.choose(first=True, first_steps=2, runs=2, explore_every=self.explore_every,
                           max_explore_every=self.max_explore_every)

    def should_overlap(self, num_seqs: int) -> bool:
        """Async mode, a speculative step: whether the drafter drafts the next block's candidates
        *during* this verification (the target on its share of the cores, `EngineConfig.async_target_threads`)
        or after it, as sync mode does (the target on all of them; the next step drafts, blocking).
        Decided as `should_speculate` decides, from `observe_overlap`'s steady-state steps; an
        exploration lasts two steps, since a step's cost depends on how the step before it ran
        (with candidates drafted during it, or a blocking draft to come)."""
        duel = self.overlap_duels.setdefault(self._bucket(num_seqs), _Duel())
        return duel.choose(first=True, first_steps=2, runs=2, explore_every=self.explore_every,
                           max_explore_every=self.max_explore_every)

    def exploring_overlap(self, num_seqs: int) -> bool:
        """Whether the last `should_overlap` decision at this batch tried the losing way: such a
        step measures that way, not what speculating is worth (`observe_step` skips it)."""
        duel = self.overlap_duels.get(self._bucket(num_seqs))
        return duel is not None and duel.explored

    def observe_overlap(self, num_seqs: int, overlapped: bool, tokens: int, seconds: float) -> None:
        """A speculative step that ran as the one before it (overlapped or not) committed
        ``tokens`` in ``seconds``: one in steady state, what `should_overlap` compares."""
        self.overlap_duels.setdefault(self._bucket(num_seqs), _Duel()).observe(overlapped, tokens, seconds)

    def observe_acceptance(self, confidence: list[float], accepted: int) -> None:
        """A verified block: the drafter's confidence for each verified position, and how many
        of them the target accepted."""
        self.calibration.observe(confidence, accepted)

    def pass_cost(self, num_seqs: int, tokens_per_seq: float) -> float:
        """Predicted seconds of a pass (relative units before any measurement): a plain pass
        from plain passes, a drafted one from the line through drafted passes (never below a
        plain one), each from the prior slope through what was measured while it lacks data."""
        bucket = self._bucket(num_seqs)
        prior = self.prior_slope_ratio * bucket
        plain, drafted = self.plain_passes.get(bucket), self.lines.get(bucket)
        plain_cost = plain.predict(1, prior) if plain else None
        if tokens_per_seq <= 1 and plain_cost is not None:
            return plain_cost
        predicted = drafted.predict(tokens_per_seq, prior) if drafted else None
        if predicted is not None:
            return max(predicted, plain_cost) if plain_cost is not None else predicted
        if plain_cost is not None:
            return plain_cost * (1 + prior * tokens_per_seq) / (1 + prior)
        return 1 + prior * tokens_per_seq

    def expected_accepted(self, confidence: list[float], length: int) -> float:
        """Drafted tokens the target is expected to accept of the first ``length`` (calibrated)."""
        return float(sum(self.calibration.rates(confidence[:length])))

    def choose_lengths(self, confidences: list[list[float]], max_length: int, *, packed: bool) -> list[int]:
        """Per sequence, how many of its drafted tokens this step verifies (at most ``max_length``).

        ``packed``: the target computes a pass on its real tokens only (`ForwardBatch.real_index`),
        so a pass costs its mean tokens per sequence, ``c_n(1 + sum(L_s) / n)``, and each sequence
        gets its own length: drafted positions are taken most confident first (a sequence's
        positions in order, since its confidences do not increase), and the prefix with the
        highest ``sum_s E_s(L_s) / c_n`` is kept. At batch 16 on a CPU that verifies the few
        sequences whose drafts are likely right, and not the rest. Exploration as for one length:
        twice the chosen tokens (at least ``explore_tokens``, or one per sequence below that
        batch). Otherwise (padded passes) one length
        for all (`choose_length`)."""
        num_seqs = len(confidences)
        if not packed:
            return [self.choose_length(confidences, max_length)] * num_seqs
        self.steps += 1
        if max_length == 0 or not confidences:
            return [0] * num_seqs
        # (confidence, position, sequence), best first; equal confidences by position, so a
        # sequence's positions come in order and any prefix is a set of per-sequence prefixes.
        rates = [self.calibration.rates(conf[:max_length]) for conf in confidences]
        order = sorted(((c, i, s) for s, conf in enumerate(rates) for i, c in enumerate(conf)),
                       key=lambda item: (-item[0], item[1]))
        committed = float(num_seqs)
        best, best_rate = 0, committed / self.pass_cost(num_seqs, 1)
        for taken, (c, _, _) in enumerate(order, start=1):
            committed += c
            rate = committed / self.pass_cost(num_seqs, 1 + taken / num_seqs)
            if rate > best_rate:
                best, best_rate = taken, rate
        if (self.steps - 1) % self.explore_every == 0:
            best = min(len(order), max(min(num_seqs, self.explore_tokens), 2 * best))
        lengths = [0] * num_seqs
        for _, _, s in order[:best]:
            lengths[s] += 1
        return lengths

    def choose_length(self, confidences: list[list[float]], max_length: int) -> int:
        """The verified block length for this step, one for every sequence (see the module docstring)."""
        self.steps += 1
        if max_length == 0 or not confidences:
            return 0
        num_seqs = len(confidences)
        rates = [self.calibration.rates(c[:max_length]) for c in confidences]
        best, best_rate = 0, -1.0
        for length in range(max_length + 1):
            committed = sum(1 + sum(r[:length]) for r in rates)
            rate = committed / self.pass_cost(num_seqs, length + 1)
            if rate > best_rate:
                best, best_rate = length, rate
        if (self.steps - 1) % self.explore_every == 0:  # the first choice too: a drafter is tried at once
            return min(max_length, max(1, 2 * best))
        return best
