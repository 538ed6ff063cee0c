"""Load-balance bookkeeping: the aux-loss-free bias update and the balance losses.

Pure functions on tensors; the trainer sums counts over ranks before
`update_bias`, so every replica of a bias moves identically.
"""
from __future__ import annotations

import torch


def update_bias(bias: torch.Tensor, counts: torch.Tensor, speed: float) -> torch.Tensor:
    """DeepSeek-V3 aux-loss-free balancing, in place: overloaded experts' bias
    falls by `speed`, underloaded ones' rises by `speed`. counts (..., E)."""
    mean = counts.float().mean(-1, keepdim=True)
    bias.add_(speed * torch.sign(mean - counts.float()))
    return bias


def skewed_biases(n_experts: int, skew: float) -> torch.Tensor:
    """(E,) biases falling evenly from +skew (expert 0) to -skew (expert E - 1): debug.route_skew."""
    return skew * (1 - 2 * torch.arange(n_experts, dtype=torch.float32) / max(1, n_experts - 1))


def sequence_balance_loss(scores: torch.Tensor, topk_idx: torch.Tensor, batch: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss sum_i f_i * P_i, averaged over sequences.

    scores (B*T, E) affinities; f_i = E / (k T) * #tokens of the sequence routed
    to i; P_i = mean over the sequence of the affinities normalised per token.
    """
    n, e = scores.shape
    seq = n // batch
    chosen = torch.zeros_like(scores).scatter_(1, topk_idx, 1.0).view(batch, seq, e)
    f = chosen.sum(1) * (e / (top_k * seq))  # (B, E), no gradient
    p = (scores / scores.sum(-1, keepdim=True)).view(batch, seq, e).mean(1)  # (B, E)
    return (f * p).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean of logsumexp(logits)^2, keeps router logits small."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()

