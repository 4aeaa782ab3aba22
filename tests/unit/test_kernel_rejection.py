"""The Triton rejection sampler equals its torch reference exactly (and a deliberately wrong kernel
does not), greedy is the argmax chain, and verify_batch_fast is lossless.

On a machine without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes are small."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from stats_check import chi_square_check

from specd.kernels.rejection import (
    Bug,
    draw_randoms,
    rejection_sample,
    rejection_sample_reference,
    verify_batch_fast,
)
from specd.sampling import SamplingParams, target_probs, verify_batch


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long)


def random_rows(num_rows: int, vocab: int, gen: torch.Generator, dyadic: bool) -> torch.Tensor:
    """Probability rows with exact zeros, ties and some one-hot rows (greedy requests).

    dyadic: every probability a multiple of 1/16, so sums are exact and the accept test and the
    inverse CDF meet their boundaries exactly (u * q(x) == p(x), v * mass == a running sum)."""
    if dyadic:
        units = torch.multinomial(torch.rand(num_rows, vocab, generator=gen), 16, replacement=True, generator=gen)
        counts = torch.zeros(num_rows, vocab).scatter_add_(1, units, torch.ones(num_rows, 16))
        return counts / 16
    # Rounded logits make ties; a temperature-0 row is one-hot at the first maximum.
    logits = (torch.randn(num_rows, vocab, generator=gen) * 2).round()
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=vocab // 3))  # zeros outside the top-k
    one_hot = torch.rand(num_rows, 1, generator=gen) < 0.25
    return torch.where(one_hot, target_probs(logits, SamplingParams(temperature=0.0)), probs)


def random_batch(seed: int, vocab: int, stochastic: bool, dyadic: bool = False) -> dict:
    """A ragged batch (blocks of 0..6, empty ones included) with drafts that are often the
    target's argmax, sometimes tied with it, sometimes drawn from q, sometimes impossible under p."""
    gen = generator(seed)
    lengths = torch.randint(0, 7, (7,), generator=gen).tolist() + [0, 6]
    num_seqs, num_draft_tokens = len(lengths), sum(lengths)
    cu = cu_of(lengths)
    p = random_rows(num_draft_tokens + num_seqs, vocab, gen, dyadic)
    q = random_rows(num_draft_tokens, vocab, gen, dyadic)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(lengths))
    p_of_token = p[torch.arange(num_draft_tokens) + seq_of_token]  # [num_draft_tokens, vocab]
    tied = (p_of_token == p_of_token.amax(-1, keepdim=True)).float()  # any of the maxima, not just the first
    choices = torch.stack(
        [
            p_of_token.argmax(-1),
            torch.multinomial(tied, 1, generator=gen).squeeze(-1),
            torch.multinomial(q, 1, generator=gen).squeeze(-1),
            torch.randint(vocab, (num_draft_tokens,), generator=gen),
        ],
        -1,
    )
    pick = torch.multinomial(torch.tensor([0.5, 0.2, 0.2, 0.1]), num_draft_tokens, replacement=True, generator=gen)
    draft = choices.gather(1, pick[:, None]).squeeze(1)
    if stochastic:
        # A mixed batch: some sequences' drafts are deterministic (one-hot q rows); in one row the
        # drafter sends a token its q gives 0 with p == q, so the residual is empty (fall back to p).
        deterministic = (torch.rand(num_seqs, generator=gen) < 0.3)[seq_of_token]
        q = torch.where(deterministic[:, None], torch.nn.functional.one_hot(draft, vocab).float(), q)
        first = int(cu[-2])  # the last sequence's first drafted token (its block has 6)
        draft[first] = p[first + num_seqs - 1].argmin()  # p(x) = 0: rows have 2/3 zeros
        q[first] = p[first + num_seqs - 1]
    coins = torch.rand(num_draft_tokens, generator=gen)
    uniforms = torch.rand(num_seqs, generator=gen)
    if dyadic:
        coins = (coins * 8).floor() / 8
        uniforms = (uniforms * 8).floor() / 8
    coins[::5] = 0.0  # u = 0 exactly: accepts any p(x) > 0, never p(x) = 0
    uniforms[::4] = 0.0  # v = 0: the first token with mass
    return {
        "draft_tokens": draft,
        "cu_num_draft_tokens": cu,
        "draft_probs": q if stochastic else None,
        "target_probs": p,
        "uniforms": uniforms,
        "coins": coins,
        "greedy": torch.rand(num_seqs, generator=gen) < 0.25,
    }


