"""Fused E2E-TV loss: the acceptance probabilities α_i = Σ_x min(p_i(x), q_i(x)) in Triton.

E2E-TV (SpecOPD, arXiv 2611.02846) scores a drafted block by L = -(1/B) Σ_k Π_{i<=k} α_i, with
α_i = Σ_x min(p_i(x), softmax(l_i)(x)) = 1 - TV(p_i, q_i) (Leviathan et al. 2023, arXiv
2211.17192, section 3.1); `specd.train.losses` has the definitions and why the product is a
surrogate. The torch version materialises q = softmax(l) and min(p, q) as ``[rows, vocab]`` fp32
tensors and autograd keeps more of them for backward; over a 150k vocabulary and thousands of
supervised positions that is the trainer's largest activation. Here one program owns one row
(one (branch, position)) and streams its vocabulary in ``BLOCK_V`` chunks, so nothing of size
``[rows, vocab]`` exists except the inputs and the gradient.

Design choices:

- Forward, two passes over the row: (1) the online softmax max m and sum s (Milakov & Gimelshein
  2018, arXiv 1805.02867), (2) α = Σ_x min(p, q) with q = exp(l - m - log s). Pass 2 also sums
  ``q_below`` = Σ_x q_x 1[q_x < p_x], the only row-wide quantity the gradient needs, so backward
  is a single pass. Per row the forward keeps α, q_below, m and log s (four scalars).
- Backward recomputes q from (m, log s) with the same expression as the forward, so the
  indicator 1[q < p] is the same bit in both, and writes dL/dl in the logits' dtype.
- Ties q_x == p_x: min(p, q) takes p there, i.e. dα/dq_x = 1[q_x < p_x] (strict). At a perfect
  drafter (q == p everywhere, α = 1, the maximum) this gives the zero gradient, a valid
  subgradient at the optimum. `acceptance_probs_reference` uses the same convention
  (``torch.minimum``'s autograd splits the gradient in half at ties instead; ties are measure
  zero for real logits, so the two agree on everything but constructed cases).
- Logits fp32, bf16 or fp16 are computed in fp32; fp64 logits (with fp64 p) are computed in fp64
  so `torch.autograd.gradcheck` can check the kernel. p is fp32 and gets no gradient: it is the
  target's distribution, detached. α is fp32 (fp64 for fp64 logits), also for bf16 logits,
  where `specd.train.losses.acceptance_probs` would compute a bf16 softmax.
- Inputs are ``[num_branches, block, vocab]`` with unit stride along the vocabulary and any
  strides over branches and positions (a slice of a model's logits needs no copy).
- The cumulative product over the block and the mean over branches are ``[num_branches, block]``
  work: they stay in torch (`specd.train.losses.expected_accepted_length`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specd.kernels import runtime
from specd.train.losses import expected_accepted_length

KERNEL = "e2e_tv"

# Planted defects, for tests only: a test builds the kernel with one and asserts that the
# comparison against the reference fails, so a comparison that cannot fail is caught.
BUG_NONE = 0
BUG_MAX = 1  # forward sums max(p, q) instead of min(p, q)
BUG_NO_SUM = 2  # backward drops the "- Σ_x q_x 1[q_x < p_x]" term
# Triton reads module globals inside a kernel only when they are constexpr.
_BUG_MAX: tl.constexpr = tl.constexpr(BUG_MAX)
_BUG_NO_SUM: tl.constexpr = tl.constexpr(BUG_NO_SUM)

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _configs() -> list:
    return runtime.autotune_configs([
        triton.Config({"BLOCK_V": 1024}, num_warps=4),
        triton.Config({"BLOCK_V": 2048}, num_warps=8),
        triton.Config({"BLOCK_V": 4096}, num_warps=8),
        triton.Config({"BLOCK_V": 8192}, num_warps=16),
    ])


@triton.jit
def _e2e_tv_forward_kernel(
    target_probs_ptr,  # [num_branches, block, vocab], unit stride along vocab
    draft_logits_ptr,  # [num_branches, block, vocab], unit stride along vocab
    alpha_ptr,  # [num_rows] out: Σ_x min(p, q)
    q_below_ptr,  # [num_rows] out: Σ_x q_x 1[q_x < p_x]
    row_max_ptr,  # [num_rows] out: m = max_x l_x
    row_log_sum_ptr,  # [num_rows] out: log s = log Σ_x exp(l_x - m)
    block,
    vocab,
    stride_p_branch,
    stride_p_pos,
    stride_l_branch,
    stride_l_pos,
    ACC: tl.constexpr,  # tl.float32, or tl.float64 for fp64 inputs
    BUG: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row = branch * block + pos
    branch = row // block
    pos = row % block
    p_row = target_probs_ptr + branch * stride_p_branch + pos * stride_p_pos
    l_row = draft_logits_ptr + branch * stride_l_branch + pos * stride_l_pos
    offsets = tl.arange(0, BLOCK_V)

    # Pass 1: online softmax (Milakov & Gimelshein 2018): rescale the running sum whenever the
    # running max grows. `shift` keeps exp finite while every logit seen so far is -inf (a
    # masked vocabulary entry), where l - m would be -inf - (-inf) = nan.
    row_max = tl.full([], float("-inf"), ACC)
    row_sum = tl.full([], 0.0, ACC)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offsets
        logits = tl.load(l_row + cols, mask=cols < vocab, other=float("-inf")).to(ACC)  # [BLOCK_V]
        new_max = tl.maximum(row_max, tl.max(logits, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(logits - shift), axis=0)
        row_max = new_max
    row_log_sum = tl.log(row_sum)

    # Pass 2: α = Σ_x min(p, q), ties to p (see the module docstring). Padding lanes have
    # l = -inf and p = 0, so q = 0 and they add nothing.
    alpha_acc = tl.zeros([BLOCK_V], ACC)
    below_acc = tl.zeros([BLOCK_V], ACC)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offsets
        mask = cols < vocab
        logits = tl.load(l_row + cols, mask=mask, other=float("-inf")).to(ACC)  # [BLOCK_V]
        p = tl.load(p_row + cols, mask=mask, other=0.0).to(ACC)  # [BLOCK_V]
        q = tl.exp(logits - row_max - row_log_sum)
        below = q < p
        if BUG == _BUG_MAX:
            alpha_acc += tl.maximum(p, q)
        else:
            alpha_acc += tl.where(below, q, p)
        below_acc += tl.where(below, q, 0.0)

    tl.store(alpha_ptr + row, tl.sum(alpha_acc, axis=0))
    tl.store(q_below_ptr + row, tl.sum(below_acc, axis=0))
    tl.store(row_max_ptr + row, row_max)
    tl.store(row_log_sum_ptr + row, row_log_sum)


# The gradient of α_i with respect to the logits l of row i. With min(p, q) taking q exactly
# where q < p, dα/dq_x = 1[q_x < p_x], and the softmax Jacobian is dq_x/dl_j = q_x (δ_xj - q_j):
#
#   dα/dl_j = Σ_x 1[q_x < p_x] q_x (δ_xj - q_j)
#           = q_j 1[q_j < p_j] - q_j Σ_x q_x 1[q_x < p_x]
#           = q_j (1[q_j < p_j] - q_below),          q_below = Σ_x q_x 1[q_x < p_x],
#
# and dL/dl_j = dL/dα · dα/dl_j. q_below comes from the forward's pass 2, so one pass suffices.
@triton.jit
def _e2e_tv_backward_kernel(
    grad_alpha_ptr,  # [num_rows] dL/dα
    target_probs_ptr,  # [num_branches, block, vocab], unit stride along vocab
    draft_logits_ptr,  # [num_branches, block, vocab], unit stride along vocab
    q_below_ptr,  # [num_rows]
    row_max_ptr,  # [num_rows]
    row_log_sum_ptr,  # [num_rows]
    grad_logits_ptr,  # [num_rows, vocab] out, contiguous, the logits' dtype
    block,
    vocab,
    stride_p_branch,
    stride_p_pos,
    stride_l_branch,
    stride_l_pos,
    ACC: tl.constexpr,
    BUG: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    branch = row // block
    pos = row % block
    p_row = target_probs_ptr + branch * stride_p_branch + pos * stride_p_pos
    l_row = draft_logits_ptr + branch * stride_l_branch + pos * stride_l_pos
    g_row = grad_logits_ptr + row * vocab
    offsets = tl.arange(0, BLOCK_V)

    grad_alpha = tl.load(grad_alpha_ptr + row).to(ACC)
    q_below = tl.load(q_below_ptr + row).to(ACC)
    if BUG == _BUG_NO_SUM:
        q_below = q_below * 0.0
    row_max = tl.load(row_max_ptr + row).to(ACC)
    row_log_sum = tl.load(row_log_sum_ptr + row).to(ACC)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offsets
        mask = cols < vocab
        logits = tl.load(l_row + cols, mask=mask, other=float("-inf")).to(ACC)  # [BLOCK_V]
        p = tl.load(p_row + cols, mask=mask, other=0.0).to(ACC)  # [BLOCK_V]
        q = tl.exp(logits - row_max - row_log_sum)  # the forward's expression: the same indicator
        below = tl.where(q < p, 1.0, 0.0).to(ACC)
        grad = grad_alpha * q * (below - q_below)
        tl.store(g_row + cols, grad.to(grad_logits_ptr.dtype.element_ty), mask=mask)


_e2e_tv_forward_tuned = triton.autotune(configs=_configs(), key=["vocab"])(_e2e_tv_forward_kernel)
_e2e_tv_backward_tuned = triton.autotune(configs=_configs(), key=["vocab"])(_e2e_tv_backward_kernel)


def _acc_dtype(draft_logits: Tensor) -> torch.dtype:
    return torch.float64 if draft_logits.dtype == torch.float64 else torch.float32


def _check_inputs(target_probs: Tensor, draft_logits: Tensor, block_v: int | None) -> None:
    """Raise a ValueError that says what is wrong with the kernel's inputs."""
    if target_probs.dim() != 3 or target_probs.shape != draft_logits.shape:
        raise ValueError(
            f"target_probs and draft_logits must both be [num_branches, block, vocab], got "
            f"{tuple(target_probs.shape)} and {tuple(draft_logits.shape)}"
        )
    if target_probs.shape[-1] == 0:
        raise ValueError("the vocabulary is empty (vocab = 0)")
    if draft_logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"draft_logits must be float32, bfloat16, float16 or float64, got {draft_logits.dtype}")
    expected = _acc_dtype(draft_logits)
    if target_probs.dtype != expected:
        raise ValueError(
            f"target_probs must be {expected} for {draft_logits.dtype} draft_logits (float64 only "
            f"with float64 logits), got {target_probs.dtype}"
        )
    if target_probs.device != draft_logits.device:
        raise ValueError(f"target_probs is on {target_probs.device} but draft_logits on {draft_logits.device}")
    for name, tensor in (("target_probs", target_probs), ("draft_logits", draft_logits)):
        if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
            raise ValueError(
                f"{name} must have unit stride along the vocabulary, got strides {tuple(tensor.stride())}: "
                f"pass {name}.contiguous()"
            )
    if target_probs.requires_grad:
        raise ValueError(
            "target_probs requires grad, but the kernel gives no gradient for the target's distribution: "
            "pass target_probs.detach()"
        )
    if block_v is not None and (block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    runtime.require(target_probs, draft_logits, kernel=KERNEL)


def _strides(target_probs: Tensor, draft_logits: Tensor) -> tuple[int, int, int, int]:
    return target_probs.stride(0), target_probs.stride(1), draft_logits.stride(0), draft_logits.stride(1)


def _forward(target_probs: Tensor, draft_logits: Tensor, block_v: int | None, bug: int) -> tuple[Tensor, ...]:
    num_branches, block, vocab = draft_logits.shape
    num_rows = num_branches * block
    acc = _acc_dtype(draft_logits)
    # alpha, q_below, row_max, row_log_sum: [num_rows] each
    alpha, q_below, row_max, row_log_sum = (torch.empty(num_rows, dtype=acc, device=draft_logits.device)
                                            for _ in range(4))
    if num_rows > 0:
        args = (target_probs, draft_logits, alpha, q_below, row_max, row_log_sum, block, vocab,
                *_strides(target_probs, draft_logits))
        acc_tl = tl.float64 if acc == torch.float64 else tl.float32
        if block_v is None:
            _e2e_tv_forward_tuned[(num_rows,)](*args, ACC=acc_tl, BUG=bug)
        else:
            _e2e_tv_forward_kernel[(num_rows,)](*args, ACC=acc_tl, BUG=bug, BLOCK_V=block_v, num_warps=4)
    return alpha, q_below, row_max, row_log_sum


def _backward(
    grad_alpha: Tensor, target_probs: Tensor, draft_logits: Tensor, q_below: Tensor, row_max: Tensor,
    row_log_sum: Tensor, block_v: int | None, bug: int,
) -> Tensor:
    num_branches, block, vocab = draft_logits.shape
    num_rows = num_branches * block
    grad_logits = torch.empty(draft_logits.shape, dtype=draft_logits.dtype, device=draft_logits.device)
    if num_rows > 0:
        grad_alpha = grad_alpha.reshape(num_rows).to(q_below.dtype).contiguous()  # [num_rows]
        args = (grad_alpha, target_probs, draft_logits, q_below, row_max, row_log_sum, grad_logits, block, vocab,
                *_strides(target_probs, draft_logits))
        acc_tl = tl.float64 if q_below.dtype == torch.float64 else tl.float32
        if block_v is None:
            _e2e_tv_backward_tuned[(num_rows,)](*args, ACC=acc_tl, BUG=bug)
        else:
            _e2e_tv_backward_kernel[(num_rows,)](*args, ACC=acc_tl, BUG=bug, BLOCK_V=block_v, num_warps=4)
    return grad_logits


class _AcceptanceProbs(torch.autograd.Function):
    """α = Σ_x min(p, softmax(l)) per row; the gradient flows to the logits only."""

    @staticmethod
    def forward(ctx, target_probs: Tensor, draft_logits: Tensor, block_v: int | None, bug: int) -> Tensor:
        alpha, q_below, row_max, row_log_sum = _forward(target_probs, draft_logits, block_v, bug)
        ctx.save_for_backward(target_probs, draft_logits, q_below, row_max, row_log_sum)
        ctx.block_v = block_v
        ctx.bug = bug
        return alpha.view(draft_logits.shape[:2])  # [num_branches, block]

    @staticmethod
    def backward(ctx, grad_alpha: Tensor) -> tuple[Tensor | None, ...]:
        target_probs, draft_logits, q_below, row_max, row_log_sum = ctx.saved_tensors
        grad_logits = _backward(grad_alpha, target_probs, draft_logits, q_below, row_max, row_log_sum,
                                ctx.block_v, ctx.bug)
        return None, grad_logits, None, None


def acceptance_probs_fused(
    target_probs: Tensor, draft_logits: Tensor, *, block_v: int | None = None, bug: int = 0,
) -> Tensor:
    """α_i = Σ_x min(p_i(x), softmax(l_i)(x)) ``[num_branches, block]``, differentiable in the logits.

    ``target_probs`` ``[num_branches, block, vocab]`` fp32 (fp64 with fp64 logits), no gradient;
    ``draft_logits`` ``[num_branches, block, vocab]`` fp32, bf16, fp16 or fp64. Both need unit
    stride along the vocabulary. ``block_v`` fixes the vocabulary chunk (a power of two) instead
    of autotuning it; ``bug`` plants a known defect (`BUG_MAX`, `BUG_NO_SUM`), for tests only.
    """
    _check_inputs(target_probs, draft_logits, block_v)
    return _AcceptanceProbs.apply(target_probs, draft_logits, block_v, int(bug))


def acceptance_probs_reference(target_probs: Tensor, draft_logits: Tensor) -> Tensor:
    """The plain-torch α ``[num_branches, block]`` with the kernel's precision and tie convention.

    The value is `specd.train.losses.acceptance_probs`'s, computed in fp32 (fp64 for fp64 logits)
    whatever the logits' dtype; ``torch.where(q < p, q, p)`` takes p at a tie, so the gradient
    reaches q only where q < p, as in the kernel.
    """
    acc = _acc_dtype(draft_logits)
    draft_probs = draft_logits.to(acc).softmax(-1)  # [num_branches, block, vocab]
    target_probs = target_probs.to(acc)
    return torch.where(draft_probs < target_probs, draft_probs, target_probs).sum(-1)


def e2e_tv_loss_fused(
    target_probs: Tensor, draft_logits: Tensor, valid: Tensor | None = None, *, block_v: int | None = None,
    bug: int = 0,
) -> Tensor:
    """E2E-TV (SpecOPD, arXiv 2611.02846): -(1/B) Σ_{k=1..B} Π_{i<=k} α_i, averaged over branches.

    The value and gradient of `specd.train.losses.e2e_tv_loss` (``valid`` ``[num_branches, block]``
    a prefix mask per branch; B is each branch's own valid length; branches with none are left
    out), with α from `acceptance_probs_fused`. The result is fp32 (fp64 for fp64 logits).
    """
    _check_inputs(target_probs, draft_logits, block_v)
    if valid is None:
        valid = torch.ones(draft_logits.shape[:2], dtype=torch.bool, device=draft_logits.device)
    elif valid.shape != draft_logits.shape[:2]:
        raise ValueError(f"valid must be [num_branches, block] = {tuple(draft_logits.shape[:2])}, got {tuple(valid.shape)}")
    valid = valid.bool()
    lengths = valid.sum(-1)  # [num_branches]
    used = lengths > 0
    if not bool(used.any()):
        return draft_logits.sum().to(_acc_dtype(draft_logits)) * 0.0
    alpha = acceptance_probs_fused(target_probs, draft_logits, block_v=block_v, bug=bug)  # [num_branches, block]
    accepted = expected_accepted_length(alpha, valid)  # [num_branches]
    return -(accepted[used] / lengths[used].to(accepted.dtype)).mean()
