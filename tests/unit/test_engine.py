"""The speculative engine is lossless: greedy output equals plain greedy output, token for token,
and a seeded sampled request gives plain decoding's tokens for its seed, whatever drafts for it."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from specd.cost_model import CostModel
from specd.drafters.base import DraftBlock, Drafter, DrafterUnavailable, DraftRequest
from specd.drafters.d3d import D3DDrafter
from specd.drafters.ngram import NgramDrafter
from specd.engine import EngineConfig, SpeculativeEngine, autoregressive
from specd.models.d3d import FLAVOURS as D3D_FLAVOURS
from specd.models.d3d import D3DModel
from specd.models.qwen3 import FLAVOURS, Qwen3ForCausalLM
from specd.models.qwen3_next import FLAVOURS as NEXT_FLAVOURS
from specd.models.qwen3_next import Qwen3NextForCausalLM
from specd.models.sparse import FLAVOURS as SPARSE_FLAVOURS
from specd.models.sparse import SparseForCausalLM
from specd.sampling import SamplingParams, keyed_sample

VOCAB = FLAVOURS["debug"].vocab_size


def sharpened(model):
    """Scale a random model's head so greedy text has structure drafters can sometimes guess."""
    torch.manual_seed(3)
    model = model.eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


@pytest.fixture(scope="module")
def target():
    return sharpened(Qwen3ForCausalLM(FLAVOURS["debug"]))


TARGET_KINDS = {
    "qwen3": lambda: Qwen3ForCausalLM(FLAVOURS["debug"]),
    "qwen3_next": lambda: Qwen3NextForCausalLM(NEXT_FLAVOURS["debug"]),
    "sparse": lambda: SparseForCausalLM(SPARSE_FLAVOURS["debug"]),
}


@pytest.fixture(scope="module")
def drafter_model():
    torch.manual_seed(4)
    return D3DModel(D3D_FLAVOURS["debug"]).eval()


def prompts(num: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(num)
    return [torch.randint(7, VOCAB, (int(n),), generator=generator).tolist() for n in torch.randint(3, 20, (num,), generator=generator)]


@pytest.mark.parametrize("kind", sorted(TARGET_KINDS))
@pytest.mark.parametrize("num_seqs", [1, 8])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_d3d_equals_plain_greedy(drafter_model, kind, num_seqs, block_size, mode):
    """Random-weight drafter: bad drafts must still give exactly the plain greedy output."""
    target = sharpened(TARGET_KINDS[kind]())
    batch = prompts(num_seqs)
    params = SamplingParams(max_tokens=24)
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    drafter = D3DDrafter(drafter_model, max_num_seqs=num_seqs)
    engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=num_seqs, block_size=block_size, mode=mode))
    got = [g.token_ids for g in engine.generate(batch, params)]
    engine.close()
    assert got == expected
    assert engine.stats.num_target_passes < sum(len(e) for e in expected) + 1


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_ngram_equals_plain_greedy(target, block_size):
    batch = prompts(8)
    params = SamplingParams(max_tokens=32)
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    engine = SpeculativeEngine(target, NgramDrafter(vocab_size=VOCAB), EngineConfig(max_num_seqs=3, block_size=block_size, mode="sync"))
    assert [g.token_ids for g in engine.generate(batch, params)] == expected


