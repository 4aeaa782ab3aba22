"""Acceptance-aware layer pruning of a D3D drafter (D3D, arXiv 2611.06425).

D3D prunes drafter layers by their effect on acceptance length, not on loss: remove a layer,
measure τ through the real engine on held-out prompts, and keep the removal if τ stays within
``tolerance`` of the unpruned drafter's. Layers are removed greedily, cheapest first, one at a
time, re-measuring after each removal (effects interact).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from specd.drafters.d3d import D3DDrafter
from specd.engine import EngineConfig, SpeculativeEngine
from specd.models.d3d import D3DModel
from specd.sampling import SamplingParams


@dataclass(kw_only=True, slots=True)
class PruneStep:
    removed: int
    """Layer index (in the original drafter) tried for removal."""
    kept_layers: list[int]
    """Layers the candidate keeps."""
    tau: float
    """τ of the candidate."""
    accepted: bool
    """Whether the removal was kept."""


def measure_tau(target: nn.Module, drafter: D3DModel, prompts: list[list[int]], *, block_size: int, max_tokens: int) -> float:
    """Greedy τ of ``drafter`` on ``prompts`` (fixed block length, so τ measures the drafter)."""
    engine = SpeculativeEngine(
        target, D3DDrafter(drafter, max_num_seqs=len(prompts)),
        EngineConfig(max_num_seqs=len(prompts), block_size=block_size, mode="sync", adaptive_block=False),
    )
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    engine.close()
    return engine.stats.tau


def prune(
    target: nn.Module,
    drafter: D3DModel,
    prompts: list[list[int]],
    *,
    tolerance: float = 0.99,
    block_size: int = 8,
    max_tokens: int = 48,
) -> tuple[D3DModel, float, list[PruneStep]]:
    """(pruned drafter, unpruned τ, the steps taken) — see the module docstring."""
    baseline = measure_tau(target, drafter, prompts, block_size=block_size, max_tokens=max_tokens)
    kept = list(range(drafter.config.num_hidden_layers))
    steps: list[PruneStep] = []
    while len(kept) > 1:
        trials = []
        for layer in kept:
            candidate = [i for i in kept if i != layer]
            tau = measure_tau(target, drafter.prune(candidate), prompts, block_size=block_size, max_tokens=max_tokens)
            trials.append((tau, layer, candidate))
        tau, layer, candidate = max(trials)
        ok = tau >= tolerance * baseline
        steps.extend(PruneStep(removed=l, kept_layers=c, tau=t, accepted=ok and l == layer) for t, l, c in trials)
        if not ok:
            break
        kept = candidate
    return drafter.prune(kept), baseline, steps
