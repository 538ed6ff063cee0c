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
import torch.nn.functional as F

from .. import kernels


@dataclass
class Dispatched:
    x: torch.Tensor  # (M, d) token copies sorted by local expert
    gate: Optional[torch.Tensor]  # (M,) gate of each copy, or None when combine() applies it
    counts: torch.Tensor  # (local experts,) int64 rows per local expert, on the rows' device
    ctx: Any  # what combine() needs
    dropped: int = 0  # routed copies dropped by a capacity limit
    load: Optional[int] = None  # (token, expert) rows this rank's experts compute; None = every kept copy
    # the experts' parameters for these rows ({"gate_up_proj", "down_proj"} of the local slots) when
    # they are not the experts module's own (a placement plan's replicas); None = the module's own
    weights: Optional[dict] = None
    # slot-owned experts with copies: the first own_rows rows are the owned slots' (the module's own
    # parameters compute them), the rest the redundant slots' (`weights` holds the copies' only)
    own_rows: Optional[int] = None


def sort_by_key(keys: torch.Tensor, n_keys: int, backend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable argsort of int64 keys in [0, n_keys) and their counts -> (order, counts (n_keys,)),
    both on the keys' device, by the kernel back end (a counting sort on CPU ranks)."""
    return (backend or kernels.backend()).sort_by_key(keys, n_keys)


def sort_by_expert(topk_idx: torch.Tensor, n_experts: int, backend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One stable sort of the N*k assignments -> (order (N*k,), counts (E,))."""
    return sort_by_key(topk_idx.reshape(-1).contiguous(), n_experts, backend)


def capacity_keep(sorted_expert: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Bool mask over expert-sorted copies: the first `capacity` of each expert survive."""
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(sorted_expert.numel(), device=sorted_expert.device) - starts[sorted_expert]
    return pos < capacity


def route_order(topk_idx: torch.Tensor, n_experts: int, capacity_factor: Optional[float], backend=None
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Expert-sorted order of the routed copies, per-expert counts (on the device), and the number
    of copies dropped by a capacity of ceil(cf * N * k / E) per expert (if set). Dropless, no host
    sync; a capacity makes the kept copies' number data-dependent, and reading it is one."""
    n, k = topk_idx.shape
    order, counts = sort_by_expert(topk_idx, n_experts, backend)
    if capacity_factor is None:
        return order, counts, 0
    capacity = math.ceil(capacity_factor * n * k / n_experts)
    keep = capacity_keep(topk_idx.reshape(-1)[order], counts, capacity)
    dropped = int((~keep).sum())  # host sync, only with a capacity
    return order[keep], counts.clamp(max=capacity), dropped


def sum_copies(rows: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """out[t] = sum_j rows[inverse[t * k + j]]: each of n tokens owns exactly k rows (n = len(inverse) / k).
    One gather-and-reduce (embedding_bag), no scatter and no (n * k, d) temporary."""
    return F.embedding_bag(inverse.view(-1, k), rows, mode="sum")


class GatherRows(torch.autograd.Function):
    """rows = src[index] (index_select) whose backward is the inverse gather, not a scatter.

    `inverse` (or None) is the sorted position of each routed copy: with it, src row t
    was copied to rows inverse[t*k : t*k+k], so grad_src[t] = sum of those rows'
    gradients (k = 1: a pure permutation). Without it (dropped copies), index_add_."""

    @staticmethod
    def forward(ctx, src, index, inverse, k):
        ctx.save_for_backward(index, inverse)
        ctx.k, ctx.src_shape = k, src.shape
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        index, inverse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if inverse is not None:
            if grad.dim() == 1:
                g = grad.index_select(0, inverse)
                g = g.view(-1, ctx.k).sum(1) if ctx.k > 1 else g
            else:
                g = sum_copies(grad.contiguous(), inverse, ctx.k)
            return g.view(ctx.src_shape), None, None, None
        out = grad.new_zeros(ctx.src_shape)
        return out.index_add_(0, index, grad), None, None, None


class CombineRows(torch.autograd.Function):
    """out (n, d) = sum of the rows of y (M, d) per source token (token_of): a gather-and-reduce
    through `inverse` when every token kept its k copies, else index_add_; backward gathers."""

    @staticmethod
    def forward(ctx, y, token_of, inverse, n, k):
        ctx.save_for_backward(token_of)
        if inverse is not None:
            return sum_copies(y.contiguous(), inverse, k)
        return y.new_zeros(n, y.shape[-1]).index_add_(0, token_of, y)

    @staticmethod
    def backward(ctx, grad):
        (token_of,) = ctx.saved_tensors
        return grad.index_select(0, token_of), None, None, None, None


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def rows_by_token(inverse: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """(n * k,) the sorted rows holding each token's k copies, ascending per token: the
    `inverse` map GatherRows / CombineRows sum over, so the sums over a token's copies add
    in the same order as index_add_ / index_put_(accumulate=True) did (bitwise equal in fp32)."""
    return inverse.view(n, k).sort(dim=1).values.view(-1)


@dataclass
class _LocalCtx:
    token_of: torch.Tensor  # (M,) source token of each sorted row
    n_tokens: int
    inverse: Optional[torch.Tensor] = None  # (N, k) flat: sorted rows of each token's copies (ascending); None if dropped
    k: int = 1


class LocalDispatcher:
    """All experts on this rank: gather by a sort, combine by a gather-and-sum. The counts stay on
    the device (the experts' grouped GEMMs take them as offsets): no host sync when dropless."""

    def __init__(self, n_experts: int, capacity_factor: Optional[float] = None):
        self.n_experts = n_experts
        self.capacity_factor = capacity_factor
        self.kernels = kernels.backend()

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> Dispatched:
        n, k = topk_idx.shape
        order, counts, dropped = route_order(topk_idx, self.n_experts, self.capacity_factor, self.kernels)
        m = order.numel()
        if m != n * k:  # copies were dropped: no inverse map, combine by index_add_
            token_of = order // k
            gate = GatherRows.apply(topk_weight.reshape(-1), order, None, 1)
            xs = GatherRows.apply(x, token_of, None, k)
            return Dispatched(xs, gate, counts, _LocalCtx(token_of, n), dropped)
        inverse = inverse_permutation(order)
        token_of = order // k
        gate = GatherRows.apply(topk_weight.reshape(-1), order, inverse, 1)
        by_row = rows_by_token(inverse, n, k)
        xs = GatherRows.apply(x, token_of, by_row, k)
        return Dispatched(xs, gate, counts, _LocalCtx(token_of, n, by_row, k), dropped)

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        c = d.ctx
        return CombineRows.apply(y, c.token_of, c.inverse, c.n_tokens, c.k)
