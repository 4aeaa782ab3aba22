"""SpecOPD: branch-parallel on-policy distillation of the D3D drafter (arXiv 2611.02846).

One step over a batch of reference trajectories (prompt + the target's own response):

1. **Screen** the batch: a trajectory with an empty prompt or response, ids outside the
   vocabulary, more tokens than ``max_context`` or no room for an anchor is skipped, counted
   under its reason and logged; training goes on with the rest (an all-bad batch is a no-op).
2. **Anchors**: ``anchors_per_seq`` distinct positions a of the response, uniform, from the
   trainer's seeded generator (a branch at a continues ``tokens[:a]``; ``a + block - 1`` stays
   within ``max_context``).
3. **Branches**: ONE drafter pass per batch (`build_draft_pass`, the serving drafter's own
   packing): each trajectory's prefix is a causal trunk and every anchor a gets one mask group
   under trunk node a - 1. D3D denoises a whole block from the prefix alone, so q_i at an
   anchor does not depend on the drafted tokens x_<i, and K branches at one anchor are K
   independent draws from the same per-position q at temperature 1 — no sequential rollout.
   As at serving time (`D3DDrafter.ar_first`), position 0 comes from the auxiliary AR head.
4. **Proposal tree**: all of a trajectory's branches become ONE `TokenTree`
   (`TokenTree.from_paths`, shared prefixes merged) whose roots hang off its prefix (up to its
   last anchor) at their anchors. A `TreeScorer` runs the target over it: `LocalScorer`
   prefills each prefix into the target's cache, then makes one pass over all trees (tree mask /
   indexed state replay / branch-consistent indexer groups, whichever the target is); a remote
   scorer sends the same trees to verifiers (``Verifier.Score``), so a trainer needs no target
   of its own. Either gives p at every branch position: p_0 = the target after ``tokens[:a]``
   (the context row a - 1), p_i = the target after ``tokens[:a] + x_<i`` (the tree node of
   depth i - 1; a branch's last token needs no node).
5. **Loss**: the drafter gives q on the same contexts *with gradients* in a packed training
   pass (`specd.train.drafter.denoising_batch`: trunk + a mask group at every anchor), and
   `specd.train.losses` compares them (E2E-TV by default).

A branch that drafts a stop token supervises up to it and not after (decoding would end there).
Baselines that plug into the same step — sequential-rollout OPD and offline distillation — are
in `specd.train.rollout`; they differ only in where branches and p come from (`supervise`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.drafters.d3d import D3DDrafter
from specd.models.d3d import D3DModel, MaskGroup, build_draft_pass
from specd.train.drafter import denoising_batch
from specd.train.losses import (
    LOSSES,
    acceptance_probs,
    distillation_loss,
    expected_accepted_length,
)
from specd.tree import TokenTree

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """A reference trajectory: a prompt and the target's response to it (token ids)."""

    prompt: list[int]
    response: list[int]

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.response]


@dataclass(kw_only=True, slots=True)
class SpecOPDConfig:
    block_size: int = 8
    """B: tokens per branch (the block length the drafter serves with)."""
    anchors_per_seq: int = 8
    """Anchors drawn per trajectory (fewer when the response is shorter)."""
    branches_per_anchor: int = 4
    """K: branches sampled at each anchor."""
    max_context: int = 4096
    """Longest trajectory accepted; anchors keep every branch token within it."""
    loss: str = "e2e-tv"
    """One of `specd.train.losses.LOSSES`: e2e-tv, kl, tv, hybrid."""
    warmup_steps: int = 100
    """Steps over which the hybrid loss moves from KL to E2E-TV."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 = none)."""
    rollout_tokens: int = 0
    """Sequential-rollout baseline: tokens generated per prompt (0 = the reference response's length)."""
    seed: int = 0
    """Seeds anchors and branch sampling."""

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.block_size < 1 or self.anchors_per_seq < 1 or self.branches_per_anchor < 1:
            raise ValueError("block_size, anchors_per_seq and branches_per_anchor must be >= 1")