def test_the_lm_head_runs_only_where_verification_reads(target):
    """A prefill step reads one column per prompt and a verification ``len(block) + 1`` per
    sequence: the head's rows are those, packed, not every new token of the padded pass nor the
    padding of a sequence whose block is shorter than another's."""
    batch = prompts(3)
    params = SamplingParams(max_tokens=8)
    expected = autoregressive(target, batch, params)
    references = [p + e.token_ids + [0] * 8 for p, e in zip(batch, expected)]
    expected = [e.token_ids for e in expected]
    rows = []
    hook = target.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1]))
    try:
        # Blocks for the even sequences only: every step verifies blocks of different lengths.
        engine = SpeculativeEngine(target, _HalfOracleDrafter(references, VOCAB),
                                   EngineConfig(max_num_seqs=3, block_size=3, mode="sync", adaptive_block=False))
        lengths = []
        verify = engine._verify_pass
        engine._verify_pass = lambda running, blocks: (lengths.append([len(b) for b in blocks]), verify(running, blocks))[1]
        got = [g.token_ids for g in engine.generate(batch, params)]
    finally:
        hook.remove()
    assert got == expected
    assert min(map(len, batch)) > 1  # the prefill step too: one column per prompt (it drafts nothing)
    assert lengths[0] == [0] * len(batch)
    assert rows == [(sum(n + 1 for n in blocks),) for blocks in lengths]
    assert any(len(set(blocks)) > 1 for blocks in lengths)  # some steps verified blocks of different lengths


def test_stop_tokens_end_like_plain_decoding(target, drafter_model):
    batch = prompts(4)
    plain = autoregressive(target, batch, SamplingParams(max_tokens=30))
    stop = plain[0].token_ids[5]  # a token that certainly occurs
    params = SamplingParams(max_tokens=30, stop_token_ids=(stop,))
    expected = autoregressive(target, batch, params)
    engine = SpeculativeEngine(target, D3DDrafter(drafter_model, max_num_seqs=2), EngineConfig(max_num_seqs=2, block_size=5))
    got = engine.generate(batch, params)
    assert [(g.token_ids, g.finish_reason) for g in got] == [(e.token_ids, e.finish_reason) for e in expected]


class _OracleDrafter(Drafter):
    """Knows the target's greedy continuation; drafts it with an error every few tokens and
    answers `speculate` with the true outcome's next block, except every third call (a miss)."""

    name, max_block, can_speculate = "oracle", 8, True

    def __init__(self, reference: list[int], vocab_size: int):
        self.reference, self.vocab_size = reference, vocab_size
        self.draft_calls = self.speculate_calls = 0

    def _block(self, context, size):
        block = self.reference[len(context) : len(context) + size]
        if len(block) > 2:
            block[2] = (block[2] + 1) % self.vocab_size  # wrong third token: k = 2 outcomes
        return DraftBlock(tokens=block, probs=None, confidence=[0.9] * len(block))

    def draft(self, requests):
        self.draft_calls += 1
        return [self._block(r.context, r.block_size) for r in requests]

    def speculate(self, requests):
        self.speculate_calls += 1
        out = []
        for r in requests:
            k = 0
            while k < len(r.block) and self.reference[len(r.context) + k] == r.block[k]:
                k += 1
            committed = r.context + r.block[:k] + [self.reference[len(r.context) + k]]
            wrong = (k, (self.reference[len(r.context) + k] + 1) % self.vocab_size)
            candidates = {wrong: self._block(committed, r.block_size)}
            if self.speculate_calls % 3:
                candidates[(k, committed[-1])] = self._block(committed, r.block_size)
            out.append(candidates)
        return out


def test_hit_needs_no_new_draft_call(target):
    (prompt,) = prompts(1)
    params = SamplingParams(max_tokens=40)
    (expected,) = autoregressive(target, [prompt], params)
    drafter = _OracleDrafter(prompt + expected.token_ids + [0] * 64, VOCAB)
    engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=1, block_size=4, adaptive_block=False))
    (got,) = engine.generate([prompt], params)
    assert got.token_ids == expected.token_ids
    stats = engine.stats
    misses = stats.num_candidate_lookups - stats.num_candidate_hits
    assert stats.num_candidate_hits > 0 and misses > 0
    # One draft for the first block, then one per miss that still needs a block: hits cost none.
    assert drafter.draft_calls in (1 + misses, misses)
    assert stats.tau > 2.5  # the oracle's blocks are right up to the third token


class _FailingDrafter(Drafter):
    name, vocab_size, max_block = "failing", VOCAB, 8

    def draft(self, requests):
        raise DrafterUnavailable("gone")


