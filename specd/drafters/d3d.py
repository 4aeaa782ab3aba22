"""The D3D drafter at run time: per-sequence caches, blocks, and candidates in one packed pass.

`D3DDrafter` keeps one KV-cache row per sequence holding the committed context it has seen.
Every call first *syncs* each sequence: from its previous packed pass it commits the longest
path of known nodes that the new context confirms (the accepted tokens, and the correction or
bonus node of a hit), and feeds the context tokens it has not seen as known nodes of the next
pass. So a hit costs nothing extra and a miss costs one token.

`speculate` is D3D's point: while the target verifies block ``b`` (drafted here, with one extra
mask position whose distribution guesses the bonus token), it drafts the next block for the most
likely outcomes ``(k, c)`` of that verification. With q_i the drafter's distribution at block
position i (q_B the extra one):

    P(k accepted, then c) ~ prod_{i<k} q_i(b_i) * q_k(c)      (c != b_k when k < B)

since P(reject at k) * P(c | reject at k) = (1 - q_k(b_k)) * q_k(c) / (1 - q_k(b_k)). The
``budget`` best outcomes each get a known node ``c`` under ``b_{k-1}`` and a mask group under
it — all in ONE pass together with the block itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specd.drafters.base import (
    DraftBlock,
    Drafter,
    DraftRequest,
    Outcome,
    SpeculateRequest,
    check_block_size,
)
from specd.models.d3d import D3DModel, DraftPass, MaskGroup, build_draft_pass
from specd.sampling import SamplingParams, keyed_sample, sample, target_probs
from specd.scheduler import RowAllocator
from specd.tree import TokenTree


@dataclass(kw_only=True, slots=True)
class _Seq:
    row: int
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # committed in the cache row
    children: dict[tuple[int, int], int] = field(default_factory=dict)  # last pass: (parent, token) -> node
    last_pass: DraftPass | None = None
    returned: list[tuple[list[int], Tensor]] = field(default_factory=list)  # blocks + their q [B+1, V]


def likely_outcomes(dists: Tensor, tokens: list[int], budget: int) -> list[Outcome]:
    """The ``budget`` most likely (k, c) given the block's distributions ``[B + 1, vocab]``."""
    num = len(tokens)
    index = torch.arange(num)
    drafted = torch.tensor(tokens, dtype=torch.long)
    accept = dists[index, drafted]  # [B] drafter's estimate that b_i is accepted
    prefix = torch.cat([torch.ones(1), accept.cumprod(0)])  # [B + 1] P(first k accepted)
    scores = prefix[:, None] * dists[: num + 1]  # [B + 1, vocab]
    scores[index, drafted] = 0.0  # c = b_k would not be a rejection
    top = scores.flatten().topk(min(budget, scores.numel())).indices
    vocab = dists.shape[-1]
    return [(int(i) // vocab, int(i) % vocab) for i in top]


class D3DDrafter(Drafter):
    """Drafts blocks and candidate blocks with a `D3DModel` (see the module docstring)."""

    name = "d3d"
    can_speculate = True  # needs no target state, so it can draft during verification
    ar_first = True  # see `_run`

    def __init__(self, model: D3DModel, *, max_num_seqs: int = 16, device: str | torch.device = "cpu") -> None:
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.vocab_size = model.config.vocab_size
        # Groups have a trained size (`D3DConfig.group_size_for`); a block uses its first
        # positions and the one after it guesses the bonus token.
        self.max_block = max(model.config.group_sizes) - 1
        self.max_num_seqs = max_num_seqs
        self.cache = model.new_cache(max_num_seqs)
        self.seqs: dict[int, _Seq] = {}
        self.rows = RowAllocator(max_num_seqs)  # lowest first: `_run` covers the busy prefix only
        self.num_passes = 0

    # ---------------------------------------------------------------- sequences
    def release(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.rows.free(seq.row)

    def _seq(self, seq_id: int, params: SamplingParams) -> _Seq:
        if seq_id not in self.seqs:
            if not self.rows.num_free:
                raise RuntimeError(f"the drafter holds {self.max_num_seqs} sequences; release one first")
            row = self.rows.take()
            self._set_length(row, 0)
            self.seqs[seq_id] = _Seq(row=row, generator=params.generator(self.device))
        return self.seqs[seq_id]

    def _set_length(self, row: int, length: int) -> None:
        lengths = self.cache.lengths.clone()
        lengths[row] = length
        self.cache.rollback(lengths)

    def _sync(self, seqs: list[_Seq], contexts: list[list[int]]) -> list[list[int]]:
        """Commit what each new context confirms from the last pass; return the unseen tokens."""
        by_pass: dict[int, tuple[DraftPass, list]] = {}
        for seq, context in zip(seqs, contexts):
            base = len(seq.tokens)
            if seq.last_pass is None or context[:base] != seq.tokens:
                continue
            node, path = -1, []
            while base + len(path) < len(context):
                node = seq.children.get((node, context[base + len(path)]), -2)
                if node == -2:
                    break
                path.append(node)
            entry = by_pass.setdefault(id(seq.last_pass), (seq.last_pass, [None] * self.max_num_seqs))
            entry[1][seq.row] = path
            seq.tokens = context[: base + len(path)]
        for draft_pass, paths in by_pass.values():
            self.cache.commit(draft_pass.batch, paths[: draft_pass.batch.num_seqs])
        unseen = []
        for seq, context in zip(seqs, contexts):
            seq.last_pass, seq.children = None, {}
            common = _common_prefix(seq.tokens, context)
            if common < len(seq.tokens):  # the context diverged from what the row holds
                self._set_length(seq.row, common)
                seq.tokens = seq.tokens[:common]
            unseen.append(context[common:])
        return unseen

    # ---------------------------------------------------------------- the packed pass
    @torch.no_grad()
    def _run(
        self,
        known: dict[int, list[tuple[int, int]]],
        groups: list[MaskGroup],
        hidden: dict[int, Tensor] | None = None,  # row -> [num_known, target_hidden] (DFlash-style)
    ) -> tuple[DraftPass, Tensor]:
        """One pass: ``known[row]`` = (parent, token) nodes in order, plus mask groups.

        Returns the pass and the fp32 logits ``[num_groups, max_group, vocab]`` of the masks.
        """
        # Only the rows up to the highest one with work: idle rows past it cost nothing.
        rows = 1 + max([*known, *(g.seq for g in groups)], default=0)
        trees = []
        for row in range(rows):
            nodes = known.get(row, [])
            start = int(self.cache.lengths[row])
            trees.append(TokenTree(
                torch.tensor([t for _, t in nodes], dtype=torch.long),
                torch.tensor([p for p, _ in nodes], dtype=torch.long),
                torch.full((len(nodes),), start, dtype=torch.long),
            ))
        draft_pass = build_draft_pass(trees, groups, self.model.config.mask_token_id, self.cache.lengths[:rows], self.device)
        target_hidden = None
        if hidden is not None:
            batch = draft_pass.batch
            target_hidden = torch.zeros(batch.num_seqs, batch.max_new, self.model.config.target_hidden_size)
            for row, states in hidden.items():
                target_hidden[row, : states.shape[0]] = states
        hidden_states = self.model.hidden_states(draft_pass.batch, self.cache, target_hidden)
        self.num_passes += 1
        rows = torch.tensor([g.seq for g in groups], dtype=torch.long, device=self.device)
        # The head runs on mask positions only: known nodes need no logits.
        masks = hidden_states[rows[:, None], draft_pass.mask_index.clamp(min=0)]  # [groups, max_group, hidden]
        logits = self.model.lm_head(masks).float()
        if self.ar_first:
            # The first drafted token comes from the auxiliary AR head at the group's parent (the
            # newest known token): it is trained at every position, so it is the more accurate
            # guess there; the masks carry the rest of the block.
            parents = torch.tensor([g.node for g in groups], dtype=torch.long, device=self.device)
            has_parent = parents >= 0
            if bool(has_parent.any()):
                parent_states = hidden_states[rows[has_parent], parents[has_parent]]
                logits[has_parent, 0] = self.model.ar_head(parent_states).float()
        return draft_pass, logits

    def _block(
        self, seq: _Seq, logits: Tensor, block_size: int, params: SamplingParams, start: int | None = None
    ) -> DraftBlock:
        """A block from one group's logits ``[block_size + 1, vocab]`` (the last guesses the bonus).

        ``start`` is the absolute position of the block's first token (the length of the context
        it continues). A seeded sampled request's tokens are then drawn by the keyed race over q
        with the target's keys (`specd.sampling.keyed_sample`): drafter and target share their
        noise, so where q is close to p the drafted token is mostly the one the target will choose
        (a coupling). Without ``start`` (or a seed) they come from the sequence's generator (a
        seeded request's output is the same either way: only how much of a block is accepted changes).
        """
        dists = logits.softmax(-1)  # the drafter's own beliefs, for planning outcomes
        if params.greedy:
            tokens = dists[:block_size].argmax(-1)
            probs = None
            accept = dists[torch.arange(block_size), tokens]
        else:
            probs = target_probs(logits[:block_size], params)  # q: what the tokens are sampled from
            if params.keyed and start is not None:
                tokens = keyed_sample(probs, params.seed, start)
            else:
                tokens = sample(probs, seq.generator)
            # Not q(token): the engine chooses how much of the block to verify from these, and a
            # choice that looked at the sampled tokens would bias which of them get verified (the
            # rejection sampler needs every verified token distributed as q). E[q(token)] over
            # q is the same figure on average and depends on q alone.
            accept = probs.square().sum(-1)
        # The drafter's belief that each position is accepted, all earlier ones included.
        confidence = accept.cumprod(0)
        seq.returned.append((tokens.tolist(), dists))
        return DraftBlock(tokens=tokens.tolist(), probs=probs, confidence=confidence.tolist())

    def _finish(self, seq: _Seq, draft_pass: DraftPass, nodes: list[tuple[int, int]]) -> None:
        seq.last_pass = draft_pass
        seq.children = {(parent, token): i for i, (parent, token) in enumerate(nodes)}

    # ---------------------------------------------------------------- the Drafter protocol
    @torch.no_grad()
    def draft(self, requests: list[DraftRequest]) -> list[DraftBlock]:
        """A fresh block after each request's committed context."""
        for request in requests:
            check_block_size(request.block_size, self.max_block)
        seqs = [self._seq(r.seq_id, r.params) for r in requests]
        unseen = self._sync(seqs, [list(r.context) for r in requests])
        known, groups = {}, []
        for seq, request, new in zip(seqs, requests, unseen):
            known[seq.row] = [(i - 1, t) for i, t in enumerate(new)]
            groups.append(MaskGroup(seq=seq.row, node=len(new) - 1, size=self.model.config.group_size_for(request.block_size)))
        draft_pass, logits = self._run(known, groups)
        blocks = []
        for g, (seq, request) in enumerate(zip(seqs, requests)):
            self._finish(seq, draft_pass, known[seq.row])
            seq.returned = []
            blocks.append(self._block(seq, logits[g, : request.block_size + 1], request.block_size, request.params,
                                      start=len(request.context)))
        return blocks

    @torch.no_grad()
    def speculate(self, requests: list[SpeculateRequest]) -> list[dict[Outcome, DraftBlock]]:
        """Next blocks for the likely outcomes of each request's block under verification."""
        for request in requests:
            check_block_size(request.block_size, self.max_block)
        seqs = [self._seq(r.seq_id, r.params) for r in requests]
        plans = []
        for seq, request in zip(seqs, requests):
            dists = self._dists_of(seq, request.block)
            plans.append(likely_outcomes(dists, request.block, request.budget) if dists is not None and request.budget else [])
        if not any(plans):
            # Nothing to draft ahead for (no budget, or blocks this drafter did not return: after a
            # failover, an eviction, a weight swap): no pass; the next call syncs the contexts.
            return [{} for _ in requests]
        unseen = self._sync(seqs, [list(r.context) for r in requests])
        known, groups, outcome_groups = {}, [], []
        for seq, request, new, outcomes in zip(seqs, requests, unseen, plans):
            nodes = [(i - 1, t) for i, t in enumerate(new)]
            end = len(nodes) - 1  # the node that ends the context (-1: the cache ends it)
            block_nodes = []
            for token in request.block:
                nodes.append((block_nodes[-1] if block_nodes else end, token))
                block_nodes.append(len(nodes) - 1)
            mine = {}
            for k, c in outcomes:
                nodes.append((block_nodes[k - 1] if k else end, c))
                mine[(k, c)] = len(groups)
                groups.append(MaskGroup(seq=seq.row, node=len(nodes) - 1, size=self.model.config.group_size_for(request.block_size)))
            known[seq.row] = nodes
            outcome_groups.append(mine)
        draft_pass, logits = self._run(known, groups)
        results = []
        for seq, request, mine in zip(seqs, requests, outcome_groups):
            self._finish(seq, draft_pass, known[seq.row])
            seq.returned = []
            # The block for outcome (k, c) continues context + block[:k] + [c].
            results.append({
                outcome: self._block(seq, logits[g, : request.block_size + 1], request.block_size, request.params,
                                     start=len(request.context) + outcome[0] + 1)
                for outcome, g in mine.items()
            })
        return results

    def _dists_of(self, seq: _Seq, block: list[int]) -> Tensor | None:
        """The drafter's distributions ``[len(block) + 1, vocab]`` for a block it returned.

        The engine may verify a prefix of a returned block (its cost model shortens blocks);
        then the distribution at the first dropped position is the bonus guess.
        """
        for tokens, dists in seq.returned:
            if tokens[: len(block)] == block:
                return dists[: len(block) + 1]
        return None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
