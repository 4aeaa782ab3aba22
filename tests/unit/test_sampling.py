"""The rejection sampler is lossless: greedy is the argmax rule, sampled output has the target's
distribution (and a deliberately broken sampler is caught by the same check), the batched form
equals the per-sequence form, and trees of candidates are lossless too. Keyed (seeded) sampling is
an exact sample of p, and its verification gives plain keyed decoding's tokens whatever was drafted."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_check import chi_square_check

from specd.drafters.base import check_block_size
from specd.sampling import (
    SamplingParams,
    VerifyResult,
    keyed_sample,
    position_key,
    target_probs,
    verify_batch,
    verify_block,
    verify_greedy,
    verify_keyed,
    verify_tree,
    verify_tree_keyed,
)
from specd.tree import TokenTree

VOCAB = 8
BLOCK = 3
NUM_SAMPLES = 20_000
SAMPLED = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-p0.9": SamplingParams(temperature=0.7, top_p=0.9),
}


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_probs(num_rows: int, vocab: int, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    return target_probs(torch.randn(num_rows, vocab, generator=gen) * 2, params)


# ---------------------------------------------------------------------------- greedy
@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 12),
    num_draft=st.integers(0, 6),
    stochastic_draft=st.booleans(),
    hit_rate=st.floats(0, 1),
)
def test_greedy_is_the_argmax_rule(seed, vocab, num_draft, stochastic_draft, hit_rate):
    gen = generator(seed)
    p = random_probs(num_draft + 1, vocab, SamplingParams(temperature=0), gen)  # one-hot rows
    argmax = p.argmax(-1).tolist()
    # Drafts agree with the argmax some of the time; q is a full distribution (with zeros) or None.
    draft = [
        a if torch.rand((), generator=gen) < hit_rate else int(torch.randint(vocab, (), generator=gen))
        for a in argmax[:num_draft]
    ]
    q = None
    if stochastic_draft:
        q = torch.randn(num_draft, vocab, generator=gen).softmax(-1)
        q = q * (torch.rand(num_draft, vocab, generator=gen) > 0.3)  # some exact zeros
        q = q / q.sum(-1, keepdim=True).clamp(min=1e-12)
    expected_k = next((i for i, (d, a) in enumerate(zip(draft, argmax)) if d != a), num_draft)

    sampler = generator(seed + 1)
    state = sampler.get_state()
    result = verify_block(torch.tensor(draft, dtype=torch.long), q, p, sampler)
    assert result.num_accepted == expected_k
    assert result.accepted_tokens == draft[:expected_k]
    assert result.next_token == argmax[expected_k]
    assert torch.equal(sampler.get_state(), state), "greedy verification consumed randomness"

    # A tree of distinct candidates under greedy: follow the argmax child, then the argmax.
    tree = TokenTree.from_paths([(0, draft), (0, [(t + 1) % vocab for t in draft]), (0, [0, 1, 0])])
    rows = random_probs(tree.num_nodes + 1, vocab, SamplingParams(temperature=0), gen)
    expected_path, slot, parents, tokens = [], 0, tree.parents.tolist(), tree.tokens.tolist()
    while True:
        best = int(rows[slot].argmax())
        match = [n for n in range(tree.num_nodes) if parents[n] == slot - 1 and tokens[n] == best]
        if not match:
            break
        expected_path.append(match[0])
        slot = match[0] + 1
    assert verify_tree(tree, None, rows, sampler) == (expected_path, best)
    assert torch.equal(sampler.get_state(), state), "greedy tree verification consumed randomness"


# ---------------------------------------------------------------------------- distribution check
class MarkovTarget:
    """A target whose next-token distribution depends on the last token (state 0 starts),
    and a drafter whose q is a noisy version of it (full support, even where p is 0)."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        gen = generator(seed)
        logits = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
        self.p = target_probs(logits, params)  # [state, vocab]
        self.q = (logits + torch.randn(VOCAB, VOCAB, generator=gen)).softmax(-1)
        self.accepted_lengths: Counter[int] = Counter()

    def first_two_probs(self) -> tuple[dict, dict]:
        first = {a: float(self.p[0, a]) for a in range(VOCAB)}
        pairs = {(a, b): float(self.p[0, a] * self.p[a, b]) for a in range(VOCAB) for b in range(VOCAB)}
        return first, pairs

    def direct(self, gen: torch.Generator) -> tuple[int, int]:
        a = int(torch.multinomial(self.p[0], 1, generator=gen))
        return a, int(torch.multinomial(self.p[a], 1, generator=gen))

    def speculative(self, verify, gen: torch.Generator) -> tuple[int, int]:
        """Draft blocks of BLOCK from q and verify them until two tokens are committed."""
        emitted, state = [], 0
        while len(emitted) < 2:
            draft, prev = [], state
            for _ in range(BLOCK):
                prev = int(torch.multinomial(self.q[prev], 1, generator=gen))
                draft.append(prev)
            states = torch.tensor([state, *draft])
            result = verify(torch.tensor(draft), self.q[states[:-1]], self.p[states], gen)
            self.accepted_lengths[result.num_accepted] += 1
            emitted += result.output_tokens
            state = emitted[-1]
        return emitted[0], emitted[1]