def test_unreachable_drafter_falls_back_to_plain_decoding(target):
    batch = prompts(3)
    params = SamplingParams(max_tokens=16)
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    engine = SpeculativeEngine(target, _FailingDrafter(), EngineConfig(max_num_seqs=3, block_size=4))
    assert [g.token_ids for g in engine.generate(batch, params)] == expected


class _HalfOracleDrafter(Drafter):
    """Drafts the target's own greedy continuation for even sequence ids, nothing for odd ones."""

    name, max_block = "half-oracle", 8

    def __init__(self, references: list[list[int]], vocab_size: int):
        self.references, self.vocab_size = references, vocab_size
        self.nonempty = 0  # blocks drafted with at least one token

    def draft(self, requests):
        blocks = []
        for r in requests:
            tokens = [] if r.seq_id % 2 else self.references[r.seq_id][len(r.context) : len(r.context) + r.block_size]
            self.nonempty += bool(tokens)
            blocks.append(DraftBlock(tokens=tokens, probs=None, confidence=[0.9] * len(tokens)))
        return blocks


def test_num_drafts_counts_drafted_blocks_only_and_tau_every_sequence_pass(target):
    """vLLM's meaning: a sequence's plain step (no drafted block) is no draft; τ still averages over
    every sequence's every pass."""
    batch = prompts(6)
    params = SamplingParams(max_tokens=20)
    expected = autoregressive(target, batch, params)
    references = [p + e.token_ids + [0] * 8 for p, e in zip(batch, expected)]
    engine = SpeculativeEngine(target, _HalfOracleDrafter(references, VOCAB),
                               EngineConfig(max_num_seqs=3, block_size=4, mode="sync", adaptive_block=False))
    got = engine.generate(batch, params)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    stats = engine.stats
    assert stats.num_sequence_passes == sum(g.num_passes for g in got)
    # Every non-empty block is verified (a fixed block), and only the even sequences draft any.
    assert stats.num_drafts == engine.drafter.nonempty < sum(g.num_passes for i, g in enumerate(got) if i % 2 == 0)
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens == sum(sum(g.accepted_lengths) for g in got)
    assert stats.tau == stats.num_accepted_tokens / stats.num_sequence_passes + 1
    assert stats.tau > 1.5  # the even sequences' drafts are the target's own tokens
    plain = SpeculativeEngine(target, None, EngineConfig(max_num_seqs=3, block_size=0))
    plain.generate(batch, params)
    assert (plain.stats.num_drafts, plain.stats.tau) == (0, 1.0)
    assert plain.stats.num_sequence_passes == sum(len(e.token_ids) for e in expected)


class _CountingOracle(_HalfOracleDrafter):
    """The half-oracle, counting its calls and refusing to draft for a context that is only a
    prompt (a sequence before its first token)."""

    def __init__(self, references, vocab_size, prompt_lens):
        super().__init__(references, vocab_size)
        self.prompt_lens, self.calls = prompt_lens, 0

    def draft(self, requests):
        self.calls += 1
        for r in requests:
            assert len(r.context) > self.prompt_lens[r.seq_id], f"drafted for sequence {r.seq_id}'s bare prompt"
        return super().draft(requests)


class _StepLog(SpeculativeEngine):
    """Records, per step, whether it prefilled a prompt and how many drafter calls it made."""

    def step(self, running):
        prefill = any(len(s.context) - s.cached > 1 for s in running)
        before = self.drafter.calls
        super().step(running)
        self.log.append((prefill, self.drafter.calls - before))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_step_that_prefills_makes_no_blocking_draft(target, mode):
    """TTFT: a new request's first token waits for its prefill pass only, never for a drafter
    call (continuous batching: requests join a running batch). Steps without a prefill still
    draft, and the output is plain greedy output."""
    batch = prompts(7)
    params = SamplingParams(max_tokens=12)
    expected = autoregressive(target, batch, params)
    references = [p + e.token_ids + [0] * 8 for p, e in zip(batch, expected)]
    drafter = _CountingOracle(references, VOCAB, [len(p) for p in batch])
    engine = _StepLog(target, drafter, EngineConfig(max_num_seqs=3, block_size=4, mode=mode, adaptive_block=False))
    engine.log = []
    got = engine.generate(batch, params)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    prefills = [calls for prefill, calls in engine.log if prefill]
    assert len(prefills) >= 3  # the first step and later admissions
    assert prefills == [0] * len(prefills)
    assert sum(calls for prefill, calls in engine.log if not prefill) > 0


