"""The rejection sampler of speculative decoding as one Triton kernel, beside its torch reference.

The rule and its words (accepted / correction / bonus) are `specd.sampling`'s: Leviathan et al.
2023 (arXiv 2211.17192, Algorithm 1) and Chen et al. 2023 (arXiv 2302.01318). For sequence j with
drafted tokens x_1..x_B (B may be 0), draft distributions q_i and target distributions p_1..p_{B+1}:

- x_i is **accepted** iff p_i(x_i) > 0 and u_i · q_i(x_i) < p_i(x_i), u_i ~ U[0, 1) (the "coin"),
  i.e. with probability min(1, p_i(x_i) / q_i(x_i)) written without the division; verification
  stops at the first rejection, k = the number accepted. No draft_probs means a deterministic
  drafter: q_i one-hot at x_i, q_i(x_i) = 1.
- the **correction** (k < B) is drawn from the residual max(p_{k+1} - q_{k+1}, 0) (with q one-hot:
  p_{k+1} with x_{k+1} zeroed); a residual with no mass falls back to p_{k+1}. The **bonus**
  (k = B) is drawn from p_{B+1}.

Design choices:

- **One program per sequence**, looping over its drafted tokens and then over the vocabulary in
  BLOCK_V chunks: a step's batch is tens to hundreds of sequences and the vocabulary is 32k-256k,
  so the work is two or three streaming reads of one row per sequence; nothing is materialised.
- **Inverse-CDF sampling with one uniform v per sequence**: the token is the first t with
  r(t) > 0 whose running sum of the unnormalised distribution r exceeds v · Σr. P(t) = r(t) / Σr
  exactly, no normalisation pass is written back, and a zero-probability token is never chosen
  (not even when v = 0). Sums run in fp64, so the kernel and the reference (which sum in different
  orders) disagree only when v · Σr lands within ~1e-16 of a boundary; if rounding leaves v · Σr at
  or above the last running sum, the last token with mass is taken.
- **Randoms come in, they are not made here**: `coins` (one per drafted token) and `uniforms`
  (one per sequence) are drawn by `draw_randoms` from each request's own `torch.Generator`, so a
  sequence's outcome does not depend on its batch-mates and the kernel and the reference can be
  compared exactly. Unlike `specd.sampling.verify_batch` (which draws coins only where an outcome
  is uncertain and samples with `torch.multinomial`), every sampled sequence draws B + 1 uniforms:
  the tokens differ from verify_batch's, the distribution is the same (lossless).
- **Greedy flag**: a greedy sequence uses no randoms. It accepts x_i iff x_i is the first argmax
  of p_i, and its next token is the first argmax of p_{k+1}. With one-hot p (temperature 0) the
  stochastic rule gives the same answer; the flag also makes a soft p greedy. (The argmax is taken
  of p, not of the residual: after a rejection x_{k+1} is not p's argmax, so zeroing it leaves the
  argmax unchanged, and a soft q must not move the greedy token.)
- A row with no mass at all (only with a caller's bug) gives next token -1 for a sampled sequence;
  `verify_batch_fast` turns that into a ValueError like `verify_block`'s.
- **Unseeded rows only.** A seeded sampled request is verified by `specd.sampling.verify_keyed`
  (noise keyed by seed and position, so its tokens do not depend on the drafts, the batch or the
  block size): a caller routes its rows there, not here.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from specd.kernels import runtime
from specd.sampling import VerifyResult


class Bug(enum.IntEnum):
    """Deliberately wrong kernel variants: the test asserts the kernel-vs-reference comparison
    catches each of them. Never used outside tests."""

    NONE = 0
    UNCLAMPED_RESIDUAL = 1  # the correction drawn from p - q without the max(., 0)
    ACCEPT_LE = 2  # accepts iff u * q(x) <= p(x) (so also p(x) = 0 when u * q(x) = 0)


# ---------------------------------------------------------------------------- the kernel
@triton.jit
def _first_argmax(row_ptr, vocab, BLOCK_V: tl.constexpr):
    """Index of the first maximum of a ``[vocab]`` row (ties go to the lowest index)."""
    offsets = tl.arange(0, BLOCK_V)
    best_value = tl.full((), -1.0, tl.float32)  # below any probability, so block 0 always wins
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        index = start + offsets
        values = tl.load(row_ptr + index, mask=index < vocab, other=-1.0)
        block_max = tl.max(values, axis=0)
        block_index = tl.argmax(values, axis=0, tie_break_left=True) + start
        better = block_max > best_value  # strictly: an equal max in a later block is not first
        best_index = tl.where(better, block_index, best_index)
        best_value = tl.where(better, block_max, best_value)
    return best_index


@triton.jit
def _residual(p, q_row, index, in_vocab, is_correction, rejected_x, HAS_DRAFT_PROBS: tl.constexpr, BUG: tl.constexpr):
    """One block of the distribution the next token is drawn from: max(p - q, 0) on a correction
    (p with the rejected token zeroed when q is one-hot), p itself on a bonus."""
    if HAS_DRAFT_PROBS:
        q = tl.load(q_row + index, mask=in_vocab & is_correction, other=0.0)  # 0 on a bonus: r = p
        if BUG == 1:
            return p - q
        return tl.maximum(p - q, 0.0)
    return tl.where(index == rejected_x, 0.0, p)  # rejected_x = -1 on a bonus


@triton.jit
def _rejection_kernel(
    draft_tokens_ptr,  # [num_draft_tokens] int64
    cu_num_draft_tokens_ptr,  # [num_seqs + 1] int64
    draft_probs_ptr,  # [num_draft_tokens, vocab] fp32 (any pointer when not HAS_DRAFT_PROBS)
    target_probs_ptr,  # [num_draft_tokens + num_seqs, vocab] fp32
    coins_ptr,  # [num_draft_tokens] fp32
    uniforms_ptr,  # [num_seqs] fp32
    greedy_ptr,  # [num_seqs] bool
    num_accepted_ptr,  # [num_seqs] int64 (out)
    next_token_ptr,  # [num_seqs] int64 (out)
    vocab,
    HAS_DRAFT_PROBS: tl.constexpr,
    BUG: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_num_draft_tokens_ptr + seq)  # flat index of this sequence's first drafted token
    num_draft = tl.load(cu_num_draft_tokens_ptr + seq + 1) - start
    first_row = start + seq  # this sequence's B + 1 target rows start here
    is_greedy = tl.load(greedy_ptr + seq) != 0

    # Accept drafted tokens until the first rejection.
    num_accepted = tl.full((), 0, tl.int64)
    rejected = tl.full((), 0, tl.int32)
    while (num_accepted < num_draft) & (rejected == 0):
        token = start + num_accepted
        x = tl.load(draft_tokens_ptr + token)
        p_row = target_probs_ptr + (first_row + num_accepted) * vocab
        if is_greedy:
            accept = x == _first_argmax(p_row, vocab, BLOCK_V).to(tl.int64)
        else:
            p_x = tl.load(p_row + x)
            if HAS_DRAFT_PROBS:
                q_x = tl.load(draft_probs_ptr + token * vocab + x)
            else:
                q_x = tl.full((), 1.0, tl.float32)  # deterministic drafter: q one-hot at x
            coin = tl.load(coins_ptr + token)
            if BUG == 2:
                accept = coin * q_x <= p_x
            else:
                # u < p/q without the division: q(x) = 0 accepts whenever p(x) > 0.
                accept = (p_x > 0) & (coin * q_x < p_x)
        num_accepted += accept.to(tl.int64)
        rejected = 1 - accept.to(tl.int32)

    is_correction = num_accepted < num_draft
    row = first_row + num_accepted  # the correction's or the bonus's target row
    p_row = target_probs_ptr + row * vocab
    q_row = draft_probs_ptr + (start + num_accepted) * vocab  # only read on a correction
    rejected_x = tl.load(draft_tokens_ptr + start + num_accepted, mask=is_correction, other=-1)
    offsets = tl.arange(0, BLOCK_V)

    if is_greedy:
        next_token = _first_argmax(p_row, vocab, BLOCK_V)
    else:
        # Pass 1: the mass of the residual r (r = p for a bonus) and of p, and the last token with
        # mass of each (the fallback when rounding leaves v * mass above the last running sum).
        mass_r = tl.full((), 0.0, tl.float64)
        mass_p = tl.full((), 0.0, tl.float64)
        last_r = tl.full((), -1, tl.int32)
        last_p = tl.full((), -1, tl.int32)
        for block_start in range(0, vocab, BLOCK_V):
            index = block_start + offsets
            in_vocab = index < vocab
            p = tl.load(p_row + index, mask=in_vocab, other=0.0)
            r = _residual(p, q_row, index, in_vocab, is_correction, rejected_x, HAS_DRAFT_PROBS, BUG)
            mass_r += tl.sum(r.to(tl.float64), axis=0)
            mass_p += tl.sum(p.to(tl.float64), axis=0)
            last_r = tl.maximum(last_r, tl.max(tl.where(r > 0, index, -1), axis=0))
            last_p = tl.maximum(last_p, tl.max(tl.where(p > 0, index, -1), axis=0))
        # A residual with no mass (the drafter sent a token its own q gives 0 and p == q): use p.
        use_p = mass_r <= 0
        threshold = tl.load(uniforms_ptr + seq).to(tl.float64) * tl.where(use_p, mass_p, mass_r)
        next_token = tl.where(use_p, last_p, last_r)

        # Pass 2: inverse CDF, stopping at the block that holds the token.
        running = tl.full((), 0.0, tl.float64)
        found = tl.full((), 0, tl.int32)
        block_start = tl.full((), 0, tl.int32)
        while (block_start < vocab) & (found == 0):
            index = block_start + offsets
            in_vocab = index < vocab
            p = tl.load(p_row + index, mask=in_vocab, other=0.0)
            r = _residual(p, q_row, index, in_vocab, is_correction, rejected_x, HAS_DRAFT_PROBS, BUG)
            r = tl.where(use_p, p, r)
            cumulative = running + tl.cumsum(r.to(tl.float64), axis=0)
            hit = (r > 0) & (cumulative > threshold)
            first_hit = tl.min(tl.where(hit, index, vocab), axis=0)
            found = (first_hit < vocab).to(tl.int32)
            next_token = tl.where(found != 0, first_hit, next_token)
            running += tl.sum(r.to(tl.float64), axis=0)
            block_start += BLOCK_V

    tl.store(num_accepted_ptr + seq, num_accepted)
    tl.store(next_token_ptr + seq, next_token.to(tl.int64))


_CONFIGS = [
    triton.Config({"BLOCK_V": 1024}, num_warps=4),
    triton.Config({"BLOCK_V": 2048}, num_warps=8),
    triton.Config({"BLOCK_V": 4096}, num_warps=8),
    triton.Config({"BLOCK_V": 8192}, num_warps=16),
]
_autotuned_kernel = triton.autotune(runtime.autotune_configs(_CONFIGS), key=["vocab", "HAS_DRAFT_PROBS"])(
    _rejection_kernel
)


# ---------------------------------------------------------------------------- the wrappers
def _check_inputs(
    draft_tokens: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    uniforms: Tensor,
    coins: Tensor,
    greedy: Tensor,
) -> None:
    """Shapes, dtypes, contiguity and devices; what is wrong, said in the argument's own terms.
    The values of cu_num_draft_tokens are not read here (that would sync with the GPU)."""
    named = {
        "draft_tokens": (draft_tokens, torch.int64),
        "cu_num_draft_tokens": (cu_num_draft_tokens, torch.int64),
        "target_probs": (target_probs, torch.float32),
        "uniforms": (uniforms, torch.float32),
        "coins": (coins, torch.float32),
        "greedy": (greedy, torch.bool),
    }
    if draft_probs is not None:
        named["draft_probs"] = (draft_probs, torch.float32)
    for name, (tensor, dtype) in named.items():
        if tensor.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous, got strides {tensor.stride()} for shape {tuple(tensor.shape)}"
            )
    devices = {name: str(tensor.device) for name, (tensor, _) in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be 1-D [num_draft_tokens], got {tuple(draft_tokens.shape)}")
    if cu_num_draft_tokens.dim() != 1 or cu_num_draft_tokens.shape[0] < 1:
        raise ValueError(f"cu_num_draft_tokens must be 1-D [num_seqs + 1], got {tuple(cu_num_draft_tokens.shape)}")
    num_draft_tokens = draft_tokens.shape[0]
    num_seqs = cu_num_draft_tokens.shape[0] - 1
    if target_probs.dim() != 2 or target_probs.shape[0] != num_draft_tokens + num_seqs:
        raise ValueError(
            f"target_probs must be [num_draft_tokens + num_seqs, vocab] = [{num_draft_tokens + num_seqs}, V] "
            f"(one row per drafted token plus the bonus row of each sequence), got {tuple(target_probs.shape)}"
        )
    if target_probs.shape[1] < 1:
        raise ValueError("target_probs must have a vocabulary of at least one token")
    if draft_probs is not None and draft_probs.shape != (num_draft_tokens, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [num_draft_tokens, vocab] = [{num_draft_tokens}, {target_probs.shape[1]}] "
            f"or None (deterministic draft), got {tuple(draft_probs.shape)}"
        )
    if coins.shape != (num_draft_tokens,):
        raise ValueError(f"coins must be [num_draft_tokens] = [{num_draft_tokens}], got {tuple(coins.shape)}")
    for name, tensor in (("uniforms", uniforms), ("greedy", greedy)):
        if tensor.shape != (num_seqs,):
            raise ValueError(f"{name} must be [num_seqs] = [{num_seqs}], got {tuple(tensor.shape)}")


def rejection_sample(
    draft_tokens: Tensor,  # [num_draft_tokens] int64: every sequence's block, back to back
    cu_num_draft_tokens: Tensor,  # [num_seqs + 1] int64: sequence j's block is [cu[j], cu[j + 1])
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab] fp32; None = every draft deterministic
    target_probs: Tensor,  # [num_draft_tokens + num_seqs, vocab] fp32: sequence j's rows start at cu[j] + j
    uniforms: Tensor,  # [num_seqs] fp32 in [0, 1): the correction / bonus draw
    coins: Tensor,  # [num_draft_tokens] fp32 in [0, 1): the accept tests
    greedy: Tensor,  # [num_seqs] bool: argmax verification, no randoms
    *,
    block_v: int | None = None,
    bug: Bug = Bug.NONE,
) -> tuple[Tensor, Tensor]:
    """-> (num_accepted [num_seqs] int64, next_token [num_seqs] int64), computed by the Triton kernel.

    Equals `rejection_sample_reference` exactly for the same inputs. ``block_v`` fixes the
    vocabulary chunk (a power of two; default: autotuned); ``bug`` is for tests only.
    """
    _check_inputs(draft_tokens, cu_num_draft_tokens, draft_probs, target_probs, uniforms, coins, greedy)
    tensors = [draft_tokens, cu_num_draft_tokens, target_probs, uniforms, coins, greedy]
    runtime.require(*tensors, *([] if draft_probs is None else [draft_probs]), kernel="rejection_sample")
    if block_v is not None and (block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    num_seqs = cu_num_draft_tokens.shape[0] - 1
    vocab = target_probs.shape[1]
    num_accepted = torch.empty(num_seqs, dtype=torch.int64, device=target_probs.device)
    next_token = torch.empty(num_seqs, dtype=torch.int64, device=target_probs.device)
    if num_seqs == 0:
        return num_accepted, next_token
    args = (
        draft_tokens,
        cu_num_draft_tokens,
        target_probs if draft_probs is None else draft_probs,  # never read without draft probs
        target_probs,
        coins,
        uniforms,
        greedy,
        num_accepted,
        next_token,
        vocab,
    )
    constexprs = {"HAS_DRAFT_PROBS": draft_probs is not None, "BUG": int(bug)}
    if block_v is None:
        _autotuned_kernel[(num_seqs,)](*args, **constexprs)
    else:
        _rejection_kernel[(num_seqs,)](*args, **constexprs, BLOCK_V=block_v, num_warps=4)
    return num_accepted, next_token


def rejection_sample_reference(
    draft_tokens: Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: Tensor,  # [num_seqs + 1] int64
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab] fp32 or None
    target_probs: Tensor,  # [num_draft_tokens + num_seqs, vocab] fp32
    uniforms: Tensor,  # [num_seqs] fp32
    coins: Tensor,  # [num_draft_tokens] fp32
    greedy: Tensor,  # [num_seqs] bool
) -> tuple[Tensor, Tensor]:
    """The definition `rejection_sample` must equal, in plain torch (any device)."""
    _check_inputs(draft_tokens, cu_num_draft_tokens, draft_probs, target_probs, uniforms, coins, greedy)
    device = target_probs.device
    num_seqs = cu_num_draft_tokens.shape[0] - 1
    num_draft_tokens = draft_tokens.shape[0]
    cu = cu_num_draft_tokens
    lengths = cu[1:] - cu[:-1]  # [num_seqs]
    seq_index = torch.arange(num_seqs, device=device)
    seq_of_token = torch.repeat_interleave(seq_index, lengths, output_size=num_draft_tokens)  # [num_draft_tokens]
    token_index = torch.arange(num_draft_tokens, device=device)
    target_row = token_index + seq_of_token  # [num_draft_tokens]: p row of each drafted token

    p_x = target_probs[target_row, draft_tokens]  # [num_draft_tokens]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[token_index, draft_tokens]
    sampled_accept = (p_x > 0) & (coins * q_x < p_x)
    greedy_accept = draft_tokens == target_probs[target_row].argmax(-1)  # torch: the first maximum
    accepted = torch.where(greedy[seq_of_token], greedy_accept, sampled_accept)  # [num_draft_tokens]

    # k_j = position of sequence j's first rejection, B_j when there is none.
    position = token_index - cu[:-1][seq_of_token]
    first_rejected = torch.where(accepted, lengths[seq_of_token], position)
    num_accepted = lengths.clone().scatter_reduce_(0, seq_of_token, first_rejected, reduce="amin")

    next_row = cu[:-1] + seq_index + num_accepted  # [num_seqs]
    p = target_probs[next_row]  # [num_seqs, vocab]
    residual = p.clone()
    is_correction = num_accepted < lengths
    rejected_token = (cu[:-1] + num_accepted)[is_correction]  # flat index of each rejected draft
    if draft_probs is None:
        residual[is_correction, draft_tokens[rejected_token]] = 0.0
    else:
        residual[is_correction] = (p[is_correction] - draft_probs[rejected_token]).clamp(min=0.0)
    mass = residual.double().sum(-1)
    residual = torch.where((mass <= 0)[:, None], p, residual)  # no residual mass: fall back to p
    sampled_token = _inverse_cdf(residual, uniforms)
    next_token = torch.where(greedy, p.argmax(-1), sampled_token)
    return num_accepted, next_token


def _inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """``[num_rows, vocab]`` unnormalised probabilities, ``[num_rows]`` uniforms -> ``[num_rows]``
    tokens: the first t with probs[t] > 0 whose running sum exceeds v * mass (fp64); the last
    token with mass when rounding leaves none; -1 for a row with no mass."""
    probs64 = probs.double()
    threshold = uniforms.double() * probs64.sum(-1)  # [num_rows]
    hit = (probs > 0) & (probs64.cumsum(-1) > threshold[:, None])  # [num_rows, vocab]
    index = torch.arange(probs.shape[-1], device=probs.device)
    last_with_mass = torch.where(probs > 0, index, -1).amax(-1)
    return torch.where(hit.any(-1), hit.to(torch.uint8).argmax(-1), last_with_mass)


def draw_randoms(
    cu_num_draft_tokens: Tensor,  # [num_seqs + 1] int64
    generators: Sequence[torch.Generator],  # [num_seqs]: each request's own generator
    *,
    greedy: Sequence[bool] | None = None,  # [num_seqs]: greedy sequences draw nothing (zeros)
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """-> (coins [num_draft_tokens] fp32, uniforms [num_seqs] fp32), on ``device`` (default: the
    device of cu_num_draft_tokens).

    Sequence j draws B_j + 1 uniforms in one call from its own generator (on the generator's
    device): its B_j coins, then its uniform. What a sequence draws depends only on its generator
    and its block length, never on its batch-mates.
    """
    num_seqs = cu_num_draft_tokens.shape[0] - 1
    if len(generators) != num_seqs:
        raise ValueError(f"need one generator per sequence: {num_seqs} sequences, {len(generators)} generators")
    if greedy is not None and len(greedy) != num_seqs:
        raise ValueError(f"greedy must have one flag per sequence: {num_seqs} sequences, {len(greedy)} flags")
    device = cu_num_draft_tokens.device if device is None else torch.device(device)
    lengths = (cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).tolist()
    draws = []
    for j, (length, generator) in enumerate(zip(lengths, generators)):
        if greedy is not None and greedy[j]:
            draws.append(torch.zeros(length + 1, device=device))
        else:
            draws.append(torch.rand(length + 1, generator=generator, device=generator.device).to(device))
    coins = torch.cat([d[:-1] for d in draws]) if draws else torch.zeros(0, device=device)
    uniforms = torch.stack([d[-1] for d in draws]) if draws else torch.zeros(0, device=device)
    return coins, uniforms


def verify_batch_fast(
    draft_tokens: Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: Tensor,  # [num_seqs + 1] int64
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab] fp32; None = every draft deterministic
    target_probs: Tensor,  # [num_draft_tokens + num_seqs, vocab] fp32
    generators: Sequence[torch.Generator],  # [num_seqs]
    *,
    greedy: Sequence[bool] | None = None,  # [num_seqs]: explicit greedy flags (default: none)
    use_kernel: bool | None = None,  # None: the kernel when it can run here, else the reference
) -> list[VerifyResult]:
    """`specd.sampling.verify_batch` with the randoms drawn up front and one kernel launch.

    Same arguments and result type; lossless (the committed tokens have the target's
    distribution), but not the same tokens as verify_batch for the same generators (see the
    module docstring). Greedy requests need no flag: their one-hot p makes the rule the argmax
    rule; a flag only saves their randoms.
    """
    num_seqs = cu_num_draft_tokens.shape[0] - 1
    if cu_num_draft_tokens.dim() != 1 or num_seqs < 0:
        raise ValueError("cu_num_draft_tokens must be 1-D [num_seqs + 1] and start with 0")
    cu_list = cu_num_draft_tokens.tolist()
    if cu_list[0] != 0 or cu_list[-1] != draft_tokens.shape[0] or any(a > b for a, b in itertools.pairwise(cu_list)):
        raise ValueError(
            f"cu_num_draft_tokens must rise from 0 to num_draft_tokens={draft_tokens.shape[0]}, got {cu_list}"
        )
    device = target_probs.device
    coins, uniforms = draw_randoms(cu_num_draft_tokens, generators, greedy=greedy, device=device)
    greedy_flags = torch.tensor([False] * num_seqs if greedy is None else list(greedy), dtype=torch.bool, device=device)
    args = (
        draft_tokens.to(device=device, dtype=torch.int64).contiguous(),
        cu_num_draft_tokens.to(device=device, dtype=torch.int64).contiguous(),
        None if draft_probs is None else draft_probs.float().contiguous(),
        target_probs.float().contiguous(),
        uniforms,
        coins,
        greedy_flags,
    )
    if use_kernel is None:
        use_kernel = runtime.can_run(target_probs)
    num_accepted, next_token = (rejection_sample if use_kernel else rejection_sample_reference)(*args)
    if bool((next_token < 0).any()):
        bad = (next_token < 0).nonzero().flatten().tolist()
        raise ValueError(f"cannot sample from a distribution with no mass (all probabilities are 0): sequences {bad}")
    tokens = draft_tokens.tolist()
    return [
        VerifyResult(
            num_draft_tokens=cu_list[j + 1] - cu_list[j],
            num_accepted=k,
            accepted_tokens=tokens[cu_list[j] : cu_list[j] + k],
            next_token=token,
        )
        for j, (k, token) in enumerate(zip(num_accepted.tolist(), next_token.tolist()))
    ]