def stopped_at(draft_tokens, k: int, probs: torch.Tensor, gen: torch.Generator) -> VerifyResult:
    token = int(torch.multinomial(probs, 1, generator=gen))
    return VerifyResult(
        num_draft_tokens=len(draft_tokens), num_accepted=k, accepted_tokens=draft_tokens[:k].tolist(), next_token=token
    )


def broken_correction_from_p(draft_tokens, draft_probs, target_probs, gen) -> VerifyResult:
    """Wrong on purpose: the correction is sampled from p, not from the residual max(p - q, 0)."""
    for i, x in enumerate(draft_tokens.tolist()):
        if not float(torch.rand((), generator=gen)) * float(draft_probs[i, x]) < float(target_probs[i, x]):
            return stopped_at(draft_tokens, i, target_probs[i], gen)
    return stopped_at(draft_tokens, len(draft_tokens), target_probs[-1], gen)


def broken_accept_q_over_p(draft_tokens, draft_probs, target_probs, gen) -> VerifyResult:
    """Wrong on purpose: accepts with min(1, q/p) instead of min(1, p/q)."""
    for i, x in enumerate(draft_tokens.tolist()):
        if not float(torch.rand((), generator=gen)) * float(target_probs[i, x]) < float(draft_probs[i, x]):
            return stopped_at(draft_tokens, i, (target_probs[i] - draft_probs[i]).clamp(min=0), gen)
    return stopped_at(draft_tokens, len(draft_tokens), target_probs[-1], gen)


def check_first_two(samples: list[tuple[int, int]], target: MarkovTarget) -> tuple[bool, str]:
    first, pairs = target.first_two_probs()
    ok_first, msg_first = chi_square_check([s[0] for s in samples], first)
    ok_pairs, msg_pairs = chi_square_check(samples, pairs)
    return ok_first and ok_pairs, f"first token: {msg_first}; first two: {msg_pairs}"


@pytest.mark.parametrize("name", list(SAMPLED))
def test_speculative_sampling_matches_the_target(name):
    target = MarkovTarget(SAMPLED[name], seed=7)
    gen = generator(11)
    # The control: direct sampling with the same number of samples passes the same check.
    direct_ok, direct_msg = check_first_two([target.direct(gen) for _ in range(NUM_SAMPLES)], target)
    ok, msg = check_first_two([target.speculative(verify_block, gen) for _ in range(NUM_SAMPLES)], target)
    k_counts = sorted(target.accepted_lengths.items())
    print(f"\n{name}: direct     {direct_msg}\n{name}: speculative {msg}, k: {k_counts}")
    assert direct_ok, direct_msg
    assert ok, msg
    assert all(target.accepted_lengths[k] > 500 for k in range(BLOCK + 1)), "every accepted length 0..B must be exercised"


@pytest.mark.parametrize("broken", [broken_correction_from_p, broken_accept_q_over_p])
def test_the_check_rejects_a_broken_sampler(broken):
    target = MarkovTarget(SAMPLED["t1"], seed=7)
    gen = generator(11)
    ok, msg = check_first_two([target.speculative(broken, gen) for _ in range(NUM_SAMPLES)], target)
    print(f"\n{broken.__name__}: {msg}")
    assert not ok, f"a broken sampler passed the distribution check: {msg}"


# ---------------------------------------------------------------------------- trees
def broken_tree_keeps_rejected(tree, draft_probs, target_probs, gen):
    """Wrong on purpose: the correction is sampled from p, rejected candidates not removed."""
    children = [[] for _ in range(tree.num_nodes + 1)]
    for node, parent in enumerate(tree.parents.tolist()):
        children[parent + 1].append(node)
    path, slot = [], 0
    while True:
        residual = target_probs[slot].clone()
        for child in children[slot]:
            x = int(tree.tokens[child])
            if float(torch.rand((), generator=gen)) * float(residual.sum()) < float(residual[x]):
                break
            residual[x] = 0
        else:
            return path, int(torch.multinomial(target_probs[slot], 1, generator=gen))
        path.append(child)
        slot = child + 1