def test_full_batch_counters_cover_exactly_the_steps_with_every_row_busy(target):
    """`EngineStats.full_batch_tokens` counts the tokens of steps that ran every cache row, and
    nothing of the drain: plain decoding of 7 equal-length requests through 3 rows runs two full
    waves and a last request alone; speculation at uneven speeds refills rows as they free."""
    batch = prompts(7)
    params = SamplingParams(max_tokens=20)
    expected = autoregressive(target, batch, params)
    references = [p + e.token_ids + [0] * 8 for p, e in zip(batch, expected)]
    for drafter in (None, _HalfOracleDrafter(references, VOCAB)):
        engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=3, block_size=4 if drafter else 0,
                                                                 mode="sync", adaptive_block=False))
        seen = []  # (rows running, tokens the step committed)
        step = engine.step

        def counting(running, step=step, engine=engine, seen=seen):
            before = engine.stats.num_emitted_tokens
            step(running)
            seen.append((len(running), engine.stats.num_emitted_tokens - before))

        engine.step = counting
        got = engine.generate(batch, params)
        assert [g.token_ids for g in got] == [e.token_ids for e in expected]
        full = sum(tokens for rows, tokens in seen if rows == 3)
        assert engine.stats.full_batch_tokens == full > 0
        assert 0 < engine.stats.full_batch_seconds <= engine.stats.seconds_total
        total = sum(len(e.token_ids) for e in expected)
        assert full < total
        if drafter is None:
            assert full == total - 20  # the seventh request alone


def test_the_drafter_contract_answers_for_what_a_drafter_lacks(drafter_model):
    from specd.drafters.dflash import DFlashDrafter

    ngram = NgramDrafter(vocab_size=VOCAB)
    assert not ngram.can_speculate and not ngram.needs_target_hidden
    with pytest.raises(NotImplementedError, match="can_speculate"):
        ngram.speculate([])
    with pytest.raises(NotImplementedError, match="needs_target_hidden"):
        ngram.observe(0, [1], torch.zeros(1, 4))
    ngram.release(0)  # nothing kept for an unknown sequence: no error
    assert D3DDrafter(drafter_model).can_speculate
    config = dataclasses.replace(D3D_FLAVOURS["debug"], target_hidden_size=FLAVOURS["debug"].hidden_size)
    dflash = DFlashDrafter(D3DModel(config))
    assert dflash.needs_target_hidden and not dflash.can_speculate

    class NoDraft(Drafter):
        name, vocab_size, max_block = "no-draft", VOCAB, 4

    with pytest.raises(TypeError, match="abstract"):
        NoDraft()


def test_bad_engine_input(target, drafter_model):
    drafter = D3DDrafter(drafter_model, max_num_seqs=1)
    with pytest.raises(ValueError, match="max_block"):
        SpeculativeEngine(target, drafter, EngineConfig(block_size=64))
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        drafter.draft([DraftRequest(seq_id=0, context=[1], block_size=0, params=SamplingParams())])
    other = D3DDrafter(D3DModel(dataclasses.replace(D3D_FLAVOURS["debug"], vocab_size=VOCAB + 1)))
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeEngine(target, other, EngineConfig(block_size=4))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_greedy_dflash_style_equals_plain_greedy(target):
    from specd.drafters.dflash import DFlashDrafter

    torch.manual_seed(5)
    config = dataclasses.replace(D3D_FLAVOURS["debug"], target_hidden_size=FLAVOURS["debug"].hidden_size)
    drafter = DFlashDrafter(D3DModel(config).eval(), max_num_seqs=4)
    batch = prompts(6)
    params = SamplingParams(max_tokens=20)
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    # Full blocks every step: a random drafter's low confidence would let the cost model verify
    # none of them (and turn it off), and this test is about the drafts' verification.
    engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=4, block_size=5, mode="sync",
                                                             adaptive_block=False))
    assert [g.token_ids for g in engine.generate(batch, params)] == expected
    assert engine.stats.num_draft_tokens > 0


