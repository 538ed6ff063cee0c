"""Imbalance of expert load (pure; also used by the trainer for its per-step metrics)."""
from __future__ import annotations

import torch
from torch import Tensor


def imbalance_stats(counts: Tensor) -> dict[str, Tensor]:
    """Per-layer imbalance of expert load.

    Args:
        counts: [..., E] tokens per expert (typically [layers, experts]).
    Returns:
        dict of [...] float64 tensors:
        max_over_mean: most loaded expert over the mean expert load (1 = balanced);
        cv: coefficient of variation, population std over mean;
        frac_below_10pct: share of experts with load strictly below 10% of the mean.
        A layer with no load counts as balanced (1, 0, 0).
    """
    c = counts.double()
    mean = c.mean(-1)
    empty = mean <= 0
    safe = torch.where(empty, torch.ones_like(mean), mean)
    return {
        "max_over_mean": torch.where(empty, torch.ones_like(mean), c.max(-1).values / safe),
        "cv": torch.where(empty, torch.zeros_like(mean), c.std(-1, correction=0) / safe),
        "frac_below_10pct": (c < 0.1 * mean.unsqueeze(-1)).double().mean(-1),
    }


STAT_NAMES = {
    "max_over_mean": "max/mean",
    "cv": "coefficient of variation",
    "frac_below_10pct": "share of experts below 10% of the mean load",
}
