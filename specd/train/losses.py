"""Drafter distillation losses: E2E-TV (SpecOPD), forward KL, TV, and a KL -> E2E-TV hybrid.

Every loss takes the same three tensors, one row per *branch* (a drafted block):

- ``target_probs``  ``[num_branches, block, vocab]`` p_i: the target's distribution at block
  position i (after the branch's first i tokens), fp32, no gradient;
- ``draft_logits``  ``[num_branches, block, vocab]`` the drafter's logits at position i; q_i is
  their softmax and the gradient flows through them;
- ``valid``         ``[num_branches, block]`` bool, a *prefix* mask per branch (ragged blocks:
  a branch cut by the context limit or ended by a stop token supervises fewer positions).

Acceptance (Leviathan et al. 2023, arXiv 2211.17192, section 3.1): drafting x_i ~ q_i and
accepting it with probability min(1, p_i(x_i) / q_i(x_i)) accepts position i with probability

    α_i = Σ_x q_i(x) min(1, p_i(x)/q_i(x)) = Σ_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i).

Verification stops at the first rejection, so position k is reached only when all of 1..k are
accepted; when the α_i are independent of what was drafted before them,
P(accepted length >= k) = Π_{i<=k} α_i and E[accepted length] = Σ_{k=1..B} Π_{i<=k} α_i.
The E2E-TV loss (SpecOPD, arXiv 2611.02846) is minus that, over B:

    L_E2E-TV = -(1/B) Σ_{k=1..B} Π_{i<=k} α_i.

It weighs early positions most, as acceptance does: a gain at position 1 lifts every later term.

**Why it is a surrogate.** In real decoding p_i and q_i depend on the sampled prefix x_<i: the
target's p_i(· | context, x_<i) changes with the drafted tokens, and so does the next position's
α. The exact expected accepted length is then the nested expectation
E_{x_1~q_1}[a_1(x_1) (1 + E_{x_2~q_2}[a_2(x_2) (1 + ...)])] with a_i(x) = min(1, p_i(x | x_<i)/q_i(x)),
not the product of per-position marginal α_i. SpecOPD evaluates each α_i at the prefix of one
*sampled* branch (p_i after that branch's own first i tokens), so the loss is a single-sample
estimate along the branch, and the product of those α_i is not an unbiased estimate of the
nested expectation (correlations between positions are dropped; the accept/reject coin at
position i is replaced by its conditional probability, and the path is not conditioned on
acceptance). It is exact when the distributions do not depend on the prefix, which is what
`tests/unit/test_losses.py` checks against brute-force enumeration. With a D3D drafter q_i does
not depend on x_<i at all (a block is denoised from the reference prefix in one pass); p_i does.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSSES = ("e2e-tv", "kl", "tv", "hybrid")


def _check(target_probs: Tensor, draft_logits: Tensor, valid: Tensor | None) -> Tensor:
    if target_probs.shape != draft_logits.shape or target_probs.dim() != 3:
        raise ValueError(
            f"target_probs and draft_logits must both be [num_branches, block, vocab], got "
            f"{tuple(target_probs.shape)} and {tuple(draft_logits.shape)}"
        )
    if valid is None:
        return torch.ones(target_probs.shape[:2], dtype=torch.bool, device=target_probs.device)
    if valid.shape != target_probs.shape[:2]:
        raise ValueError(f"valid must be [num_branches, block] = {tuple(target_probs.shape[:2])}, got {tuple(valid.shape)}")
    return valid.bool()


def acceptance_probs(target_probs: Tensor, draft_logits: Tensor) -> Tensor:
    """α_i = Σ_x min(p_i(x), q_i(x)) = 1 - TV(p_i, q_i) ``[num_branches, block]`` (Leviathan et al. 2023)."""
    draft_probs = draft_logits.softmax(-1)
    return torch.minimum(target_probs.to(draft_probs.dtype), draft_probs).sum(-1)


def expected_accepted_length(alpha: Tensor, valid: Tensor) -> Tensor:
    """``[num_branches]``: Σ_k Π_{i<=k} α_i over each branch's valid prefix."""
    # A padded position contributes alpha 0, so it ends the product there (valid is a prefix).
    alpha = alpha * valid.to(alpha.dtype)
    return alpha.cumprod(-1).sum(-1)