class TreeTarget(MarkovTarget):
    """Three distinct candidates at the root, two under each (fixed per state)."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        super().__init__(params, seed)
        gen = generator(seed + 1)
        order = torch.stack([torch.randperm(VOCAB, generator=gen) for _ in range(VOCAB)]).tolist()
        self.trees = []
        for state in range(VOCAB):
            paths = [(0, [a, b]) for a in order[state][:3] for b in order[a][:2]]
            tree = TokenTree.from_paths(paths)
            rows = self.p[torch.tensor([state, *tree.tokens.tolist()])]  # row 0 at the root, 1 + i after node i
            self.trees.append((tree, rows))

    def speculative(self, verify, gen: torch.Generator) -> tuple[int, int]:
        emitted, state = [], 0
        while len(emitted) < 2:
            tree, rows = self.trees[state]
            path, token = verify(tree, None, rows, gen)
            emitted += [int(tree.tokens[n]) for n in path] + [token]
            state = emitted[-1]
        return emitted[0], emitted[1]


@pytest.mark.parametrize("name", list(SAMPLED))
def test_tree_verification_matches_the_target(name):
    target = TreeTarget(SAMPLED[name], seed=3)
    gen = generator(5)
    ok, msg = check_first_two([target.speculative(verify_tree, gen) for _ in range(NUM_SAMPLES)], target)
    print(f"\n{name}: tree {msg}")
    assert ok, msg


def test_the_check_rejects_a_broken_tree_verifier():
    target = TreeTarget(SAMPLED["t1"], seed=3)
    gen = generator(5)
    ok, msg = check_first_two([target.speculative(broken_tree_keeps_rejected, gen) for _ in range(NUM_SAMPLES)], target)
    print(f"\nbroken tree: {msg}")
    assert not ok, f"a broken tree verifier passed the distribution check: {msg}"


def test_a_stochastic_chain_tree_is_verify_block():
    gen = generator(0)
    for seed in range(20):
        p = random_probs(5, VOCAB, SAMPLED["t1"], gen)
        q = torch.randn(4, VOCAB, generator=gen).softmax(-1)
        draft = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        block = verify_block(draft, q, p, generator(seed))
        path, token = verify_tree(TokenTree.chain(draft, anchor=3), q, p, generator(seed))
        assert (path, token) == (list(range(block.num_accepted)), block.next_token)


def test_stochastic_siblings_are_refused():
    tree = TokenTree.from_paths([(0, [1, 2]), (0, [3])])
    with pytest.raises(ValueError, match="must be a chain"):
        verify_tree(tree, torch.full((3, VOCAB), 1 / VOCAB), torch.full((4, VOCAB), 1 / VOCAB), generator(0))


# ---------------------------------------------------------------------------- batching
def test_batched_equals_per_sequence_with_per_request_seeds():
    gen = generator(123)
    vocab, num_seqs = 16, 9
    lengths = [3, 0, 5, 1, 4, 2, 0, 6, 3]
    params = [SamplingParams(temperature=0.0 if j % 4 == 0 else 0.8, top_p=0.9, seed=1000 + j) for j in range(num_seqs)]
    seqs = []
    for length, sp in zip(lengths, params):
        p = random_probs(length + 1, vocab, sp, gen)
        q = torch.randn(length, vocab, generator=gen).softmax(-1)
        # Drafts drawn from q, but often the target's likely token, so k varies over 0..B.
        draft = torch.empty(0, dtype=torch.long)
        if length:
            sampled = torch.multinomial(q, 1, generator=gen).squeeze(-1)
            draft = torch.where(torch.rand(length, generator=gen) < 0.85, p[:length].argmax(-1), sampled)
        seqs.append((draft, q, p))

    def batched(order: list[int], stochastic: bool) -> dict[int, VerifyResult]:
        cu = torch.tensor([0, *torch.tensor([lengths[j] for j in order]).cumsum(0).tolist()])
        results = verify_batch(
            torch.cat([seqs[j][0] for j in order]),
            cu,
            torch.cat([seqs[j][1] for j in order]) if stochastic else None,
            torch.cat([seqs[j][2] for j in order]),
            [params[j].generator() for j in order],
        )
        return dict(zip(order, results))

    for stochastic in (True, False):
        alone = {
            j: verify_block(draft, q if stochastic else None, p, params[j].generator())
            for j, (draft, q, p) in enumerate(seqs)
        }
        together = batched(list(range(num_seqs)), stochastic)
        assert together == alone
        # A sequence's output does not depend on its neighbours or its place in the batch.
        assert batched([7, 2, 5], stochastic) == {j: alone[j] for j in (7, 2, 5)}
        assert len({r.num_accepted for r in alone.values()}) > 2, "the test should see several accepted lengths"
        assert {r.is_bonus for r in alone.values() if r.num_draft_tokens} == {True, False}

    # One-hot q rows give what None gives (how a mixed batch passes its deterministic drafts).
    draft, _, p = seqs[2]
    one_hot = torch.nn.functional.one_hot(draft, vocab).float()
    assert verify_block(draft, one_hot, p, generator(9)) == verify_block(draft, None, p, generator(9))


# ---------------------------------------------------------------------------- bad input
def test_bad_params_raise_clear_errors():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-0.5)
    for top_p in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            SamplingParams(top_p=top_p)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        check_block_size(0, 8)
    with pytest.raises(ValueError, match="above this drafter's max_block 8"):
        check_block_size(9, 8)
    check_block_size(8, 8)


def test_bad_shapes_raise_clear_errors():
    p = torch.full((4, VOCAB), 1 / VOCAB)
    with pytest.raises(ValueError, match="target_probs must be"):
        verify_block(torch.tensor([1, 2, 3]), None, p[:3], generator(0))
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_block(torch.tensor([1, 2, 3]), p[:2], p, generator(0))
    with pytest.raises(ValueError, match="one generator per sequence"):
        verify_batch(torch.tensor([1, 2, 3]), torch.tensor([0, 3]), None, p, [])
    with pytest.raises(ValueError, match="cu_num_draft_tokens must rise"):
        verify_batch(torch.tensor([1, 2, 3]), torch.tensor([0, 2]), None, p, [generator(0)])
    with pytest.raises(ValueError, match="share one anchor"):
        verify_tree(TokenTree.from_paths([(0, [1]), (1, [2])]), None, p[:3], generator(0))


@pytest.mark.parametrize("seed", range(20))
def test_verify_greedy_equals_verify_block_on_one_hot_probs(seed):
    """The engine's argmax path for plain greedy requests: the outcome `verify_block` gives on the
    one-hot probabilities of the same logits, for blocks that match the argmax for a while."""
    generator = torch.Generator().manual_seed(seed)
    block_len = int(torch.randint(0, 9, (1,), generator=generator))
    logits = torch.randn(block_len + 1, 50, generator=generator)
    logits[:, 7] = logits.max(-1).values  # ties: both must take the first maximum
    best = logits.argmax(-1)
    block = best[:block_len].clone()
    if block_len and seed % 3:
        wrong = int(torch.randint(0, block_len, (1,), generator=generator))
        block[wrong] = (block[wrong] + 1) % 50
    expected = verify_block(block, None, target_probs(logits, SamplingParams(temperature=0.0)), torch.Generator())
    got = verify_greedy(block.tolist(), logits)
    assert (got.num_accepted, got.accepted_tokens, got.next_token) == (
        expected.num_accepted, expected.accepted_tokens, expected.next_token)


# ---------------------------------------------------------------------------- keyed (seeded) sampling
START = 5  # the Markov targets' first generated token sits after a 5-token prompt


def keyed_direct(target: MarkovTarget, seed: int, choose=keyed_sample) -> tuple[int, int]:
    """Plain keyed decoding of the first two tokens: position START, then START + 1."""
    a = int(choose(target.p[0:1], seed, START))
    return a, int(choose(target.p[a : a + 1], seed, START + 1))


def broken_keyed_argmax_e_times_p(probs: torch.Tensor, seed: int, start: int) -> torch.Tensor:
    """Wrong on purpose: argmax of E * p instead of argmin of E / p (same noise, same keys)."""
    rows = []
    for r in range(probs.shape[0]):
        gen = torch.Generator().manual_seed(position_key(seed, start + r))
        noise = -torch.rand(probs.shape[1], dtype=torch.float64, generator=gen).log()
        rows.append(int((noise * probs[r].double()).argmax()))
    return torch.tensor(rows)


def keyed_speculative(target: MarkovTarget, seed: int, coupled: bool, gen: torch.Generator) -> tuple[int, int]:
    """Draft blocks of BLOCK from q (keyed with the target's keys when ``coupled``, else from
    ``gen``) and verify them with `verify_keyed` until two tokens are committed."""
    emitted, state = [], 0
    while len(emitted) < 2:
        start, draft, prev = START + len(emitted), [], state
        for i in range(BLOCK):
            if coupled:
                prev = int(keyed_sample(target.q[prev : prev + 1], seed, start + i))
            else:
                prev = int(torch.multinomial(target.q[prev], 1, generator=gen))
            draft.append(prev)
        result = verify_keyed(draft, target.p[torch.tensor([state, *draft])], seed, start)
        target.accepted_lengths[result.num_accepted] += 1
        emitted += result.output_tokens
        state = emitted[-1]
    return emitted[0], emitted[1]


@pytest.mark.parametrize("name", list(SAMPLED))
def test_keyed_choice_is_an_exact_sample(name):
    """Over many seeds the keyed first two tokens have the target's distribution (p = 0 never
    chosen); over many positions of one seed the keyed token of one p has p's distribution."""
    target = MarkovTarget(SAMPLED[name], seed=7)
    ok, msg = check_first_two([keyed_direct(target, seed) for seed in range(NUM_SAMPLES)], target)
    print(f"\n{name}: keyed over seeds {msg}")
    assert ok, msg
    p = target.p[3]
    tokens = keyed_sample(p.expand(NUM_SAMPLES, VOCAB), 2**64 - 1, 0).tolist()  # positions 0..N-1
    ok, msg = chi_square_check(tokens, {v: float(p[v]) for v in range(VOCAB)})
    print(f"{name}: keyed over positions {msg}")
    assert ok, msg


