"""A distribution check shared by the sampling tests (samples vs. exact probabilities)."""

from __future__ import annotations

from collections import Counter

import torch


def chi_square_check(samples: list, probs: dict, alpha: float = 1e-3) -> tuple[bool, str]:
    """Does ``samples`` look drawn from ``probs`` (outcome -> probability)?

    Passes iff Pearson's statistic is below the level that exact sampling from ``probs`` exceeds
    with probability alpha (chi-square p-value, from torch's regularised gamma function), and no
    outcome with probability 0 occurred. Cells expecting < 5 samples are pooled.
    """
    num = len(samples)
    counts = Counter(samples)
    impossible = [o for o in counts if probs.get(o, 0.0) == 0.0]
    if impossible:
        return False, f"outcomes with target probability 0 were emitted: {impossible[:5]}"
    observed, expected, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for outcome, prob in probs.items():
        if prob == 0:
            continue
        if prob * num < 5:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += prob * num
        else:
            observed.append(counts.get(outcome, 0))
            expected.append(prob * num)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    observed_t, expected_t = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = float(((observed_t - expected_t) ** 2 / expected_t).sum())
    dof = len(observed) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))
    tv = 0.5 * sum(abs(counts.get(o, 0) / num - p) for o, p in probs.items())
    return p_value >= alpha, f"chi2={statistic:.1f} dof={dof} p={p_value:.2e} TV={tv:.4f}"