def e2e_tv_loss(target_probs: Tensor, draft_logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """E2E-TV (SpecOPD, arXiv 2611.02846): -(1/B) Σ_{k=1..B} Π_{i<=k} α_i, averaged over branches.

    B is each branch's own number of valid positions (a ragged block is scored against its own
    length); branches with none are left out of the mean. See the module docstring for why this
    is a surrogate of the expected accepted length when p_i and q_i depend on the prefix.
    """
    valid = _check(target_probs, draft_logits, valid)
    lengths = valid.sum(-1)  # [num_branches]
    used = lengths > 0
    if not bool(used.any()):
        return draft_logits.sum() * 0.0
    accepted = expected_accepted_length(acceptance_probs(target_probs, draft_logits), valid)
    return -(accepted[used] / lengths[used].to(accepted.dtype)).mean()


def kl_loss(target_probs: Tensor, draft_logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """Forward KL(p || q) = Σ_x p(x) (log p(x) - log q(x)), mean over valid positions.

    The usual distillation objective (Hinton et al. 2015; for drafters, DistillSpec, Zhou et al.
    2023, arXiv 2310.08461): mass-covering, and its gradient does not vanish when p and q barely
    overlap — where E2E-TV's does (α ≈ 0 gives products ≈ 0 for every later position).
    """
    valid = _check(target_probs, draft_logits, valid)
    log_q = draft_logits.log_softmax(-1)
    p = target_probs.to(log_q.dtype)
    # 0 * log 0 = 0, also where q = 0 (a token outside a drafting vocabulary, log q = -inf).
    per_position = torch.where(p > 0, p * (torch.log(p.clamp(min=1e-30)) - log_q), 0.0).sum(-1)
    return _mean(per_position, valid)


def tv_loss(target_probs: Tensor, draft_logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """TV(p, q) = (1/2) Σ_x |p(x) - q(x)| = 1 - α, mean over valid positions (every position alike)."""
    valid = _check(target_probs, draft_logits, valid)
    draft_probs = draft_logits.softmax(-1)
    per_position = 0.5 * (target_probs.to(draft_probs.dtype) - draft_probs).abs().sum(-1)
    return _mean(per_position, valid)


def hybrid_weight(step: int, warmup_steps: int) -> float:
    """The E2E-TV share w of the hybrid at ``step``: linear from 0 to 1 over ``warmup_steps``."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, max(0.0, step / warmup_steps))


def hybrid_loss(target_probs: Tensor, draft_logits: Tensor, valid: Tensor | None, weight: float) -> Tensor:
    """(1 - w) KL(p || q) + w L_E2E-TV: KL warms up a drafter whose q barely overlaps p (our choice;
    SpecOPD mentions KL as a warm-up), then E2E-TV takes over as w goes to 1 (`hybrid_weight`)."""
    if weight >= 1.0:
        return e2e_tv_loss(target_probs, draft_logits, valid)
    kl = kl_loss(target_probs, draft_logits, valid)
    if weight <= 0.0:
        return kl
    return (1.0 - weight) * kl + weight * e2e_tv_loss(target_probs, draft_logits, valid)


def distillation_loss(
    name: str, target_probs: Tensor, draft_logits: Tensor, valid: Tensor | None = None,
    *, step: int = 0, warmup_steps: int = 0,
) -> Tensor:
    """The loss called ``name`` (one of `LOSSES`); ``step``/``warmup_steps`` drive the hybrid."""
    if name == "e2e-tv":
        return e2e_tv_loss(target_probs, draft_logits, valid)
    if name == "kl":
        return kl_loss(target_probs, draft_logits, valid)
    if name == "tv":
        return tv_loss(target_probs, draft_logits, valid)
    if name == "hybrid":
        return hybrid_loss(target_probs, draft_logits, valid, hybrid_weight(step, warmup_steps))
    raise ValueError(f"unknown loss {name!r}: choose one of {', '.join(LOSSES)}")


def _mean(per_position: Tensor, valid: Tensor) -> Tensor:
    weights = valid.to(per_position.dtype)
    return (per_position * weights).sum() / weights.sum().clamp(min=1.0)
