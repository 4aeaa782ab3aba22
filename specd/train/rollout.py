"""SpecOPD's baselines, in the same step as SpecOPD (`specd.train.specopd.DrafterDistiller`).

- **Sequential-rollout OPD** (`SequentialOPDTrainer`): real speculative decoding from each
  reference prompt with the current drafter — draft a block, verify it with the target, accept,
  continue — through the serving engine itself (`SpeculativeEngine`, sync mode, fixed block
  length, temperature 1). Every verified block is recorded with the context it was drafted from
  and the target's p at each of its positions (the verification pass computes them anyway).
  The drafter's q on those contexts comes from the same packed training pass as SpecOPD's, and
  the same loss is applied. Supervision arrives one block per sequence per target pass: that
  sequential dependency is what SpecOPD removes.
- **Offline distillation** (`OfflineDistillationTrainer`): teacher-forced. At anchors of the
  reference trajectory, the "branch" is the reference continuation ``tokens[a : a + B]`` itself;
  p comes from one causal target pass over the reference; positions past the end of the
  reference are masked. Its loss is always forward KL (the trainer replaces any other
  ``config.loss`` and says so in the log): that is the objective of the offline recipe the issue
  names as the baseline (teacher-forced, KL; DistillSpec's offline setting), and E2E-TV on
  teacher-forced blocks would measure acceptance of blocks the drafter never drafts.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import Tensor, nn

from specd.batch import ForwardBatch
from specd.drafters.d3d import D3DDrafter
from specd.engine import EngineConfig, SpeculativeEngine
from specd.models.d3d import D3DModel
from specd.sampling import SamplingParams
from specd.train.specopd import (
    DrafterDistiller,
    SpecOPDConfig,
    Supervision,
    Trajectory,
    stop_mask,
)

logger = logging.getLogger(__name__)


class RecordingEngine(SpeculativeEngine):
    """The serving engine, also keeping every verified block: (seq_id, anchor, tokens, p)."""

    def __init__(self, target: nn.Module, drafter, config: EngineConfig) -> None:
        super().__init__(target, drafter, config)
        self.records: list[tuple[int, int, list[int], Tensor]] = []

    def _target_probs(self, seq, block: list[int], logits: Tensor) -> Tensor:
        # Every sampled row's verification computes p here; ``seq.context`` is still the
        # committed context the block was drafted after.
        probs = super()._target_probs(seq, block, logits)
        if block:
            self.records.append((seq.seq_id, len(seq.context), list(block), probs[: len(block)].clone()))
        return probs


@torch.no_grad()
def rollout(
    target: nn.Module, drafter: D3DModel, prompts: list[list[int]], max_tokens: list[int], block_size: int, seed: int
) -> tuple[list[list[int]], list[tuple[int, int, list[int], Tensor]]]:
    """Speculative decoding of ``prompts`` at temperature 1 -> (prompt + output per prompt, block records)."""
    drafter.eval()
    num_seqs = min(len(prompts), 16)
    config = EngineConfig(max_num_seqs=num_seqs, block_size=block_size, mode="sync", adaptive_block=False)
    engine = RecordingEngine(target, D3DDrafter(drafter, max_num_seqs=num_seqs), config)
    params = [
        SamplingParams(max_tokens=n, temperature=1.0, seed=seed + i, stop_token_ids=target.config.stop_token_ids)
        for i, n in enumerate(max_tokens)
    ]
    try:
        generations = engine.generate(prompts, params)
    finally:
        engine.close()
    return [list(p) + g.token_ids for p, g in zip(prompts, generations)], engine.records


class SequentialOPDTrainer(DrafterDistiller):
    """Sequential-rollout OPD (module docstring): supervision from real draft -> verify loops."""

    def supervise(self, trajectories: list[Trajectory]) -> Supervision | None:
        config = self.config
        prompts = [t.prompt for t in trajectories]
        max_tokens = [config.rollout_tokens or len(t.response) for t in trajectories]
        # A rollout must fit the context, its last block included.
        max_tokens = [max(1, min(n, config.max_context - len(p) - config.block_size)) for n, p in zip(max_tokens, prompts)]
        seed = int(self.rng.integers(0, 2**31))
        sequences, records = rollout(self.target, self.drafter, prompts, max_tokens, config.block_size, seed)
        if not records:
            return None
        block = config.block_size
        anchors: list[list[int]] = [[] for _ in trajectories]
        group_of_record = []
        for seq_id, anchor, _, _ in records:
            anchors[seq_id].append(anchor)
        # Groups in `DrafterDistiller` order: trajectory by trajectory, each in anchor order.
        order = {}
        for b, row in enumerate(anchors):
            for j, a in enumerate(row):
                order[(b, j)] = len(order)
        seen = [0] * len(trajectories)
        tokens = torch.zeros(len(records), block, dtype=torch.long)
        target_probs = torch.zeros(len(records), block, self.target.config.vocab_size)
        valid = torch.zeros(len(records), block, dtype=torch.bool)
        for r, (seq_id, _, drafted, probs) in enumerate(records):
            group_of_record.append(order[(seq_id, seen[seq_id])])
            seen[seq_id] += 1
            tokens[r, : len(drafted)] = torch.tensor(drafted)
            target_probs[r, : len(drafted)] = probs.float().cpu()
            valid[r, : len(drafted)] = True
        valid &= stop_mask(tokens, self.target.config.stop_token_ids)
        # Trajectories without a block have no groups, so leaving them out keeps the numbering.
        used = [b for b, row in enumerate(anchors) if row]
        return Supervision(
            prefixes=[sequences[b][: max(anchors[b])] for b in used], anchors=[anchors[b] for b in used],
            group=torch.tensor(group_of_record), tokens=tokens, target_probs=target_probs, valid=valid,
        )


class OfflineDistillationTrainer(DrafterDistiller):
    """Offline distillation (module docstring): teacher-forced reference blocks, p from one causal pass, KL."""

    def __init__(self, target: nn.Module, drafter: D3DModel, config: SpecOPDConfig | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        config = config or SpecOPDConfig(loss="kl")
        if config.loss != "kl":
            logger.info("offline distillation trains with loss 'kl', not %r (the baseline's objective)", config.loss)
            config = dataclasses.replace(config, loss="kl")
        super().__init__(target, drafter, config, optimizer)

    def supervise(self, trajectories: list[Trajectory]) -> Supervision | None:
        config = self.config
        block = config.block_size
        trajectories, anchors = self._anchors(trajectories)
        if not trajectories:
            return None
        device = next(self.target.parameters()).device
        sequences = [t.tokens for t in trajectories]
        # The target sees each reference up to the last token a block reads.
        windows = [s[: min(len(s), max(row) + block - 1)] for s, row in zip(sequences, anchors)]
        with torch.no_grad():
            logits = self.target(ForwardBatch.causal(windows, device=device))  # [num_seqs, max_len, vocab]
        group_rows, group_anchors = [], []
        for b, row in enumerate(anchors):
            for a in row:
                group_rows.append(b)
                group_anchors.append(a)
        num_groups = len(group_rows)
        offsets = torch.arange(block)
        positions = torch.tensor(group_anchors)[:, None] + offsets  # [num_groups, block] predicted positions
        lengths = torch.tensor([len(s) for s in sequences])[group_rows]
        valid = positions < lengths[:, None]
        tokens = torch.zeros(num_groups, block, dtype=torch.long)
        for g, (b, a) in enumerate(zip(group_rows, group_anchors)):
            reference = sequences[b][a : a + block]
            tokens[g, : len(reference)] = torch.tensor(reference)
        columns = (positions - 1).clamp(max=logits.shape[1] - 1).to(device)
        rows = torch.tensor(group_rows, device=device)[:, None]
        target_probs = logits[rows, columns].float().softmax(-1).cpu()
        valid &= stop_mask(tokens, self.target.config.stop_token_ids)
        return Supervision(
            prefixes=[s[: max(row)] for s, row in zip(sequences, anchors)], anchors=anchors,
            group=torch.arange(num_groups), tokens=tokens, target_probs=target_probs, valid=valid,
        )
