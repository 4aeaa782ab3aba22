"""The fused E2E-TV kernel equals its plain-torch reference: α, the loss and dL/dlogits.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
Vocabularies of 37 and 300 are not multiples of the vocabulary chunk; ``block_v=64`` makes the
kernels loop over several chunks, ``block_v=None`` takes the autotuned (first) config. Every
comparison prints its max difference, and planted defects must fail the same comparison.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specd.kernels import e2e_tv  # after the importorskip
from specd.kernels.e2e_tv import (
    BUG_MAX,
    BUG_NO_SUM,
    acceptance_probs_fused,
    acceptance_probs_reference,
    e2e_tv_loss_fused,
)
from specd.train.losses import acceptance_probs, e2e_tv_loss

FP32_TOLERANCE = 1e-5
CASES = [(37, None), (37, 64), (300, None), (300, 64)]  # (vocab, block_v)


def random_case(seed: int, vocab: int, *, num_branches: int = 3, block: int = 4, dtype=torch.float32):
    """p: dense rows, plus one-hot rows (greedy targets) in branch 1; peaked random logits."""
    generator = torch.Generator().manual_seed(seed)
    target_probs = torch.rand(num_branches, block, vocab, generator=generator, dtype=dtype) ** 4
    target_probs /= target_probs.sum(-1, keepdim=True)  # [num_branches, block, vocab]
    greedy = torch.randint(vocab, (block,), generator=generator)
    target_probs[1] = torch.nn.functional.one_hot(greedy, vocab).to(dtype)
    draft_logits = 3.0 * torch.randn(num_branches, block, vocab, generator=generator, dtype=dtype)
    # Make some rows agree with the target, so α spans (0, 1) rather than sitting near 0.
    draft_logits[0, :2] = target_probs[0, :2].log() + 0.3 * draft_logits[0, :2]
    draft_logits[1, 0, greedy[0]] += 6.0
    return target_probs, draft_logits


def max_difference(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    difference = float((actual.double() - expected.double()).abs().max())
    print(f"{what}: max |difference| = {difference:.3e}")
    return difference


def logits_grad(loss_fn, target_probs, draft_logits, *args, **kwargs) -> torch.Tensor:
    draft_logits = draft_logits.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss_fn(target_probs, draft_logits, *args, **kwargs), draft_logits)
    return grad


@pytest.mark.parametrize("vocab,block_v", CASES)
def test_forward_matches_reference_fp32(vocab, block_v):
    target_probs, draft_logits = random_case(0, vocab)
    alpha = acceptance_probs_fused(target_probs, draft_logits, block_v=block_v)
    assert alpha.shape == (3, 4) and alpha.dtype == torch.float32
    assert max_difference(alpha, acceptance_probs_reference(target_probs, draft_logits), "alpha vs reference") < FP32_TOLERANCE
    assert max_difference(alpha, acceptance_probs(target_probs, draft_logits), "alpha vs losses") < FP32_TOLERANCE
    assert float(alpha.min()) < 0.5 < float(alpha.max())  # the case exercises both regimes

    valid = torch.tensor([[True] * 4, [True, True, False, False], [True, False, False, False]])
    loss = e2e_tv_loss_fused(target_probs, draft_logits, valid, block_v=block_v)
    expected = e2e_tv_loss(target_probs, draft_logits, valid)
    assert max_difference(loss, expected, "loss vs losses") < FP32_TOLERANCE


@pytest.mark.parametrize("vocab,block_v", CASES)
def test_backward_matches_autograd_through_reference(vocab, block_v):
    target_probs, draft_logits = random_case(1, vocab)
    # Ragged prefixes, a branch with nothing to supervise, and one-hot targets in branch 1.
    valid = torch.tensor([[True] * 4, [True, True, True, False], [False] * 4])
    grad = logits_grad(e2e_tv_loss_fused, target_probs, draft_logits, valid, block_v=block_v)
    expected = logits_grad(e2e_tv_loss, target_probs, draft_logits, valid)
    assert grad.dtype == torch.float32 and grad.shape == draft_logits.shape
    assert max_difference(grad, expected, "dL/dlogits vs losses.e2e_tv_loss") < FP32_TOLERANCE
    assert float(expected.abs().max()) > 1e-3  # not a comparison of zeros
    assert float(grad[2].abs().max()) == 0.0 and float(grad[1, 3].abs().max()) == 0.0  # masked rows

    # α's own gradient, under an arbitrary upstream gradient (not only the loss's).
    weights = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    grad = logits_grad(lambda p, l: (acceptance_probs_fused(p, l, block_v=block_v) * weights).sum(),
                       target_probs, draft_logits)
    expected = logits_grad(lambda p, l: (acceptance_probs_reference(p, l) * weights).sum(), target_probs, draft_logits)
    assert max_difference(grad, expected, "dα/dlogits vs reference") < FP32_TOLERANCE


def test_bf16_logits():
    """bf16 logits are read into fp32: α equals the fp32 reference on the same (upcast) values to
    1e-5; the gradient is the fp32 one cast to bf16, within one bf16 ulp (2^-7 relative: the
    interpreter truncates where a GPU rounds to nearest); against
    `losses.acceptance_probs` computed *in* bf16 the tolerance is bf16's softmax error, 2e-2."""
    target_probs, draft_logits = random_case(3, 300)
    draft_logits = draft_logits.bfloat16()
    alpha = acceptance_probs_fused(target_probs, draft_logits, block_v=64)
    assert alpha.dtype == torch.float32
    assert max_difference(alpha, acceptance_probs_reference(target_probs, draft_logits), "bf16: alpha vs fp32 reference") < FP32_TOLERANCE
    assert max_difference(alpha, acceptance_probs(target_probs, draft_logits), "bf16: alpha vs bf16 losses") < 2e-2

    valid = torch.tensor([[True] * 4, [True, True, False, False], [True] * 4])
    loss = e2e_tv_loss_fused(target_probs, draft_logits, valid, block_v=64)
    expected_loss = e2e_tv_loss(target_probs, draft_logits.float(), valid)
    assert max_difference(loss, expected_loss, "bf16: loss vs fp32 losses") < FP32_TOLERANCE

    grad = logits_grad(e2e_tv_loss_fused, target_probs, draft_logits, valid, block_v=64)
    expected = logits_grad(e2e_tv_loss, target_probs, draft_logits.float(), valid)
    assert grad.dtype == torch.bfloat16
    excess = (grad.float() - expected).abs() - (2**-7 * expected.abs() + 1e-7)
    print(f"bf16: dL/dlogits max |difference| = {float((grad.float() - expected).abs().max()):.3e}")
    assert float(excess.max()) <= 0.0