@dataclass(kw_only=True, slots=True)
class Supervision:
    """What one step trains on: drafter contexts (prefix + anchors) and branches with their p."""

    prefixes: list[list[int]]
    """Per trajectory: the trunk the drafter conditions on (every anchor is <= its length)."""
    anchors: list[list[int]]
    """Per trajectory: its anchors; flattened in this order they index the *groups*."""
    group: Tensor  # [num_branches] int64: the group (trajectory, anchor) of each branch
    tokens: Tensor  # [num_branches, block] int64: the branch's drafted tokens
    target_probs: Tensor  # [num_branches, block, vocab] fp32: p_i after the branch's first i tokens
    valid: Tensor  # [num_branches, block] bool prefix mask: positions that count

    @property
    def num_supervised_tokens(self) -> int:
        return int(self.valid.sum())


@dataclass(kw_only=True, slots=True)
class StepResult:
    loss: float
    """The loss of this step (nan when every trajectory was skipped)."""
    num_supervised_tokens: int
    """Branch positions with a target distribution that the loss used."""
    num_branches: int
    expected_accepted_length: float
    """Mean over branches of Σ_k Π_{i<=k} α_i before the update (the E2E-TV estimate of k)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Trajectories of this batch skipped, by reason."""


# ---------------------------------------------------------------------------- screening and anchors
def screen(
    trajectories: Sequence[Trajectory], vocab_size: int, max_context: int, block_size: int
) -> tuple[list[Trajectory], Counter]:
    """The usable trajectories, and a count of the others by reason (each one logged)."""
    kept, skipped = [], Counter()
    for index, trajectory in enumerate(trajectories):
        reason = _bad(trajectory, vocab_size, max_context, block_size)
        if reason is None:
            kept.append(trajectory)
            continue
        skipped[reason] += 1
        logger.warning("skipping trajectory %d of the batch: %s", index, reason)
    return kept, skipped


def _bad(trajectory: Trajectory, vocab_size: int, max_context: int, block_size: int) -> str | None:
    prompt, response = trajectory.prompt, trajectory.response
    if not prompt:
        return "empty_prompt"
    if not response:
        return "empty_response"
    ids = [*prompt, *response]
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
        return "not_token_ids"
    if any(not 0 <= t < vocab_size for t in ids):
        return "out_of_vocabulary"
    if len(ids) > max_context:
        return "too_long"
    if len(prompt) > max_context - block_size + 1:
        return "no_anchor_in_context"
    return None


def choose_anchors(
    trajectory: Trajectory, num_anchors: int, block_size: int, max_context: int, rng: np.random.Generator
) -> list[int]:
    """Up to ``num_anchors`` distinct anchors in the response, uniform, sorted.

    Anchor a drafts positions a .. a + B - 1 from ``tokens[:a]``; a runs over the response
    (``len(prompt) <= a < len(tokens)``) and stops where a branch would leave ``max_context``.
    """
    low = len(trajectory.prompt)
    high = min(len(trajectory.prompt) + len(trajectory.response) - 1, max_context - block_size + 1)
    if high < low:
        return []
    count = min(num_anchors, high - low + 1)
    return sorted(int(a) for a in rng.choice(np.arange(low, high + 1), size=count, replace=False))


# ---------------------------------------------------------------------------- the drafter's side
def _group_logits(drafter: D3DModel, hidden: Tensor, rows: Tensor, mask_cols: Tensor, parent_cols: Tensor) -> Tensor:
    """Block logits ``[num_groups, block, vocab]`` from hidden states ``[num_seqs, num_tokens, hidden]``.

    ``mask_cols`` ``[num_groups, block]``: each group's mask columns; ``parent_cols``
    ``[num_groups]``: the trunk column before the anchor. Position 0 comes from the AR head there
    when the serving drafter does so (`D3DDrafter.ar_first`), the rest from the denoising head.
    """
    masks = hidden[rows[:, None], mask_cols]  # [num_groups, block, hidden]
    if not D3DDrafter.ar_first:
        return drafter.lm_head(masks)
    first = drafter.ar_head(hidden[rows, parent_cols])[:, None]  # [num_groups, 1, vocab]
    return torch.cat([first, drafter.lm_head(masks[:, 1:])], dim=1)


