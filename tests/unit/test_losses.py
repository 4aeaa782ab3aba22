"""E2E-TV is minus the expected accepted length over B (prefix-independent p, q), and its gradients are right."""

from __future__ import annotations

import itertools

import pytest
import torch

from specd.sampling import verify_block
from specd.train.losses import (
    acceptance_probs,
    distillation_loss,
    e2e_tv_loss,
    hybrid_weight,
    kl_loss,
    tv_loss,
)


def random_case(seed: int, vocab: int = 3, block: int = 3, num_branches: int = 1):
    generator = torch.Generator().manual_seed(seed)
    p = torch.rand(num_branches, block, vocab, generator=generator, dtype=torch.float64) ** 2
    p = p / p.sum(-1, keepdim=True)
    q_logits = torch.randn(num_branches, block, vocab, generator=generator, dtype=torch.float64)
    return p, q_logits


def brute_force_expected_accepted(p, q):  # [block, vocab] each
    """Σ over every draft block x of q(x) · E[k | x], E[k | x] = Σ_k Π_{i<=k} min(1, p_i(x_i) / q_i(x_i))."""
    block, vocab = p.shape
    total = 0.0
    for x in itertools.product(range(vocab), repeat=block):
        prob_block = 1.0
        for i, token in enumerate(x):
            prob_block *= float(q[i, token])
        reach, expected = 1.0, 0.0
        for i, token in enumerate(x):
            reach *= min(1.0, float(p[i, token]) / float(q[i, token]))
            expected += reach
        total += prob_block * expected
    return total


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("vocab,block", [(3, 3), (2, 4), (4, 2)])
def test_e2e_tv_is_minus_expected_accepted_length_over_block(seed, vocab, block):
    p, q_logits = random_case(seed, vocab, block)
    exact = brute_force_expected_accepted(p[0], q_logits[0].softmax(-1))
    loss = e2e_tv_loss(p, q_logits)
    print(f"E[k] = {exact:.6f}, -B * loss = {-block * float(loss):.6f}")
    assert abs(-block * float(loss) - exact) < 1e-12


def test_e2e_tv_matches_the_project_rejection_sampler():
    """The same expectation, estimated by running `verify_block` on blocks drawn from q."""
    p, q_logits = random_case(7)
    q = q_logits[0].softmax(-1).float()
    target_rows = torch.cat([p[0].float(), torch.full((1, 3), 1 / 3)])  # + a bonus row
    generator = torch.Generator().manual_seed(0)
    num_blocks, total = 4000, 0
    for _ in range(num_blocks):
        tokens = torch.multinomial(q, 1, generator=generator).squeeze(-1)
        total += verify_block(tokens, q, target_rows, generator).num_accepted
    mean = total / num_blocks
    exact = -3 * float(e2e_tv_loss(p, q_logits))
    print(f"sampled mean k = {mean:.4f}, E2E-TV says {exact:.4f}")
    assert abs(mean - exact) < 5 * 1.5 / num_blocks**0.5  # k is in [0, 3]: std <= 1.5


def test_gradients_match_finite_differences():
    p, q_logits = random_case(11, vocab=3, block=3, num_branches=2)
    valid = torch.tensor([[True, True, True], [True, True, False]])
    q_logits.requires_grad_(True)
    for loss in (e2e_tv_loss, kl_loss, tv_loss):
        assert torch.autograd.gradcheck(lambda logits: loss(p, logits, valid), (q_logits,))


def test_ragged_block_is_scored_as_its_own_shorter_block():
    p, q_logits = random_case(3, vocab=5, block=4, num_branches=2)
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    packed = e2e_tv_loss(p, q_logits, valid)
    alone = (e2e_tv_loss(p[:1], q_logits[:1]) + e2e_tv_loss(p[1:, :2], q_logits[1:, :2])) / 2
    assert torch.allclose(packed, alone)
    # Changing a masked position changes nothing.
    changed = q_logits.clone()
    changed[1, 2:] += 5.0
    assert torch.allclose(e2e_tv_loss(p, changed, valid), packed)


def test_divergences_agree_with_their_definitions():
    p, q_logits = random_case(5, vocab=6, block=3, num_branches=2)
    q = q_logits.softmax(-1)
    alpha = acceptance_probs(p, q_logits)
    assert torch.allclose(tv_loss(p, q_logits), (1 - alpha).mean())
    assert torch.allclose(kl_loss(p, q_logits), (p * (p / q).log()).sum(-1).mean())
    assert float(kl_loss(q, q_logits)) == pytest.approx(0.0, abs=1e-12)
    # A perfect drafter accepts everything: E2E-TV reaches its minimum -1.
    assert float(e2e_tv_loss(q, q_logits)) == pytest.approx(-1.0)


def test_hybrid_moves_from_kl_to_e2e_tv():
    p, q_logits = random_case(9, vocab=4, block=3, num_branches=2)
    assert hybrid_weight(0, 10) == 0.0 and hybrid_weight(5, 10) == 0.5 and hybrid_weight(20, 10) == 1.0
    start = distillation_loss("hybrid", p, q_logits, step=0, warmup_steps=10)
    middle = distillation_loss("hybrid", p, q_logits, step=5, warmup_steps=10)
    end = distillation_loss("hybrid", p, q_logits, step=10, warmup_steps=10)
    kl, e2e = kl_loss(p, q_logits), e2e_tv_loss(p, q_logits)
    assert torch.allclose(start, kl) and torch.allclose(end, e2e) and torch.allclose(middle, (kl + e2e) / 2)
    with pytest.raises(ValueError, match="unknown loss"):
        distillation_loss("ce", p, q_logits)