def test_fp64_gradcheck():
    """The interpreter runs the kernels in fp64 (ACC = tl.float64): finite differences agree."""
    target_probs, draft_logits = random_case(4, 11, num_branches=2, block=3, dtype=torch.float64)
    valid = torch.tensor([[True, True, True], [True, True, False]])
    assert max_difference(acceptance_probs_fused(target_probs, draft_logits, block_v=16),
                          acceptance_probs_reference(target_probs, draft_logits), "fp64: alpha") < 1e-12
    draft_logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda logits: e2e_tv_loss_fused(target_probs, logits, valid, block_v=16),
                                    (draft_logits,), fast_mode=True)


@pytest.mark.parametrize("vocab,block_v", [(37, None), (300, 64)])
def test_planted_defects_fail_the_comparison(vocab, block_v):
    target_probs, draft_logits = random_case(5, vocab)
    valid = torch.tensor([[True] * 4, [True, True, True, False], [True] * 4])
    # max(p, q) instead of min(p, q): the forward comparison catches it.
    wrong = acceptance_probs_fused(target_probs, draft_logits, block_v=block_v, bug=BUG_MAX)
    assert max_difference(wrong, acceptance_probs_reference(target_probs, draft_logits), "BUG_MAX: alpha") > FP32_TOLERANCE
    # The forward of BUG_NO_SUM is right; the gradient comparison catches the dropped term.
    loss = e2e_tv_loss_fused(target_probs, draft_logits, valid, block_v=block_v, bug=BUG_NO_SUM)
    assert max_difference(loss, e2e_tv_loss(target_probs, draft_logits, valid), "BUG_NO_SUM: loss") < FP32_TOLERANCE
    grad = logits_grad(e2e_tv_loss_fused, target_probs, draft_logits, valid, block_v=block_v, bug=BUG_NO_SUM)
    expected = logits_grad(e2e_tv_loss, target_probs, draft_logits, valid)
    assert max_difference(grad, expected, "BUG_NO_SUM: dL/dlogits") > FP32_TOLERANCE


