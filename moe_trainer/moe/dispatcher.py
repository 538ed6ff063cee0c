"""Token dispatch: permute routed token copies so each expert's tokens are
contiguous, and un-permute (combine) the expert outputs.

`LocalDispatcher` serves one rank holding every expert. The all-to-all
dispatcher (parallel/expert.py) has the same interface: dispatch() returns the
rows its local experts compute, combine() returns (N, d) outputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class Dispatched:
    x: torch.Tensor  # (M, d) token copies sorted by local expert
    gate: Optional[torch.Tensor]  # (M,) gate of each copy, or None when combine() applies it
    counts: list[int]  # rows per local expert (host ints)
    ctx: Any  # what combine() needs
    dropped: int = 0  # routed copies dropped by a capacity limit


def sort_by_expert(topk_idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One stable sort of the N*k assignments -> (order (N*k,), counts (E,))."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=n_experts)


def capacity_keep(sorted_expert: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Bool mask over expert-sorted copies: the first `capacity` of each expert survive."""
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(sorted_expert.numel(), device=sorted_expert.device) - starts[sorted_expert]
    return pos < capacity


def route_order(topk_idx: torch.Tensor, n_experts: int, capacity_factor: Optional[float]
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Expert-sorted order of the routed copies, per-expert counts, and the number
    of copies dropped by a capacity of ceil(cf * N * k / E) per expert (if set)."""
    n, k = topk_idx.shape
    order, counts = sort_by_expert(topk_idx, n_experts)
    if capacity_factor is None:
        return order, counts, 0
    capacity = math.ceil(capacity_factor * n * k / n_experts)
    keep = capacity_keep(topk_idx.reshape(-1)[order], counts, capacity)
    dropped = int((~keep).sum())  # host sync, only with a capacity
    return order[keep], counts.clamp(max=capacity), dropped


@dataclass
class _LocalCtx:
    token_of: torch.Tensor  # (M,) source token of each sorted row
    n_tokens: int


class LocalDispatcher:
    """All experts on this rank: gather by a sort, combine by index_add_."""

    def __init__(self, n_experts: int, capacity_factor: Optional[float] = None):
        self.n_experts = n_experts
        self.capacity_factor = capacity_factor

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> Dispatched:
        n, k = topk_idx.shape
        order, counts, dropped = route_order(topk_idx, self.n_experts, self.capacity_factor)
        token_of = order // k
        gate = topk_weight.reshape(-1)[order]
        return Dispatched(x[token_of], gate, counts.tolist(), _LocalCtx(token_of, n), dropped)  # .tolist(): host sync

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        out = y.new_zeros(d.ctx.n_tokens, y.shape[-1])
        return out.index_add_(0, d.ctx.token_of, y)