def test_drafter_process_lossless_and_killed_drafter_loses_no_request(target, drafter_model, tmp_path):
    from specd.drafters.process import ProcessDrafter
    from specd.models.loading import save_model

    save_model(drafter_model, tmp_path / "drafter")
    batch = prompts(4)
    params = SamplingParams(max_tokens=24)
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    drafter = ProcessDrafter(tmp_path / "drafter", max_num_seqs=4)
    # Blocks verified whole: the cost model may not turn a random drafter off before it dies.
    engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=4, block_size=4, mode="async",
                                                             adaptive_block=False))
    assert [g.token_ids for g in engine.generate(batch, params)] == expected
    drafter.kill()  # the drafter dies between requests: output stays exact, decoding goes plain
    assert [g.token_ids for g in engine.generate(batch, params)] == expected
    assert engine.drafter is None
    engine.close()
    drafter.close()


class _NoisyTargetDrafter(Drafter):
    """Samples blocks from q = 0.6 p + 0.4 (uniform over p's top 8), p being the target's own
    processed distribution: drafts that are often but not always accepted, with a full q."""

    name, max_block = "noisy-target", 8

    def __init__(self, target):
        self.target, self.vocab_size = target, target.config.vocab_size
        self.generator = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def draft(self, requests):
        from specd.batch import ForwardBatch
        from specd.sampling import target_probs

        contexts = [list(r.context) for r in requests]
        # The test's requests differ in their seeds only: one processing for the whole batch.
        params = requests[0].params
        tokens = [[] for _ in requests]
        probs = []
        for _ in range(requests[0].block_size):
            logits = self.target(ForwardBatch.causal(contexts))
            rows = logits[torch.arange(len(contexts)), torch.tensor([len(c) - 1 for c in contexts])]
            uniform = torch.zeros_like(rows).scatter_(1, rows.topk(8).indices, 1 / 8)
            q = 0.6 * target_probs(rows, params) + 0.4 * uniform
            if params.keyed:  # coupled with the target's keyed choice at this position
                drawn = [int(keyed_sample(q[b : b + 1], r.params.seed, len(contexts[b])))
                         for b, r in enumerate(requests)]
            else:
                drawn = torch.multinomial(q, 1, generator=self.generator).flatten().tolist()
            for b, token in enumerate(drawn):
                tokens[b].append(token)
                contexts[b].append(token)
            probs.append(q)
        probs = torch.stack(probs, dim=1)  # [batch, block, vocab]
        return [DraftBlock(tokens=t, probs=probs[b], confidence=[0.5] * len(t)) for b, t in enumerate(tokens)]


class _CountedGeneratorEngine(SpeculativeEngine):
    """The engine, with the generator of the n-th sequence it starts seeded n: unseeded requests
    (the rejection sampler's path) made reproducible for a distribution test."""

    num_started = 0

    def start(self, seq_id, prompt, params, row):
        seq = super().start(seq_id, prompt, params, row)
        seq.generator.manual_seed(self.num_started)
        self.num_started += 1
        return seq