def compare(batch: dict, **kernel_options) -> tuple[int, str]:
    """Kernel vs. reference -> (number of sequences that differ, a line to print)."""
    k_kernel, token_kernel = rejection_sample(**batch, **kernel_options)
    k_ref, token_ref = rejection_sample_reference(**batch)
    differ = (k_kernel != k_ref) | (token_kernel != token_ref)
    max_k_diff = int((k_kernel - k_ref).abs().max())
    return int(differ.sum()), f"{int(differ.sum())}/{differ.numel()} sequences differ, max |k diff| {max_k_diff}"


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("stochastic", [False, True], ids=["deterministic-draft", "stochastic-draft"])
@pytest.mark.parametrize("block_v", [None, 32], ids=["autotuned", "block32"])
def test_kernel_equals_reference(stochastic, block_v):
    outcomes = {"k": set(), "correction": 0, "bonus": 0}
    for seed in range(6):
        vocab = (100, 257, 64)[seed % 3]  # 100 and 257 are not multiples of BLOCK_V
        batch = random_batch(seed, vocab, stochastic)
        num_differ, line = compare(batch, block_v=block_v)
        print(f"seed {seed} vocab {vocab}: {line}")
        assert num_differ == 0, line
        k, _ = rejection_sample_reference(**batch)
        lengths = batch["cu_num_draft_tokens"].diff()
        outcomes["k"] |= set(k.tolist())
        outcomes["correction"] += int((k < lengths).sum())
        outcomes["bonus"] += int((k == lengths).sum())
    # The batches must exercise what they claim to: many accepted lengths, both outcomes.
    assert len(outcomes["k"]) >= 4 and outcomes["correction"] >= 10 and outcomes["bonus"] >= 10, outcomes


DYADIC_SEEDS = range(100, 108)


@pytest.mark.parametrize("stochastic", [False, True], ids=["deterministic-draft", "stochastic-draft"])
def test_kernel_equals_reference_on_exact_boundaries(stochastic):
    """Dyadic inputs: u * q(x) == p(x) and v * mass == a running sum happen exactly."""
    for seed in DYADIC_SEEDS:
        num_differ, line = compare(random_batch(seed, 64, stochastic, dyadic=True), block_v=16)
        print(f"seed {seed}: {line}")
        assert num_differ == 0, line


@pytest.mark.parametrize("bug", [Bug.UNCLAMPED_RESIDUAL, Bug.ACCEPT_LE])
def test_the_comparison_catches_a_wrong_kernel(bug):
    total_differ = 0
    for seed in DYADIC_SEEDS:  # the batches the right kernel passes on
        batch = random_batch(seed, 64, stochastic=True, dyadic=True)
        num_differ, line = compare(batch, block_v=16, bug=bug)
        print(f"{bug.name} seed {seed}: {line}")
        total_differ += num_differ
    assert total_differ > 0, f"the kernel with {bug.name} passed the comparison with the reference"


# ---------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("stochastic", [False, True], ids=["deterministic-draft", "stochastic-draft"])
def test_greedy_is_the_argmax_chain(stochastic):
    seen_k = set()
    for seed in range(5):
        batch = random_batch(200 + seed, 100, stochastic)
        p = batch["target_probs"]
        batch["target_probs"] = p = p + 0.01 * (p > 0)  # soft rows, ties kept: the flag makes them greedy
        batch["greedy"] = torch.ones_like(batch["greedy"])
        cu, draft = batch["cu_num_draft_tokens"].tolist(), batch["draft_tokens"].tolist()
        expected_k, expected_token = [], []
        for j in range(len(cu) - 1):
            rows = p[cu[j] + j : cu[j + 1] + j + 1]
            argmax = [max(range(p.shape[1]), key=lambda t, row=row: (row[t], -t)) for row in rows.tolist()]
            block = draft[cu[j] : cu[j + 1]]
            k = next((i for i, (x, a) in enumerate(zip(block, argmax)) if x != a), len(block))
            expected_k.append(k)
            expected_token.append(argmax[k])
        seen_k |= set(expected_k)
        for name, sampler in (("kernel", rejection_sample), ("reference", rejection_sample_reference)):
            for coins, uniforms in (
                (batch["coins"], batch["uniforms"]),
                (torch.zeros_like(batch["coins"]), torch.full_like(batch["uniforms"], 0.999)),
            ):
                k, token = sampler(**{**batch, "coins": coins, "uniforms": uniforms})
                assert k.tolist() == expected_k, f"{name} seed {seed}"
                assert token.tolist() == expected_token, f"{name} seed {seed}"
    assert len(seen_k) >= 3, seen_k


