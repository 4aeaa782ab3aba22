"""Sampling parameters, the target distribution they define, and the lossless rejection sampler.

`SamplingParams` follows vLLM's names. ``temperature == 0`` means greedy. Otherwise the
distribution a request samples from is: logits / temperature, then top-k, then top-p (nucleus)
filtering, renormalised. A request without a seed owns a `torch.Generator` (nondeterministic) so
its draws do not depend on what else is in the batch; a request *with* a seed is sampled keyed
(below), so its output does not depend on anything but its seed.

Speculative verification (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318). A drafter proposes
a *block* of B tokens x_1..x_B, x_i drawn from q_i (a deterministic drafter has q_i one-hot at
x_i). One target pass over the block gives p_1..p_{B+1} (p_i: the target's distribution for
position i, already shaped by `target_probs`). The words, used the same way everywhere:

- **accepted** tokens: drafted tokens the target keeps. x_i is accepted with probability
  min(1, p_i(x_i) / q_i(x_i)); verification stops at the first rejection, so the accepted tokens
  are x_1..x_k, 0 <= k <= B (k is the *accepted length*).
- **correction** token: when k < B, one token sampled at the first rejected position from the
  residual max(p_{k+1} - q_{k+1}, 0) / Z (vLLM calls it "recovered").
- **bonus** token: when k = B, one token sampled from p_{B+1}.

Every target pass therefore commits τ = k + 1 tokens, and the committed tokens have exactly the
target's distribution. In code rows are 0-based: row i of ``target_probs`` scores draft token i,
row B is the bonus row.

Randomness is spent only where an outcome is uncertain, each sequence from its own generator:

- a block draws its B coins in one call, ``torch.rand(B)``, iff some position is uncertain
  (0 < p(x) < q(x)); p(x) >= q(x) accepts and p(x) = 0 rejects without a coin;
- a token is sampled (``torch.multinomial``) only from a distribution with more than one
  nonzero entry; a one-hot one gives its token without a draw.

So greedy (one-hot p, from `target_probs` with temperature 0) consumes no randomness and is
exactly "accept while the drafted token is the argmax; the correction or bonus is the argmax",
whatever q the drafter sent.

**Keyed** sampling, for a **seeded** request (``seed`` set, temperature > 0: `SamplingParams.keyed`).
The rejection sampler above is lossless in distribution only: its coins and residual draws come
from the request's generator, so the same seed gives different tokens with and without a drafter,
with another block size, or when a drafter dies mid-request. A seeded request instead chooses the
token at absolute position t of its sequence (t = tokens before it, prompt included) by an
exponential race over its shaped distribution p_t:

    y_t = argmin_v E_{t,v} / p_t(v),   E_{t,v} ~ Exp(1) i.i.d. over the vocabulary,

with E_{t,.} drawn from a generator seeded by `position_key` (seed, t) — splitmix64 of both, and
nothing else: not the batch, the block, or what was drafted. This is the Gumbel-max trick
(-log E is Gumbel, so y_t = argmax_v log p_t(v) - log E_{t,v}): y_t is an exact sample of p_t and a
token with p_t(v) = 0 is never chosen. Verification of a drafted block (`verify_keyed`) computes
y for each row from the target's p (row i conditioned on x_<i, as always): x_i is accepted while
x_i == y_i; the first mismatch emits y_i as the correction, a fully accepted block emits y_{B+1} as
the bonus. So the committed tokens are exactly plain decoding's with the same seed — lossless
pathwise, not only in distribution — and for a deterministic drafter x_i is accepted with
probability p(x_i), as under the rejection sampler. A sampling drafter draws a seeded request's
tokens with the same race over its own q and the same keys (`keyed_sample`), so draft and target
share their noise and agree often (a coupling); its q is not needed for verification. In-process
plain decoding (`specd.engine.autoregressive`) and the engine's plain steps use the same choice,
so plain == speculative for a seed. The batched forms (`verify_batch`, the Triton kernel in
`specd.kernels.rejection`) are for unseeded rows; the engine routes seeded rows to `verify_keyed`.
Greedy requests ignore the seed and never draw E. The noise is drawn on the probabilities' device,
so a seed reproduces its tokens on the same kind of device (CPU and CUDA generators differ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from specd.tree import TokenTree

SEED_RANGE = (0, 2**64 - 1)
"""Seeds a request may give: what a 64-bit generator state holds (the gRPC field is uint64)."""

MIN_TEMPERATURE = 1e-5
"""Temperatures above 0 but below this decode greedily, as vLLM's ``_SAMPLING_EPS``: logits / T
overflows float32 for T near 1e-38, and long before that the distribution is one-hot in all but
rounding."""

MAX_TOP_K = 2**31 - 1
"""The largest top_k (the gRPC field is int32; any value past the vocabulary means all)."""

MIN_REPETITION_PENALTY = 0.01
"""Below it a penalised logit overflows float32 (it is divided by the penalty)."""

MAX_LOGIT_BIAS = 100.0
"""``|logit_bias|`` per token, OpenAI's bound."""


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """One request's sampling, validated on construction: the single rule set that the HTTP API,
    gRPC and the library share. Every ValueError names the field and the allowed range."""

    max_tokens: int = 64
    """Tokens to generate at most (stop tokens end earlier)."""
    temperature: float = 0.0
    """0 = greedy; otherwise the softmax temperature (below `MIN_TEMPERATURE`: greedy)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1 = all)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's (0 = off)."""
    seed: int | None = None
    """In `SEED_RANGE`: a sampled request with a seed is sampled keyed by (seed, position) and gives
    the same tokens whatever drafts for it (module docstring); None = nondeterministic."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after emitting one of these (it is included in the output)."""
    min_tokens: int = 0
    """The stop tokens cannot be emitted before this many tokens were generated."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds (OpenAI's, in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it (OpenAI's, in [-2, 2])."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on tokens of the prompt or output: a positive logit is divided by it, a
    negative one multiplied (1 = off; vLLM's and transformers' meaning)."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before anything else (OpenAI's, in [-100, 100])."""

    def __post_init__(self) -> None:
        # NaN passes every comparison below, so finiteness is checked first and by name.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("max_tokens", "top_k", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0  # greedy (see MIN_TEMPERATURE)
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, 2**31 - 1] (0 = disabled), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must be in [{SEED_RANGE[0]}, 2**64 - 1], got {self.seed}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in [0.01, 2] (1 = off), got {self.repetition_penalty}")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias of token {token} must be a number in [-100, 100], got {bias!r}")
        for token in self.stop_token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {token!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def keyed(self) -> bool:
        """Whether tokens are chosen by position-keyed sampling (module docstring): a sampled
        request with a seed. Greedy requests ignore the seed."""
        return self.seed is not None and not self.greedy

    @property
    def needs_history(self) -> bool:
        """Whether the distribution depends on the tokens so far (penalties, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.min_tokens)

    @property
    def processes_logits(self) -> bool:
        """Whether `process_logits` changes anything: callers skip gathering its history else."""
        return self.needs_history or bool(self.logit_bias)

    @property
    def token_ids(self) -> list[int]:
        """Every token id the params name (stop tokens, biased tokens): the engine checks them
        against the vocabulary."""
        return [*self.stop_token_ids, *(self.logit_bias or {})]

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def process_logits(
    logits: Tensor,  # [num_rows, vocab]: row r predicts the token after output + block[:r]
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    block: Sequence[int] = (),
) -> Tensor:
    """The request's logits processors, in vLLM's order: logit_bias, min_tokens, then the
    repetition, frequency and presence penalties.

    They change the *target* distribution, so speculation stays lossless with respect to the
    processed distribution: row r of a verified block is processed as if ``block[:r]`` were
    already output, which is exactly what it is when those tokens are accepted (and rows after
    a rejection are never used). With none of them set, ``logits`` is returned as is.
    """
    if not params.processes_logits:
        return logits
    num_rows, vocab = logits.shape
    logits = logits.float().clone()
    device = logits.device
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=device)
    if params.min_tokens and params.stop_token_ids:
        generated = len(output) + torch.arange(num_rows, device=device)  # tokens before each row's
        early = (generated < params.min_tokens).nonzero().flatten()
        if early.numel():
            stops = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
            logits[early.unsqueeze(1), stops.unsqueeze(0)] = float("-inf")
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        # counts[r] = occurrences in output + block[:r]: the output's counts plus a running sum.
        history = torch.tensor(list(output), dtype=torch.long, device=device)
        counts = torch.bincount(history, minlength=vocab)[:vocab].float().expand(num_rows, vocab).clone()
        if num_rows > 1 and len(block):
            steps = torch.zeros(num_rows, vocab, device=device)
            drafted = torch.tensor(list(block)[: num_rows - 1], dtype=torch.long, device=device)
            steps[torch.arange(1, 1 + len(drafted), device=device), drafted] = 1.0
            counts += steps.cumsum(0)
        if params.repetition_penalty != 1:
            seen = counts > 0
            if len(prompt):
                seen[:, torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
            penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return logits


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """``[..., vocab]`` logits -> fp32 probabilities after temperature, top-k, top-p and min-p.

    For greedy params this is the one-hot of the argmax, so greedy decoding is sampling from
    it: one code path for both in the rejection sampler. Logits processors that depend on the
    tokens so far (`process_logits`) are applied by the caller, which knows them.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.temperature < 1:
        # A finite logit over a temperature below 1 can overflow to +inf, and softmax would turn
        # two of them into NaN: the largest float stands in for infinity (-inf stays: a mask).
        # At T >= 1 nothing grows, so the decode loop's usual T = 1 pays nothing for it.
        logits = logits.clamp(max=torch.finfo(torch.float32).max)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop = before >= params.top_p
        drop[..., 0] = False  # the most likely token always stays (a denormal top_p is 0 in fp32)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0:
        # The most likely token always stays (its probability is min_p times itself at most).
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """One token per row of ``[num_rows, vocab]`` probabilities -> ``[num_rows]``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ---------------------------------------------------------------------------- keyed sampling
_MASK64 = 2**64 - 1


def splitmix64(x: int) -> int:
    """SplitMix64's step and output mix (Steele, Lea & Flood 2014, "Fast Splittable Pseudorandom
    Number Generators"): a bijection of 64-bit integers whose outputs pass BigCrush."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_key(seed: int, position: int) -> int:
    """The generator seed of absolute position ``position`` of a request seeded ``seed``: a
    function of the two alone, so every process that samples the request draws the same noise.
    (Torch's CPU generator keeps the key's low 32 bits: two positions share their noise with
    probability 2^-32, which changes no distribution.)"""
    return splitmix64(splitmix64(seed) ^ position)


def keyed_sample(probs: Tensor, seed: int, start: int) -> Tensor:
    """Row r of ``[num_rows, vocab]`` (unnormalised) probabilities -> the keyed token at absolute
    position ``start + r``: ``[num_rows]`` int64.

    y = argmin_v E_v / p(v), E_v ~ Exp(1) from the generator keyed by (seed, position): the
    exponential race, i.e. the Gumbel-max trick (Gumbel 1954; Maddison et al. 2014, "A* Sampling",
    arXiv 1411.0030): P(y = v) = p(v) / sum(p) exactly, and p(v) = 0 is never chosen (E / 0 = inf).
    One ``torch.rand(vocab)`` per row, in fp64 so that E has 53 bits, never 24.
    """
    num_rows, vocab = probs.shape
    device = probs.device
    generator = torch.Generator(device=device)
    uniforms = torch.empty(num_rows, vocab, dtype=torch.float64, device=device)
    for r in range(num_rows):
        generator.manual_seed(position_key(seed, start + r))
        torch.rand(vocab, dtype=torch.float64, generator=generator, device=device, out=uniforms[r])
    race = uniforms.log_().neg_() / probs.double()  # E / p; U = 0 gives E = inf: that token loses
    tokens = race.argmin(-1)
    if not bool((probs.gather(1, tokens[:, None]) > 0).all()):  # also NaN rows
        raise ValueError("cannot sample from a distribution with no mass (all probabilities are 0)")
    return tokens


# ---------------------------------------------------------------------------- verification
@dataclass(kw_only=True, slots=True)
class VerifyResult:
    """The outcome of verifying one block (the words are defined in the module docstring)."""

    num_draft_tokens: int
    """B: how many tokens were drafted."""
    num_accepted: int
    """k: how many of them the target accepted (0..B)."""
    accepted_tokens: list[int]
    """The k accepted tokens (the block's first k)."""
    next_token: int
    """The correction token when k < B, the bonus token when k = B."""

    @property
    def is_bonus(self) -> bool:
        return self.num_accepted == self.num_draft_tokens

    @property
    def output_tokens(self) -> list[int]:
        """The τ = k + 1 tokens this pass commits."""
        return [*self.accepted_tokens, self.next_token]


def _check_verify_inputs(
    draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor, num_seqs: int
) -> None:
    num_draft_tokens = draft_tokens.shape[0]
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be 1-D [num_draft_tokens], got {tuple(draft_tokens.shape)}")
    if target_probs.dim() != 2 or target_probs.shape[0] != num_draft_tokens + num_seqs:
        raise ValueError(
            f"target_probs must be [num_draft_tokens + num_seqs, vocab] = [{num_draft_tokens + num_seqs}, V] "
            f"(one row per drafted token plus the bonus row of each sequence), got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (num_draft_tokens, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [num_draft_tokens, vocab] = [{num_draft_tokens}, {target_probs.shape[1]}] "
            f"or None (deterministic draft), got {tuple(draft_probs.shape)}"
        )


def _sample_one(probs: Tensor, generator: torch.Generator) -> int:
    """One token from ``[vocab]`` unnormalised probabilities; no draw when only one is possible."""
    support = (probs > 0).nonzero()
    if support.shape[0] == 1:
        return int(support[0, 0])
    if support.shape[0] == 0:
        raise ValueError("cannot sample from a distribution with no mass (all probabilities are 0)")
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_block(
    draft_tokens: Tensor,  # [B] int64
    draft_probs: Tensor | None,  # [B, vocab] fp32; None = deterministic draft (q one-hot at the token)
    target_probs: Tensor,  # [B + 1, vocab] fp32, from `target_probs` with the request's params
    generator: torch.Generator,
) -> VerifyResult:
    """Verify one drafted block by speculative (rejection) sampling: the reference form.

    `verify_batch` does the same for many sequences at once and gives identical results.
    """
    _check_verify_inputs(draft_tokens, draft_probs, target_probs, num_seqs=1)
    num_draft_tokens = draft_tokens.shape[0]
    rows = torch.arange(num_draft_tokens, device=target_probs.device)
    p_x = target_probs[rows, draft_tokens]  # [B]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[rows, draft_tokens]  # [B]
    uncertain = (p_x > 0) & (p_x < q_x)
    if bool(uncertain.any()):
        coins = torch.rand(num_draft_tokens, generator=generator, device=target_probs.device)
    else:
        coins = torch.zeros_like(p_x)
    # Accept iff u < p/q, written without the division: q(x) = 0 (a token the drafter could not
    # have drawn) accepts whenever p(x) > 0, and p(x) = 0 never accepts.
    accepted = (p_x > 0) & (coins * q_x < p_x)  # [B]
    rejected = (~accepted).nonzero()
    num_accepted = int(rejected[0, 0]) if rejected.shape[0] else num_draft_tokens

    if num_accepted < num_draft_tokens:
        # Correction: the residual max(p - q, 0) holds exactly the mass that acceptance
        # under-delivered, so accepted-or-corrected tokens are distributed as p.
        if draft_probs is None:
            probs = target_probs[num_accepted].clone()
            probs[draft_tokens[num_accepted]] = 0.0  # max(p - onehot(x), 0)
        else:
            probs = (target_probs[num_accepted] - draft_probs[num_accepted]).clamp_(min=0.0)
        if not bool(probs.sum() > 0):
            # Only when the drafter sent a token its own q gives 0 and p == q: fall back to p.
            probs = target_probs[num_accepted]
    else:
        probs = target_probs[num_draft_tokens]  # bonus
    next_token = _sample_one(probs, generator)
    accepted_tokens = draft_tokens[:num_accepted].tolist()
    return VerifyResult(
        num_draft_tokens=num_draft_tokens,
        num_accepted=num_accepted,
        accepted_tokens=accepted_tokens,
        next_token=next_token,
    )


def verify_greedy(draft_tokens: Sequence[int], logits: Tensor) -> VerifyResult:
    """`verify_block` for a greedy request whose logits no processor changes, from the target's
    argmax alone: ``logits`` ``[B + 1, vocab]``. The same outcome as the one-hot ``target_probs``
    give there (a drafted token is accepted iff it is the argmax; the next token is the argmax at
    the first mismatch), without building probabilities over the vocabulary or drawing a coin."""
    if logits.dim() != 2 or logits.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"logits must be [B + 1, vocab] = [{len(draft_tokens) + 1}, V], got {tuple(logits.shape)}")
    return verify_greedy_tokens(draft_tokens, logits.argmax(-1).tolist())