@pytest.mark.parametrize("temperature, top_p, seeded", [(1.0, 1.0, True), (0.7, 0.9, True), (1.0, 1.0, False), (0.7, 0.9, False)])
def test_sampled_engine_output_has_the_target_distribution(temperature, top_p, seeded):
    """20k two-token samples through the engine (stochastic drafts with a full q) against the
    exact distribution of the target's first two tokens: seeded requests (keyed sampling, drafts
    coupled) and unseeded ones (the rejection sampler)."""
    torch.manual_seed(7)
    target = Qwen3ForCausalLM(FLAVOURS["debug"]).eval()  # unsharpened: several tokens survive top-p
    from stats_check import chi_square_check

    from specd.batch import ForwardBatch
    from specd.sampling import target_probs

    # One token: nothing to prefill, so the first step drafts and both tokens go through the
    # rejection sampler (a step that prefills a longer prompt drafts nothing).
    prompt = prompts(1)[0][:1]
    params = SamplingParams(max_tokens=2, temperature=temperature, top_k=4, top_p=top_p)
    with torch.no_grad():
        first = target_probs(target(ForwardBatch.causal([prompt]))[0, -1], params)
        exact = {}
        for t1 in first.nonzero().flatten().tolist():
            second = target_probs(target(ForwardBatch.causal([prompt + [t1]]))[0, -1], params)
            for t2 in second.nonzero().flatten().tolist():
                exact[(t1, t2)] = float(first[t1] * second[t2])
    assert len(exact) >= 6  # a distribution worth testing, not a near-certain outcome
    batch = 200
    engine = _CountedGeneratorEngine(target, _NoisyTargetDrafter(target),
                                     EngineConfig(max_num_seqs=batch, block_size=3, mode="sync", adaptive_block=False))
    samples = []
    for call in range(100):
        requests = [SamplingParams(max_tokens=2, temperature=temperature, top_k=4, top_p=top_p,
                                   seed=call * batch + i if seeded else None) for i in range(batch)]
        samples.extend(tuple(g.token_ids) for g in engine.generate([prompt] * batch, requests))
    engine.close()
    ok, report = chi_square_check(samples, exact)
    assert ok, report
    assert engine.stats.num_accepted_tokens > 0  # drafts were really used, not only corrections
    assert engine.stats.num_drafts >= len(samples)  # every request's first token was drafted for


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_draft_headroom_drafts_what_is_verified_and_stays_lossless(target, drafter_model, mode):
    """With draft_headroom, every Draft/Speculate asks for at most the cost model's last chosen
    length + headroom tokens (the first call: the full block), and greedy output is unchanged."""
    batch = prompts(4)
    params = SamplingParams(max_tokens=32)
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    drafter = D3DDrafter(drafter_model, max_num_seqs=4)
    asked = []  # (block size asked for, length the cost model chose last)
    for name in ("draft", "speculate"):
        def record(requests, _call=getattr(drafter, name)):
            asked.extend((r.block_size, engine._chosen_length) for r in requests)
            return _call(requests)
        setattr(drafter, name, record)
    engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=4, block_size=16, mode=mode, draft_headroom=2))
    # Speculate at least every other step whatever the timings say, so there are lengths to follow.
    engine.cost_model = CostModel(explore_every=2, max_explore_every=2)
    # A random drafter's confidence is low: the cost model picks short lengths.
    got = [g.token_ids for g in engine.generate(batch, params)]
    engine.close()
    assert got == expected
    assert asked and all(size <= min(16, chosen + 2) for size, chosen in asked)
    assert any(size < 16 for size, _ in asked[1:]), "the drafted block never followed the chosen length"
    with pytest.raises(ValueError, match="draft_headroom"):
        EngineConfig(draft_headroom=0)


