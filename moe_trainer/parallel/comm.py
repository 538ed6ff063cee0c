"""Autograd-aware collectives, with byte accounting.

Backward of an all-to-all is the all-to-all with the splits swapped.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist


class CommCounter:
    """Bytes this rank sent and received per kind of collective since reset()."""

    def __init__(self):
        self.sent: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)

    def add(self, kind: str, sent: int, received: int) -> None:
        self.sent[kind] += sent
        self.received[kind] += received

    def reset(self) -> dict:
        out = {"sent": dict(self.sent), "received": dict(self.received)}
        self.sent.clear()
        self.received.clear()
        return out


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                    counter: Optional[CommCounter] = None, kind: str = "all_to_all") -> torch.Tensor:
    """Rows [sum(in_splits), ...] -> rows [sum(out_splits), ...]; differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group, counter, kind)


def _exchange(x, out_splits, in_splits, group, counter, kind):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if counter is not None:
        me = dist.get_rank(group)
        row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row; x may have 0 rows
        counter.add(kind, (sum(in_splits) - in_splits[me]) * row, (sum(out_splits) - out_splits[me]) * row)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, counter, kind):
        ctx.splits, ctx.group, ctx.counter, ctx.kind = (out_splits, in_splits), group, counter, kind
        return _exchange(x, out_splits, in_splits, group, counter, kind)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.counter, ctx.kind + "_grad"), \
            None, None, None, None, None