@torch.no_grad()
def sample_branches(
    drafter: D3DModel,
    prefixes: list[list[int]],
    anchors: list[list[int]],
    block_size: int,
    num_branches: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """``num_branches`` blocks per anchor from the current drafter, in ONE packed pass.

    Returns the tokens ``[num_groups, num_branches, block]`` and q ``[num_groups, block, vocab]``
    (groups = (trajectory, anchor) in the order of ``anchors``), sampled at temperature 1.
    """
    device = drafter.embed_tokens.weight.device
    group_size = drafter.config.group_size_for(block_size)
    known = [TokenTree.chain(prefix, 0) for prefix in prefixes]
    groups = [MaskGroup(seq=b, node=a - 1, size=group_size) for b, row in enumerate(anchors) for a in row]
    draft_pass = build_draft_pass(known, groups, drafter.config.mask_token_id, None, device)
    hidden = drafter.hidden_states(draft_pass.batch)
    rows = torch.tensor([g.seq for g in groups], device=device)
    parents = torch.tensor([g.node for g in groups], device=device)
    logits = _group_logits(drafter, hidden, rows, draft_pass.mask_index[:, :block_size], parents)
    q = logits.float().softmax(-1)  # [num_groups, block, vocab]
    draws = torch.multinomial(q.flatten(0, 1), num_branches, replacement=True, generator=generator)
    tokens = draws.view(len(groups), block_size, num_branches).transpose(1, 2)
    return tokens.contiguous(), q


def draft_logits(drafter: D3DModel, prefixes: list[list[int]], anchors: list[list[int]], block_size: int) -> Tensor:
    """The drafter's block logits ``[num_groups, block, vocab]`` with gradients, one packed pass.

    The training form of `sample_branches`' pass (`denoising_batch`: causal trunk, one mask group
    per anchor seeing the trunk before it and itself), so it gives the same q.
    """
    device = drafter.embed_tokens.weight.device
    group_size = drafter.config.group_size_for(block_size)
    num_seqs = len(prefixes)
    seq_len = max(len(p) for p in prefixes)
    max_groups = max(len(a) for a in anchors)
    tokens = torch.zeros(num_seqs, seq_len, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prefixes], dtype=torch.long)
    # Pad each trajectory's anchors with its first one; padded groups are computed, never read.
    padded = torch.tensor([row + [row[0]] * (max_groups - len(row)) for row in anchors], dtype=torch.long)
    for b, prefix in enumerate(prefixes):
        tokens[b, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
    batch, _ = denoising_batch(tokens, lengths, padded, group_size, drafter.config.mask_token_id)
    batch = _to(batch, device)
    hidden = drafter.hidden_states(batch)  # [num_seqs, seq_len + max_groups * group_size, hidden]
    rows = torch.tensor([b for b, row in enumerate(anchors) for _ in row], device=device)
    slots = torch.tensor([g for row in anchors for g in range(len(row))], device=device)
    mask_cols = seq_len + slots[:, None] * group_size + torch.arange(block_size, device=device)
    parents = torch.tensor([a - 1 for row in anchors for a in row], device=device)
    return _group_logits(drafter, hidden, rows, mask_cols, parents)


def _to(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    if batch.input_ids.device == device:
        return batch
    return ForwardBatch(
        input_ids=batch.input_ids.to(device), positions=batch.positions.to(device), mask=batch.mask.to(device),
        write_slots=batch.write_slots.to(device), num_new=batch.num_new.to(device), trees=batch.trees,
        cache_lens=batch.cache_lens.to(device), dense_causal=batch.dense_causal,
    )


# ---------------------------------------------------------------------------- the target's side
def proposal_tree(paths: list[tuple[int, list[int]]]) -> tuple[TokenTree, list[list[int]]]:
    """One `TokenTree` of ``(anchor, tokens)`` branches, and each branch's node per token."""
    tree = TokenTree.from_paths(paths)
    # The keys `from_paths` merges on, read back from the tree: (anchor, parent, token) -> node.
    children = {
        (a, p, t): node
        for node, (a, p, t) in enumerate(zip(tree.anchors.tolist(), tree.parents.tolist(), tree.tokens.tolist()))
    }
    nodes = []
    for anchor, path in paths:
        parent, mine = -1, []
        for token in path:
            parent = children[(anchor, parent, int(token))]
            mine.append(parent)
        nodes.append(mine)
    return tree, nodes


class TreeScorer(Protocol):
    """The target's side of a SpecOPD step: target distributions over proposal trees.

    `LocalScorer` runs a target module in this process; the trainer service's remote scorer asks
    verifiers (``Verifier.Score``), so the trainer itself needs no target.
    """

    vocab_size: int
    """The target's vocabulary: every id sent and every distribution's width."""
    stop_token_ids: tuple[int, ...]
    """Tokens that end decoding: a branch supervises up to its first one (`stop_mask`)."""

    def score(self, contexts: list[list[int]], trees: list[TokenTree], context_rows: list[list[int]]) -> list[Tensor]:
        """Per sequence b, fp32 probabilities ``[len(context_rows[b]) + trees[b].num_nodes, vocab]``.

        Rows are the requested context positions, then the tree's nodes in order; row r is the
        target's distribution of the token that follows it. ``trees[b]`` hangs off
        ``contexts[b]`` (every anchor ``<= len(contexts[b])``).
        """
        ...


class LocalScorer:
    """`TreeScorer` over a target module in this process: prefill, then ONE packed tree pass.

    ``temperature`` divides the logits before the fp32 softmax (1.0: the raw distribution, what
    SpecOPD distils).
    """

    def __init__(self, target: nn.Module, temperature: float = 1.0) -> None:
        if not temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.target = target.eval()
        self.temperature = temperature
        self.vocab_size: int = target.config.vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(target.config.stop_token_ids)

    @torch.no_grad()
    def score(self, contexts: list[list[int]], trees: list[TokenTree], context_rows: list[list[int]]) -> list[Tensor]:
        device = next(self.target.parameters()).device
        num_seqs = len(contexts)
        max_nodes = max(tree.num_nodes for tree in trees)
        cache = self.target.new_cache(num_seqs, capacity=max(len(c) for c in contexts) + max_nodes)
        prefill = ForwardBatch.causal(contexts, [0] * num_seqs, device)
        prefill_logits = self.target(prefill, cache)  # [num_seqs, max_context, vocab]
        cache.commit(prefill, [list(range(len(c))) for c in contexts])
        tree_logits = None
        if max_nodes:
            batch = ForwardBatch.from_trees(trees, cache.lengths, device)
            tree_logits = self.target(batch, cache)  # [num_seqs, max_nodes, vocab]
        out = []
        for b, (rows, tree) in enumerate(zip(context_rows, trees)):
            logits = prefill_logits[b, torch.as_tensor(rows, dtype=torch.long, device=device)]
            if tree.num_nodes:
                logits = torch.cat([logits, tree_logits[b, : tree.num_nodes]])
            logits = logits.float()  # [len(rows) + num_nodes, vocab]
            if self.temperature != 1.0:
                logits = logits / self.temperature
            out.append(logits.softmax(-1))
        return out


def as_scorer(target: nn.Module | TreeScorer) -> TreeScorer:
    """A target module wrapped in `LocalScorer`; a scorer as it is."""
    return LocalScorer(target) if isinstance(target, nn.Module) else target


@torch.no_grad()
def score_branches(
    scorer: TreeScorer | nn.Module,
    prefixes: list[list[int]],
    anchors: list[list[int]],
    branches: Tensor,  # [num_groups, num_branches, block] in the order of ``anchors``
) -> Tensor:
    """p at every branch position ``[num_groups * num_branches, block, vocab]``, fp32.

    One proposal tree per trajectory, scored in one call (see the module docstring). Row
    ``g * num_branches + k`` is branch k of group g; position i is the target after the group's
    reference prefix and the branch's first i tokens.
    """
    scorer = as_scorer(scorer)
    num_groups, num_branches, block = branches.shape
    branch_lists = branches.tolist()
    # Rows of the scorer's output, concatenated over sequences: each sequence's context rows
    # (anchor - 1 per group: p_0), then its tree's nodes (p_i, i >= 1, at the node of x_<i).
    first_row: list[int] = []
    node_row = torch.zeros(num_groups, num_branches, max(block - 1, 1), dtype=torch.long)
    trees, offset, group = [], 0, 0
    for row in anchors:
        groups = range(group, group + len(row))
        paths = [(a, branch_lists[g][k][: block - 1]) for g, a in zip(groups, row) for k in range(num_branches)]
        tree, nodes = proposal_tree(paths)
        trees.append(tree)
        first_row.extend(range(offset, offset + len(row)))
        for j, mine in enumerate(nodes):
            if mine:
                node_row[groups[j // num_branches], j % num_branches, : len(mine)] = offset + len(row) + torch.tensor(mine)
        offset += len(row) + tree.num_nodes
        group += len(row)
    probs = torch.cat(scorer.score(prefixes, trees, [[a - 1 for a in row] for row in anchors]))  # [rows, vocab]
    first = probs[torch.tensor(first_row, device=probs.device)]  # [num_groups, vocab]
    out = first[:, None, None].expand(num_groups, num_branches, 1, -1)
    if block > 1:
        out = torch.cat([out, probs[node_row.to(probs.device)]], dim=2)  # [num_groups, K, block, vocab]
    return out.flatten(0, 1)


def stop_mask(tokens: Tensor, stop_token_ids: Sequence[int]) -> Tensor:
    """``[num_branches, block]`` bool: True up to and including a branch's first stop token."""
    if not stop_token_ids:
        return torch.ones_like(tokens, dtype=torch.bool)
    is_stop = torch.isin(tokens, torch.tensor(list(stop_token_ids), device=tokens.device)).long()
    return (is_stop.cumsum(-1) - is_stop) == 0


# ---------------------------------------------------------------------------- trainers
class DrafterDistiller:
    """The step shared by SpecOPD and its baselines: screen, `supervise`, q with grad, loss, update.

    Subclasses say where branches and p come from (`supervise`); everything else is common, so the
    methods differ in exactly that and are compared fairly.

    ``target`` is a target module (wrapped in `LocalScorer`) or any `TreeScorer` (e.g. verifiers
    over gRPC). ``self.target`` is the module, or None with a scorer: only a subclass that says
    ``needs_target = False`` (SpecOPD) works without a local target; the baselines decode or run
    causal passes with it.
    """

    needs_target = True

    def __init__(self, target: nn.Module | TreeScorer, drafter: D3DModel, config: SpecOPDConfig | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.needs_target and not isinstance(target, nn.Module):
            raise TypeError(f"{type(self).__name__} needs a local target module, got {type(target).__name__}; "
                            "only SpecOPDTrainer scores through a TreeScorer")
        self.scorer = as_scorer(target)
        if drafter.config.vocab_size != self.scorer.vocab_size:
            raise ValueError(
                f"the drafter's vocabulary ({drafter.config.vocab_size}) differs from the target's "
                f"({self.scorer.vocab_size}): they must share one tokenizer"
            )
        self.target = target.eval() if isinstance(target, nn.Module) else None
        self.drafter = drafter
        self.config = config or SpecOPDConfig()
        drafter.config.group_size_for(self.config.block_size)  # raises when the block cannot be drafted
        self.optimizer = optimizer or torch.optim.AdamW(
            drafter.parameters(), lr=self.config.lr, betas=(0.9, 0.95), weight_decay=self.config.weight_decay
        )
        self.rng = np.random.default_rng(self.config.seed)  # anchors
        self.generator = torch.Generator(device=drafter.embed_tokens.weight.device).manual_seed(self.config.seed)
        self.num_steps = 0
        self.num_supervised_tokens = 0
        self.skipped: Counter = Counter()

    def supervise(self, trajectories: list[Trajectory]) -> Supervision | None:
        raise NotImplementedError

    def step(self, trajectories: Sequence[Trajectory]) -> StepResult:
        """One optimizer step on a batch; bad trajectories are skipped and counted, never raised."""
        config = self.config
        kept, skipped = screen(trajectories, self.scorer.vocab_size, config.max_context, config.block_size)
        self.skipped.update(skipped)
        supervision = self.supervise(kept) if kept else None
        result = self.train_on(supervision)
        result.skipped = dict(skipped)
        return result

    def train_on(self, supervision: Supervision | None) -> StepResult:
        """One optimizer step on given supervision; the result reports the loss before the update."""
        if supervision is None or supervision.num_supervised_tokens == 0:
            return StepResult(loss=math.nan, num_supervised_tokens=0, num_branches=0, expected_accepted_length=math.nan)
        self.drafter.train()
        loss, accepted = self._loss(supervision)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.num_steps += 1
        self.num_supervised_tokens += supervision.num_supervised_tokens
        return StepResult(
            loss=float(loss.detach()), num_supervised_tokens=supervision.num_supervised_tokens,
            num_branches=int(supervision.group.shape[0]), expected_accepted_length=accepted,
        )

    @torch.no_grad()
    def evaluate(self, supervision: Supervision) -> tuple[float, float]:
        """(loss, mean expected accepted length) of the current drafter on fixed supervision."""
        loss, accepted = self._loss(supervision)
        return float(loss), accepted

    def _loss(self, supervision: Supervision) -> tuple[Tensor, float]:
        config = self.config
        logits = draft_logits(self.drafter, supervision.prefixes, supervision.anchors, config.block_size)
        logits = logits[supervision.group.to(logits.device)].float()  # [num_branches, block, vocab]
        target_probs = supervision.target_probs.to(logits.device)
        valid = supervision.valid.to(logits.device)
        loss = distillation_loss(config.loss, target_probs, logits, valid,
                                 step=self.num_steps, warmup_steps=config.warmup_steps)
        with torch.no_grad():
            accepted = expected_accepted_length(acceptance_probs(target_probs, logits.detach()), valid)
        return loss, float(accepted.mean())

    def _anchors(self, trajectories: list[Trajectory], rng: np.random.Generator | None = None
                 ) -> tuple[list[Trajectory], list[list[int]]]:
        """Anchors per trajectory (from ``rng``, default the trainer's); a trajectory with none is skipped."""
        config = self.config
        rng = self.rng if rng is None else rng
        kept, anchors = [], []
        for trajectory in trajectories:
            row = choose_anchors(trajectory, config.anchors_per_seq, config.block_size, config.max_context, rng)
            if row:
                kept.append(trajectory)
                anchors.append(row)
            else:
                self.skipped["no_anchor"] += 1
                logger.warning("skipping a trajectory with no anchor (prompt %d, response %d tokens)",
                               len(trajectory.prompt), len(trajectory.response))
        return kept, anchors


class SpecOPDTrainer(DrafterDistiller):
    """SpecOPD (see the module docstring): branches from the drafter, p from one proposal-tree pass."""

    needs_target = False

    def supervise(self, trajectories: list[Trajectory], *, rng: np.random.Generator | None = None,
                  generator: torch.Generator | None = None) -> Supervision | None:
        """Supervision for a screened batch; anchors and branches come from ``rng`` and ``generator``
        (default: the trainer's own, so a held-out evaluation can pass fixed ones and leave
        training's random streams untouched)."""
        config = self.config
        trajectories, anchors = self._anchors(trajectories, rng)
        if not trajectories:
            return None
        # Only the prefix up to the last anchor is ever read, by the drafter or the target.
        prefixes = [t.tokens[: max(row)] for t, row in zip(trajectories, anchors)]
        self.drafter.eval()
        branches, _ = sample_branches(self.drafter, prefixes, anchors, config.block_size,
                                      config.branches_per_anchor, self.generator if generator is None else generator)
        target_probs = score_branches(self.scorer, prefixes, anchors, branches.cpu())
        tokens = branches.flatten(0, 1)  # [num_groups * K, block]
        group = torch.arange(branches.shape[0]).repeat_interleave(config.branches_per_anchor)
        return Supervision(
            prefixes=prefixes, anchors=anchors, group=group, tokens=tokens, target_probs=target_probs,
            valid=stop_mask(tokens, self.scorer.stop_token_ids),
        )