class _TimedSpeculation(Drafter):
    """A D3D drafter whose candidate pass takes ``delay`` seconds (0: answers at once, with no
    candidates); records each budget asked for."""

    name = "timed"

    def __init__(self, inner: D3DDrafter, delay: float):
        self.inner, self.delay, self.budgets = inner, delay, []
        self.vocab_size, self.max_block, self.can_speculate = inner.vocab_size, inner.max_block, True

    def draft(self, requests):
        return self.inner.draft(requests)

    def speculate(self, requests):
        self.budgets.append(requests[0].budget)
        if not self.delay:  # instant (no candidates): it always fits
            return [{} for _ in requests]
        time.sleep(self.delay)
        return self.inner.speculate(requests)

    def release(self, seq_id):
        self.inner.release(seq_id)


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_candidate_budget_shrinks_while_the_candidate_pass_outlasts_verification(target, drafter_model, delay):
    """A candidate pass slower than the verification beside it is cut down to one outcome (it is
    on the critical path); one that fits keeps the configured budget. Output is unchanged."""
    batch = prompts(1)
    params = SamplingParams(max_tokens=24)
    expected = [g.token_ids for g in autoregressive(target, batch, params)]
    drafter = _TimedSpeculation(D3DDrafter(drafter_model, max_num_seqs=1), delay)
    engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=1, block_size=4, mode="async",
                                                             candidate_budget=4, adaptive_block=False))
    assert [g.token_ids for g in engine.generate(batch, params)] == expected
    engine.close()
    assert drafter.budgets[0] == 4
    if delay:
        assert drafter.budgets[3:] and set(drafter.budgets[3:]) == {1}, drafter.budgets
    else:  # back to the configured budget (a loaded machine may delay a finished future's join)
        assert len(drafter.budgets) > 3 and max(drafter.budgets[3:]) == 4, drafter.budgets


# ---------------------------------------------------------------------------- seeded sampling
class _DyingDrafter(Drafter):
    """A D3D drafter that becomes unreachable after ``calls`` calls: killed mid-request."""

    name = "dying"

    def __init__(self, inner: D3DDrafter, calls: int):
        self.inner, self.calls = inner, calls
        self.vocab_size, self.max_block, self.can_speculate = inner.vocab_size, inner.max_block, inner.can_speculate

    def _call(self, method, requests):
        self.calls -= 1
        if self.calls < 0:
            raise DrafterUnavailable("killed")
        return method(requests)

    def draft(self, requests):
        return self._call(self.inner.draft, requests)

    def speculate(self, requests):
        return self._call(self.inner.speculate, requests)

    def release(self, seq_id):
        self.inner.release(seq_id)


SEEDED = [  # ragged batch: one of each kind of sampled request, each with its own seed
    SamplingParams(max_tokens=24, temperature=1.0, seed=11),
    SamplingParams(max_tokens=17, temperature=0.8, top_k=20, seed=2**64 - 1),
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=0),
    SamplingParams(max_tokens=20, temperature=1.0, top_k=50, top_p=0.95, repetition_penalty=1.3, seed=12345),
]

DRAFTERS = {
    "ngram": lambda target, model, rows: NgramDrafter(vocab_size=VOCAB),
    "d3d": lambda target, model, rows: D3DDrafter(model, max_num_seqs=rows),
    "d3d-killed": lambda target, model, rows: _DyingDrafter(D3DDrafter(model, max_num_seqs=rows), calls=3),
    "noisy-target": lambda target, model, rows: _NoisyTargetDrafter(target),
}


@pytest.fixture(scope="module")
def sampled_target():
    """A target whose sampled text at T = 1 is neither near-greedy nor near-uniform."""
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(FLAVOURS["debug"]).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
    return model


@pytest.fixture(scope="module")
def seeded_expected(sampled_target):
    """Plain in-process decoding of the seeded requests: batch 1 and the ragged batch of 4."""
    batch = prompts(4)
    return {1: autoregressive(sampled_target, batch[:1], SEEDED[:1]), 4: autoregressive(sampled_target, batch, SEEDED)}


def test_seeded_plain_decoding_is_reproducible_and_seed_dependent(sampled_target, seeded_expected):
    """The reference itself: the same seed gives the same tokens in another batch (batch 1 vs 4,
    the engine without a drafter), another seed other tokens (so the tests below can fail)."""
    batch = prompts(4)
    assert seeded_expected[1][0].token_ids == seeded_expected[4][0].token_ids
    engine = SpeculativeEngine(sampled_target, None, EngineConfig(max_num_seqs=4, block_size=0))
    assert [g.token_ids for g in engine.generate(batch, SEEDED)] == [g.token_ids for g in seeded_expected[4]]
    other = [dataclasses.replace(p, seed=p.seed ^ 1) for p in SEEDED]
    reseeded = autoregressive(sampled_target, batch, other)
    for a, b in zip(reseeded, seeded_expected[4]):
        assert a.token_ids != b.token_ids
    # Sampling, not greedy: most outputs leave the argmax path somewhere.
    greedy = autoregressive(sampled_target, batch, [dataclasses.replace(p, temperature=0.0) for p in SEEDED])
    assert sum(g.token_ids != e.token_ids for g, e in zip(greedy, seeded_expected[4])) >= 3