def test_strided_rows_and_masked_vocabulary():
    """A slice of bigger tensors (unit stride only along the vocabulary) needs no copy; logits of
    -inf (a masked vocabulary entry, even a whole first chunk of them) give q = 0 there."""
    target_probs, draft_logits = random_case(6, 300, num_branches=2, block=6)
    p_slice, l_slice = target_probs[:, 1:5], draft_logits[:, ::2]  # [2, 4, 300] and [2, 3, 300]
    p_slice = p_slice[:, :3]
    assert not l_slice.is_contiguous() and not p_slice.is_contiguous()
    alpha = acceptance_probs_fused(p_slice, l_slice, block_v=64)
    assert max_difference(alpha, acceptance_probs_reference(p_slice, l_slice), "strided: alpha") < FP32_TOLERANCE

    masked = draft_logits.clone()
    masked[..., :100] = float("-inf")
    alpha = acceptance_probs_fused(target_probs, masked, block_v=64)
    assert max_difference(alpha, acceptance_probs_reference(target_probs, masked), "masked vocabulary: alpha") < FP32_TOLERANCE
    grad = logits_grad(lambda p, l: acceptance_probs_fused(p, l, block_v=64).sum(), target_probs, masked)
    expected = logits_grad(lambda p, l: acceptance_probs_reference(p, l).sum(), target_probs, masked)
    assert max_difference(grad, expected, "masked vocabulary: dα/dlogits") < FP32_TOLERANCE


def test_tie_convention_of_the_reference():
    """At q == p (a perfect drafter) α = 1, its maximum, and the reference's gradient is zero:
    ties go to p. `torch.minimum` would split the gradient there; the kernel takes p, like the
    reference. The kernel's own q differs from torch's softmax by rounding, so it is checked on α."""
    _, draft_logits = random_case(7, 37)
    target_probs = draft_logits.softmax(-1)
    grad = logits_grad(lambda p, l: acceptance_probs_reference(p, l).sum(), target_probs, draft_logits)
    assert float(grad.abs().max()) == 0.0
    alpha = acceptance_probs_fused(target_probs, draft_logits)
    assert max_difference(alpha, torch.ones_like(alpha), "perfect drafter: alpha") < FP32_TOLERANCE


def test_bad_input_is_rejected_with_a_clear_error(monkeypatch):
    target_probs, draft_logits = random_case(8, 37)
    with pytest.raises(ValueError, match=r"\[num_branches, block, vocab\]"):
        acceptance_probs_fused(target_probs, draft_logits[:, :3])
    with pytest.raises(ValueError, match=r"\[num_branches, block, vocab\]"):
        acceptance_probs_fused(target_probs[0], draft_logits[0])
    with pytest.raises(ValueError, match="target_probs must be torch.float32"):
        acceptance_probs_fused(target_probs.bfloat16(), draft_logits)
    with pytest.raises(ValueError, match="draft_logits must be float32"):
        acceptance_probs_fused(target_probs, draft_logits.long())
    with pytest.raises(ValueError, match="unit stride along the vocabulary"):
        acceptance_probs_fused(target_probs, draft_logits.transpose(0, 2).contiguous().transpose(0, 2))
    with pytest.raises(ValueError, match="requires grad"):
        acceptance_probs_fused(target_probs.requires_grad_(True), draft_logits)
    target_probs = target_probs.detach()
    with pytest.raises(ValueError, match="power of two"):
        acceptance_probs_fused(target_probs, draft_logits, block_v=100)
    with pytest.raises(ValueError, match="valid must be"):
        e2e_tv_loss_fused(target_probs, draft_logits, torch.ones(3, 5, dtype=torch.bool))
    if not torch.cuda.is_available():  # CPU tensors without the interpreter: say what to do
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match=f"{e2e_tv.KERNEL} runs on CUDA tensors"):
            acceptance_probs_fused(target_probs, draft_logits)