def test_greedy_requests_match_verify_batch_exactly():
    """With temperature-0 (one-hot) rows, no flag needed: verify_batch_fast == verify_batch."""
    batch = random_batch(7, 100, stochastic=True)
    p = target_probs(batch["target_probs"], SamplingParams(temperature=0.0))
    num_seqs = batch["cu_num_draft_tokens"].shape[0] - 1
    args = (batch["draft_tokens"], batch["cu_num_draft_tokens"], batch["draft_probs"], p)
    expected = verify_batch(*args, [generator(j) for j in range(num_seqs)])
    for use_kernel in (True, False):
        assert verify_batch_fast(*args, [generator(j) for j in range(num_seqs)], use_kernel=use_kernel) == expected


def test_greedy_flag_draws_nothing():
    cu = cu_of([3, 0, 2])
    gens = [generator(j) for j in range(3)]
    states = [g.get_state() for g in gens]
    coins, uniforms = draw_randoms(cu, gens, greedy=[True, False, True])
    assert torch.equal(gens[0].get_state(), states[0]) and torch.equal(gens[2].get_state(), states[2])
    assert not torch.equal(gens[1].get_state(), states[1])
    assert coins[:3].eq(0).all() and coins[3:].eq(0).all() and uniforms[0] == 0 and uniforms[2] == 0


# ---------------------------------------------------------------------------- verify_batch_fast
def test_a_sequence_does_not_depend_on_its_batch():
    batch = random_batch(11, 64, stochastic=True)
    cu = batch["cu_num_draft_tokens"].tolist()
    num_seqs = len(cu) - 1
    seqs = [
        (
            batch["draft_tokens"][cu[j] : cu[j + 1]],
            batch["draft_probs"][cu[j] : cu[j + 1]],
            batch["target_probs"][cu[j] + j : cu[j + 1] + j + 1],
        )
        for j in range(num_seqs)
    ]

    def run(order: list[int], use_kernel: bool) -> dict:
        results = verify_batch_fast(
            torch.cat([seqs[j][0] for j in order]),
            cu_of([seqs[j][0].shape[0] for j in order]),
            torch.cat([seqs[j][1] for j in order]),
            torch.cat([seqs[j][2] for j in order]),
            [generator(1000 + j) for j in order],
            use_kernel=use_kernel,
        )
        return dict(zip(order, results))

    together = run(list(range(num_seqs)), use_kernel=True)
    assert run(list(range(num_seqs)), use_kernel=False) == together
    assert run([8, 2, 5], use_kernel=True) == {j: together[j] for j in (8, 2, 5)}
    assert {r.is_bonus for r in together.values() if r.num_draft_tokens} == {True, False}


# ---------------------------------------------------------------------------- lossless
VOCAB, BLOCK, NUM_SAMPLES = 8, 3, 20_000