@pytest.mark.parametrize("num_seqs", [1, 4])
@pytest.mark.parametrize("block_size", [2, 8])
@pytest.mark.parametrize("drafter, mode", [("ngram", "sync"), ("noisy-target", "sync"), ("d3d", "sync"),
                                           ("d3d", "async"), ("d3d-killed", "sync"), ("d3d-killed", "async")])
def test_seeded_sampling_equals_plain_decoding_whatever_drafts(
    sampled_target, drafter_model, seeded_expected, drafter, mode, block_size, num_seqs
):
    """Same seed, same tokens: `SpeculativeEngine.generate` with any drafter (one killed
    mid-request included), sync or async, any block size and batch gives exactly plain decoding's.
    Every block is verified whole (a random drafter's low confidence would have the cost model
    verify few drafted tokens, and the test would test little)."""
    batch = prompts(4)[:num_seqs]
    engine = SpeculativeEngine(sampled_target, DRAFTERS[drafter](sampled_target, drafter_model, num_seqs),
                               EngineConfig(max_num_seqs=num_seqs, block_size=block_size, mode=mode,
                                            adaptive_block=False))
    got = engine.generate(batch, SEEDED[:num_seqs])
    engine.close()
    assert [g.token_ids for g in got] == [e.token_ids for e in seeded_expected[num_seqs]]
    stats = engine.stats
    assert stats.num_draft_tokens > 0, "no drafted token was verified: the test would not test speculation"
    if drafter == "noisy-target":  # coupled drafts of a close q: often accepted, sometimes not
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if drafter == "d3d-killed":
        assert engine.drafter is None


def test_async_target_threads_share_the_cores_only_beside_a_candidate_pass(target, drafter_model):
    """With ``async_target_threads=1`` on an engine built at 2 threads: a target pass with a
    candidate pass beside it runs on 1 thread, and so does the candidate pass; a pass without one
    (a plain step, or a speculative step drafting after verification) runs on all 2; closing the
    engine gives the caller back its 2. Output is plain greedy's."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = prompts(2)
        params = SamplingParams(max_tokens=24)
        expected = [g.token_ids for g in autoregressive(target, batch, params)]
        drafter = D3DDrafter(drafter_model, max_num_seqs=2)
        beside = []  # threads the candidate passes ran on
        speculate = drafter.speculate

        def record(requests):
            beside.append(torch.get_num_threads())
            return speculate(requests)

        drafter.speculate = record
        engine = SpeculativeEngine(target, drafter, EngineConfig(max_num_seqs=2, block_size=4, mode="async",
                                                                 async_target_threads=1))
        # Every kind of step in turn, whatever the timings say.
        engine.cost_model = CostModel(explore_every=1, max_explore_every=1)
        passes = []  # (candidate pass beside?, threads of the target pass)
        overlaps, logits = engine._overlaps, engine._target_logits

        def overlapping(num_seqs):
            engine._beside = overlaps(num_seqs)
            return engine._beside

        def timed(batch_, where):
            passes.append((engine._beside, torch.get_num_threads()))
            engine._beside = False
            return logits(batch_, where)

        engine._beside = False
        engine._overlaps, engine._target_logits = overlapping, timed
        got = [g.token_ids for g in engine.generate(batch, params)]
        engine.close()
        assert got == expected
        assert beside and set(beside) == {1}
        assert {threads for overlap, threads in passes if overlap} == {1}
        assert {threads for overlap, threads in passes if not overlap} == {2}
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="async_target_threads"):
            EngineConfig(async_target_threads=0)
    finally:
        torch.set_num_threads(previous)