def test_the_check_rejects_a_broken_keyed_choice():
    target = MarkovTarget(SAMPLED["t1"], seed=7)
    ok, msg = check_first_two([keyed_direct(target, s, broken_keyed_argmax_e_times_p) for s in range(NUM_SAMPLES)], target)
    print(f"\nbroken keyed choice: {msg}")
    assert not ok, f"a broken keyed choice passed the distribution check: {msg}"


def test_keyed_choice_depends_on_seed_and_position_only():
    gen = generator(0)
    p = random_probs(1, 64, SAMPLED["t1"], gen)
    again = [int(keyed_sample(p, 9, t)) for t in range(200)]
    assert again == keyed_sample(p.expand(200, 64), 9, 0).tolist()  # one row at a time or all together
    assert again != [int(keyed_sample(p, 10, t)) for t in range(200)]  # another seed, other tokens
    assert len(set(again)) > 10
    with pytest.raises(ValueError, match="no mass"):
        keyed_sample(torch.zeros(1, 8), 0, 0)
    assert SamplingParams(temperature=1.0, seed=0).keyed
    assert not SamplingParams(temperature=1.0).keyed
    assert not SamplingParams(temperature=0.0, seed=3).keyed  # greedy ignores the seed


@pytest.mark.parametrize("name", list(SAMPLED))
def test_keyed_verification_gives_plain_keyed_tokens(name):
    """Pathwise: whatever was drafted (coupled keyed drafts, independent ones), the committed tokens
    are plain keyed decoding's for the same seed; the coupling is accepted more often."""
    target = MarkovTarget(SAMPLED[name], seed=7)
    gen = generator(11)
    mean_k = {}
    for coupled in (True, False):
        target.accepted_lengths.clear()
        for seed in range(2000):
            assert keyed_speculative(target, seed, coupled, gen) == keyed_direct(target, seed), (coupled, seed)
        counts = target.accepted_lengths
        mean_k[coupled] = sum(k * n for k, n in counts.items()) / sum(counts.values())
        assert all(counts[k] > 0 for k in range(BLOCK + 1)), f"every accepted length 0..B must occur: {counts}"
    print(f"\n{name}: mean accepted length coupled {mean_k[True]:.3f}, independent {mean_k[False]:.3f}")
    assert mean_k[True] > mean_k[False]


def test_keyed_tree_verification_gives_plain_keyed_tokens():
    target = TreeTarget(SAMPLED["t1"], seed=3)
    num_accepted = Counter()
    for seed in range(2000):
        emitted, state = [], 0
        while len(emitted) < 2:
            tree, rows = target.trees[state]
            path, token = verify_tree_keyed(tree, rows, seed, START + len(emitted))
            num_accepted[len(path)] += 1
            emitted += [int(tree.tokens[n]) for n in path] + [token]
            state = emitted[-1]
        assert tuple(emitted[:2]) == keyed_direct(target, seed)
    assert all(num_accepted[k] > 0 for k in range(3)), num_accepted
    # A chain tree is a block.
    draft = [1, 2, 3]
    rows = random_probs(4, VOCAB, SAMPLED["t1"], generator(1))
    path, token = verify_tree_keyed(TokenTree.chain(draft, anchor=3), rows, 5, 3)
    block = verify_keyed(draft, rows, 5, 3)
    assert (path, token) == (list(range(block.num_accepted)), block.next_token)