def verify_greedy_tokens(draft_tokens: Sequence[int], best: Sequence[int]) -> VerifyResult:
    """`verify_greedy` from the target's argmax at each of the ``B + 1`` positions, already taken
    (the engine takes one argmax over a whole pass of greedy rows)."""
    if len(best) != len(draft_tokens) + 1:
        raise ValueError(f"need the argmax at B + 1 = {len(draft_tokens) + 1} positions, got {len(best)}")
    num_accepted = 0
    while num_accepted < len(draft_tokens) and int(draft_tokens[num_accepted]) == best[num_accepted]:
        num_accepted += 1
    return VerifyResult(num_draft_tokens=len(draft_tokens), num_accepted=num_accepted,
                        accepted_tokens=[int(t) for t in draft_tokens[:num_accepted]], next_token=best[num_accepted])


def verify_batch(
    draft_tokens: Tensor,  # [num_draft_tokens] int64: every sequence's block, back to back
    cu_num_draft_tokens: Tensor,  # [num_seqs + 1] int64: sequence j's block is [cu[j], cu[j + 1])
    draft_probs: Tensor | None,  # [num_draft_tokens, vocab] fp32; None = every draft deterministic
    target_probs: Tensor,  # [num_draft_tokens + num_seqs, vocab]: sequence j's B_j + 1 rows start at cu[j] + j
    generators: Sequence[torch.Generator],  # [num_seqs]: each request's own generator
) -> list[VerifyResult]:
    """`verify_block` over a ragged batch, vectorised except for the per-request draws.

    Blocks may have any length, 0 included (plain decoding: the bonus row alone). A batch that
    mixes deterministic and stochastic drafters passes one-hot rows of q for the deterministic
    ones: that gives the same results as None. Each sequence draws from its own generator
    exactly what `verify_block` would draw, so its output does not depend on the batch.
    For unseeded rows: a seeded request's block goes to `verify_keyed` (the engine routes it).
    """
    num_seqs = cu_num_draft_tokens.shape[0] - 1
    if num_seqs < 0 or cu_num_draft_tokens.dim() != 1:
        raise ValueError("cu_num_draft_tokens must be 1-D [num_seqs + 1] and start with 0")
    if len(generators) != num_seqs:
        raise ValueError(f"need one generator per sequence: {num_seqs} sequences, {len(generators)} generators")
    _check_verify_inputs(draft_tokens, draft_probs, target_probs, num_seqs=num_seqs)
    cu = cu_num_draft_tokens.to(torch.long).cpu()
    num_draft_tokens = cu[1:] - cu[:-1]  # [num_seqs]
    if int(cu[0]) != 0 or int(cu[-1]) != draft_tokens.shape[0] or bool((num_draft_tokens < 0).any()):
        raise ValueError(
            f"cu_num_draft_tokens must rise from 0 to num_draft_tokens={draft_tokens.shape[0]}, got {cu.tolist()}"
        )
    device = target_probs.device
    total = draft_tokens.shape[0]
    seq_index = torch.arange(num_seqs)
    seq_of_token = torch.repeat_interleave(seq_index, num_draft_tokens)  # [num_draft_tokens]
    token_index = torch.arange(total)
    target_row = (token_index + seq_of_token).to(device)  # [num_draft_tokens]: p row of each drafted token

    p_x = target_probs[target_row, draft_tokens]  # [num_draft_tokens]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[token_index.to(device), draft_tokens]
    uncertain = ((p_x > 0) & (p_x < q_x)).cpu()
    needs_coins = torch.zeros(num_seqs, dtype=torch.long).index_add_(0, seq_of_token, uncertain.long()) > 0
    coins = torch.zeros(total, device=device)
    cu_list = cu.tolist()
    for j in needs_coins.nonzero().flatten().tolist():
        start, end = cu_list[j], cu_list[j + 1]
        coins[start:end] = torch.rand(end - start, generator=generators[j], device=device)
    accepted = ((p_x > 0) & (coins * q_x < p_x)).cpu()  # [num_draft_tokens]

    # k_j = position of sequence j's first rejection, B_j when there is none.
    position = token_index - cu[:-1][seq_of_token]
    first_rejected = torch.where(accepted, num_draft_tokens[seq_of_token], position)
    num_accepted = num_draft_tokens.clone().scatter_reduce_(0, seq_of_token, first_rejected, reduce="amin")

    next_row = cu[:-1] + seq_index + num_accepted  # [num_seqs]: p row of the correction / bonus
    probs = target_probs[next_row.to(device)]  # [num_seqs, vocab] (a copy)
    correction = (num_accepted < num_draft_tokens).nonzero().flatten()
    if correction.numel():
        rejected_token = (cu[:-1] + num_accepted)[correction].to(device)  # flat index of the rejected draft
        corrected = correction.to(device)
        if draft_probs is None:
            probs[corrected, draft_tokens[rejected_token]] = 0.0
        else:
            probs[corrected] = (probs[corrected] - draft_probs[rejected_token]).clamp_(min=0.0)
        empty = (probs.sum(-1) == 0).nonzero().flatten()
        probs[empty] = target_probs[next_row.to(device)[empty]]  # see verify_block

    tokens = draft_tokens.tolist()
    results = []
    for j, k in enumerate(num_accepted.tolist()):
        results.append(
            VerifyResult(
                num_draft_tokens=cu_list[j + 1] - cu_list[j],
                num_accepted=k,
                accepted_tokens=tokens[cu_list[j] : cu_list[j] + k],
                next_token=_sample_one(probs[j], generators[j]),
            )
        )
    return results