def first_tokens(send_p_as_q: bool = False) -> tuple[list[int], Tensor, dict]:
    """NUM_SAMPLES sequences, each a block of BLOCK tokens drawn from q, verified in one batch;
    -> (the first committed token of each, the count of each accepted length, p of the first position).

    send_p_as_q: a lossy bug, the drafter reports q = p for tokens it drew from q (so every
    drafted token is accepted and the first token is distributed as q)."""
    gen = generator(5)
    logits = torch.randn(BLOCK + 1, VOCAB, generator=gen) * 0.8
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))  # [B + 1, vocab], zeros included
    noise = torch.randn(BLOCK, VOCAB, generator=gen).softmax(-1)
    q = 0.5 * p[:BLOCK] + 0.5 * noise  # [B, vocab]: full support, accepts about 3 in 4
    draft = torch.multinomial(q.repeat(NUM_SAMPLES, 1), 1, generator=gen).squeeze(-1)  # [N * B]
    results = verify_batch_fast(
        draft,
        torch.arange(0, NUM_SAMPLES * BLOCK + 1, BLOCK),
        (p[:BLOCK] if send_p_as_q else q).repeat(NUM_SAMPLES, 1),
        p.repeat(NUM_SAMPLES, 1),
        [generator(10_000 + j) for j in range(NUM_SAMPLES)],
        use_kernel=False,  # the interpreter would take minutes; the kernel equals the reference above
    )
    accepted_lengths = torch.bincount(torch.tensor([r.num_accepted for r in results]), minlength=BLOCK + 1)
    return [r.output_tokens[0] for r in results], accepted_lengths, {t: float(p[0, t]) for t in range(VOCAB)}


def test_verify_batch_fast_is_lossless():
    samples, accepted_lengths, probs = first_tokens()
    ok, msg = chi_square_check(samples, probs)
    print(f"\nfirst committed token vs p: {msg}; accepted lengths 0..{BLOCK}: {accepted_lengths.tolist()}")
    assert ok, msg
    assert (accepted_lengths > 500).all(), "every accepted length 0..B must be exercised"


def test_the_distribution_check_catches_a_lossy_sampler():
    """The drafts come from q but the drafter reports p: lossy. (Not sending q at all would be
    no control: verification with q one-hot is lossless whatever the drafted token.)"""
    samples, _, probs = first_tokens(send_p_as_q=True)
    ok, msg = chi_square_check(samples, probs)
    print(f"\np reported as q: {msg}")
    assert not ok, f"a lossy sampler passed the distribution check: {msg}"


# ---------------------------------------------------------------------------- bad input
def test_bad_input_raises_clear_errors():
    batch = random_batch(0, 64, stochastic=True)
    num_draft_tokens = batch["draft_tokens"].shape[0]
    for sampler in (rejection_sample, rejection_sample_reference):
        cases = [
            ({"target_probs": batch["target_probs"][:-1]}, ValueError, "target_probs must be"),
            ({"draft_probs": batch["draft_probs"][:-1]}, ValueError, "draft_probs must be"),
            ({"draft_tokens": batch["draft_tokens"][None]}, ValueError, "draft_tokens must be 1-D"),
            ({"coins": batch["coins"][:-1]}, ValueError, r"coins must be \[num_draft_tokens\]"),
            ({"uniforms": batch["uniforms"][1:]}, ValueError, r"uniforms must be \[num_seqs\]"),
            ({"greedy": batch["greedy"][1:]}, ValueError, r"greedy must be \[num_seqs\]"),
            ({"greedy": batch["greedy"].long()}, TypeError, "greedy must be torch.bool"),
            ({"draft_tokens": batch["draft_tokens"].int()}, TypeError, "draft_tokens must be torch.int64"),
            ({"target_probs": batch["target_probs"].half()}, TypeError, "target_probs must be torch.float32"),
            (
                {"target_probs": batch["target_probs"].t().contiguous().t()},
                ValueError,
                "target_probs must be contiguous",
            ),
            ({"coins": torch.rand(2 * num_draft_tokens)[::2]}, ValueError, "coins must be contiguous"),
            ({"uniforms": batch["uniforms"].to("meta")}, ValueError, "all tensors must be on one device"),
        ]
        for change, error, message in cases:
            with pytest.raises(error, match=message):
                sampler(**{**batch, **change})
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        rejection_sample(**batch, block_v=100)
    with pytest.raises(ValueError, match="one generator per sequence"):
        draw_randoms(cu_of([1, 2]), [generator(0)])
    p = torch.full((4, VOCAB), 1 / VOCAB)
    with pytest.raises(ValueError, match="cu_num_draft_tokens must rise"):
        verify_batch_fast(torch.tensor([1, 2, 3]), torch.tensor([0, 2]), None, p, [generator(0)])
    with pytest.raises(ValueError, match="no mass"):
        verify_batch_fast(torch.tensor([1, 2]), torch.tensor([0, 2]), None, torch.zeros(3, VOCAB), [generator(0)])