def _check_tree_inputs(tree: TokenTree, target_probs: Tensor) -> int:
    """``tree``'s node count, after checking that ``target_probs`` has a row per node plus the root's."""
    num_nodes = tree.num_nodes
    if target_probs.dim() != 2 or target_probs.shape[0] != num_nodes + 1:
        raise ValueError(
            f"target_probs must be [num_nodes + 1, vocab] = [{num_nodes + 1}, V], got {tuple(target_probs.shape)}"
        )
    if num_nodes and bool((tree.anchors != tree.anchors[0]).any()):
        raise ValueError("a verification tree continues one context: every node must share one anchor")
    return num_nodes


def verify_tree(
    tree: TokenTree,
    draft_probs: Tensor | None,  # [num_nodes, vocab] fp32 (q of each node's token); None = deterministic
    target_probs: Tensor,  # [num_nodes + 1, vocab]: row 0 at the root, row 1 + i after node i
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """Verify a tree of drafted candidates -> (accepted node path, correction-or-bonus token).

    A chain is one block: it goes to `verify_block` and gives exactly its result (stochastic or
    deterministic). Otherwise candidates must be deterministic (draft_probs None), and at each
    position (the root first) the children are tried in node order with p' = p:
    child x is accepted with probability p'(x) / Z; on rejection p'(x) = 0. If every child is
    rejected, the correction is sampled from the final p'; otherwise descend into the accepted
    child (p' = its target row) and repeat; an accepted leaf is followed by a bonus from its row.

    Why it is lossless: at one position, the emitted token is child x_1 with probability p(x_1),
    x_2 with probability (1 - p(x_1)) · p(x_2) / (1 - p(x_1)) = p(x_2), and so on, and any other
    token y with probability (1 - Σ p(x_i)) · p(y) / (1 - Σ p(x_i)) = p(y): exactly p, whatever
    the candidates are (it is `verify_block`'s rule with a one-hot q, applied to p' in turn).
    Descending into the accepted child conditions on that token, so by induction over depth the
    committed tokens have the target's joint distribution. Greedy (one-hot p) follows the argmax
    child without drawing; the correction or bonus is the argmax.

    Stochastic siblings would need each sibling drawn independently from q (SpecInfer's
    multi-step rule), which merging shared prefixes breaks, so they are refused. A seeded request's
    tree goes to `verify_tree_keyed` instead.
    """
    num_nodes = _check_tree_inputs(tree, target_probs)
    if tree.is_chain():
        result = verify_block(tree.tokens.to(target_probs.device), draft_probs, target_probs, generator)
        return list(range(result.num_accepted)), result.next_token
    if draft_probs is not None:
        raise ValueError(
            "a stochastic draft (draft_probs given) must be a chain: sibling candidates must be "
            "deterministic (draft_probs=None)"
        )

    children: list[list[int]] = [[] for _ in range(num_nodes + 1)]  # slot 0 = root, node i = slot i + 1
    for node, parent in enumerate(tree.parents.tolist()):
        children[parent + 1].append(node)
    tokens = tree.tokens.tolist()
    path: list[int] = []
    slot = 0
    while True:
        residual = target_probs[slot].clone()  # p'
        for child in children[slot]:
            p_x = float(residual[tokens[child]])
            if p_x <= 0:
                continue  # impossible under p' (also a repeated sibling): rejected without a coin
            mass = float(residual.sum())
            if p_x >= mass or float(torch.rand((), generator=generator, device=target_probs.device)) * mass < p_x:
                break
            residual[tokens[child]] = 0.0
        else:
            return path, _sample_one(residual, generator)  # correction (bonus when slot is a leaf)
        path.append(child)
        slot = child + 1


def verify_keyed(
    draft_tokens: Sequence[int],  # [B]
    target_probs: Tensor,  # [B + 1, vocab] fp32, from `target_probs` with the request's params
    seed: int,
    start: int,  # absolute position of the block's first token: the committed context's length
) -> VerifyResult:
    """Verify one drafted block of a seeded request (module docstring): row i's keyed token y_i
    (position ``start + i``) is the plain-decoding token there; x_i is accepted while x_i == y_i,
    the first mismatch emits y_i, a fully accepted block emits the bonus y_B. q is not needed.

    Rows are drawn lazily: a block costs k + 1 draws of E, whatever its length.
    """
    num_draft_tokens = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != num_draft_tokens + 1:
        raise ValueError(
            f"target_probs must be [B + 1, vocab] = [{num_draft_tokens + 1}, V], got {tuple(target_probs.shape)}"
        )
    num_accepted = 0
    while True:
        token = int(keyed_sample(target_probs[num_accepted : num_accepted + 1], seed, start + num_accepted))
        if num_accepted == num_draft_tokens or int(draft_tokens[num_accepted]) != token:
            break
        num_accepted += 1
    return VerifyResult(num_draft_tokens=num_draft_tokens, num_accepted=num_accepted,
                        accepted_tokens=[int(t) for t in draft_tokens[:num_accepted]], next_token=token)


def verify_tree_keyed(
    tree: TokenTree,
    target_probs: Tensor,  # [num_nodes + 1, vocab]: row 0 at the root, row 1 + i after node i
    seed: int,
    start: int,  # absolute position of the root's children: the committed context's length
) -> tuple[list[int], int]:
    """`verify_tree` for a seeded request: at each depth d (the root first) the keyed token y of
    position ``start + d`` is computed from that slot's row; the child whose token is y is
    accepted and descended into, else y is emitted (correction, or bonus after a leaf). Any
    candidates, stochastic or not: the committed tokens are plain decoding's."""
    _check_tree_inputs(tree, target_probs)
    children: dict[tuple[int, int], int] = {}  # (parent slot, token) -> node; the first sibling wins
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        children.setdefault((parent + 1, token), node)
    path: list[int] = []
    slot = 0
    while True:
        token = int(keyed_sample(target_probs[slot : slot + 1], seed, start + len(path)))
        child = children.get((slot, token))
        if child is None:
            return path, token
        path.append(child)
        slot = child + 1
