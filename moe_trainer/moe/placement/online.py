"""Online expert re-placement's planning, pure (placement rows in, rows and loads out; no process group):
what `parallel.replace_every` decides (parallel/slots.py's Replacer) and what the planner's step-time
model charges for it (plan/replacement.py).

A placement of one MoE layer is a row: `row[q]` the expert in global owned slot q, slot q on EP rank
q // S (S = E / ep); at home row[q] = q. Redundant slots are `replicas`: ep * r expert ids, rank q's
r copies at [q * r, (q + 1) * r), -1 = empty. An expert's tokens split evenly over its owner and its
copies (the dispatcher's round-robin).
"""
from __future__ import annotations

import heapq
from typing import Callable, Optional

import torch

from .search import rebalance_experts


def home_row(n_experts: int) -> list[int]:
    return list(range(n_experts))


def slot_row(row: list[int], replicas: Optional[list[int]], ep: int) -> list[int]:
    """Every EP rank's slots in global order: its S0 = E / ep owned slots (`row`), then its r redundant
    slots (`replicas`, ep * r expert ids, -1 = empty); the redundant slots are left out where the layer
    holds no copy at all (the dispatcher then sees S0 slots a rank, as without them)."""
    if not replicas or all(e < 0 for e in replicas):
        return list(row)
    s0, r = len(row) // ep, len(replicas) // ep
    return [e for q in range(ep) for e in row[q * s0:(q + 1) * s0] + replicas[q * r:(q + 1) * r]]


def copy_slots(load: torch.Tensor, row: list[int], ep: int, r: int) -> list[int]:
    """Fill the r redundant slots of each EP rank for one layer (ep * r ids, -1 = left empty): greedily,
    the busiest rank's expert with the most tokens per copy gains a copy on the least loaded rank that
    has a free slot and no copy of it, while that lowers the busiest rank's load (an expert's tokens
    split evenly over its copies, as the dispatcher's round-robin spreads them)."""
    s0 = len(row) // ep
    holders = {e: [q // s0] for q, e in enumerate(row)}
    slot_of = {e: q for q, e in enumerate(row)}  # a rank's load is summed in the row's order
    held = [list(row[q * s0:(q + 1) * s0]) for q in range(ep)]  # the experts on each rank, in that order
    replicas, free = [-1] * (ep * r), [list(range(q * r, (q + 1) * r)) for q in range(ep)]
    w = load.double().tolist()

    def load_of(q: int) -> float:
        total = 0.0
        for e in held[q]:
            total += w[e] / len(holders[e])
        return total
    cur = [load_of(q) for q in range(ep)]
    while True:
        # the busiest ranks, ties in rank order (the first is the busiest)
        top = heapq.nlargest(min(ep, r + 3), range(ep), key=cur.__getitem__)
        busiest = top[0]
        best = None
        for e in sorted(held[busiest], key=lambda e: -w[e] / len(holders[e])):
            has = set(holders[e])
            targets = [q for q in range(ep) if free[q] and q not in has]
            if not targets:
                continue
            t = min(targets, key=lambda q: cur[q])
            # a copy on t: e's holders give up a share, t takes one; every other rank keeps its load
            n = len(holders[e])
            changed = {q: cur[q] - w[e] / n + w[e] / (n + 1) for q in holders[e]}
            changed[t] = cur[t] + w[e] / (n + 1)
            rest = next((cur[q] for q in top if q not in changed), None)
            if rest is None:
                rest = max((cur[q] for q in range(ep) if q not in changed), default=0.0)
            if max(max(changed.values()), rest) < cur[busiest] * (1 - 1e-9):
                best = (e, t)
                break
        if best is None:
            return replicas
        e, t = best
        holders[e].append(t)
        held[t].append(e)
        held[t].sort(key=slot_of.__getitem__)
        replicas[free[t].pop(0)] = e
        for q in holders[e]:  # summed again as a whole, so equal loads stay equal
            cur[q] = load_of(q)


def moved_experts(old: list[int], new: list[int], ep: int) -> list[int]:
    """Experts each EP rank sends to another rank (one layer)."""
    s = len(old) // ep
    where = {e: q for q, e in enumerate(old)}
    out = [0] * ep
    for q, e in enumerate(new):
        if where[e] // s != q // s:
            out[where[e] // s] += 1
    return out


def keep_in_place(plan: list[int], old: list[int], ep: int) -> list[int]:
    """Plan `plan` (rank g holds plan[g*S:(g+1)*S]) with its ranks relabeled and its slots ordered so
    that the fewest experts move: plan rank g goes to the current rank holding most of its experts
    (greedy over the largest overlaps), an expert already on its rank keeps its slot."""
    s = len(old) // ep
    rank_of = {e: q // s for q, e in enumerate(old)}
    groups = [plan[g * s:(g + 1) * s] for g in range(ep)]
    overlap = sorted(((sum(rank_of[e] == r for e in grp), -g, -r) for g, grp in enumerate(groups)
                      for r in range(ep)), reverse=True)
    to_rank, taken = {}, set()
    for _, g, r in overlap:
        if -g not in to_rank and -r not in taken:
            to_rank[-g] = -r
            taken.add(-r)
    row = [-1] * len(old)
    for g, grp in enumerate(groups):
        r = to_rank[g]
        staying = {e for e in grp if rank_of[e] == r}
        arriving = iter(sorted(e for e in grp if e not in staying))
        for i in range(s):
            e = old[r * s + i]
            row[r * s + i] = e if e in staying else next(arriving)
    return row


def rank_loads(load: torch.Tensor, row: list[int], ep: int, replicas: Optional[list[int]] = None) -> torch.Tensor:
    """(ep,) load of each EP rank for one layer's expert load (E,) under placement `row` (with copies in
    `replicas`, an expert's load split evenly over its slots)."""
    slots = torch.tensor(slot_row(row, replicas, ep))
    held = slots >= 0
    copies = torch.zeros(load.numel(), dtype=load.dtype).index_add_(0, slots[held], torch.ones(int(held.sum()),
                                                                                                dtype=load.dtype))
    per_slot = torch.where(held, load[slots.clamp(min=0)] / copies[slots.clamp(min=0)], torch.zeros((), dtype=load.dtype))
    return per_slot.view(ep, -1).sum(1)


def copy_rows(row: list[int], replicas: list[int], ep: int, r: int) -> int:
    """The copies' rows the busiest EP rank sends or receives in one layer's refresh (and, reversed, in the
    hand-back of their gradients): per rank the copies it holds (received) and the copies of its own
    experts on other ranks (sent: an owner sends a row to every holder), the larger."""
    if not r:
        return 0
    s0 = len(row) // ep
    owner = {e: q // s0 for q, e in enumerate(row)}
    held = [sum(1 for e in replicas[q * r:(q + 1) * r] if e >= 0) for q in range(ep)]
    given = [0] * ep
    for e in replicas:
        if e >= 0:
            given[owner[e]] += 1
    return max(max(h, g) for h, g in zip(held, given))


def mean_imbalance(loads: list[torch.Tensor]) -> float:
    """Mean over layers of the busiest rank's load over the mean (1 for a layer without load)."""
    vals = [float(x.max() / x.mean()) if float(x.sum()) > 0 else 1.0 for x in loads]
    return sum(vals) / max(1, len(vals))


def replan(load: torch.Tensor, rows: list[list[int]], ep: int, redundant: int,
           solver: Callable = rebalance_experts) -> tuple[list[list[int]], list[list[int]]]:
    """A new placement for every MoE layer from its load (layers, E): the owned slots placed by
    `solver` (rebalance_experts, the Replacer's; or eplb_reference, EPLB's greedy), relabeled against
    the current `rows` so the fewest experts move (keep_in_place), then each rank's `redundant` copies
    filled greedily (copy_slots). Returns (rows, copies)."""
    plan = solver(load, load.shape[1], 1, 1, ep)
    plan = (plan[0] if isinstance(plan, tuple) else plan).tolist()
    new = [keep_in_place(p, c, ep) for p, c in zip(plan, rows)]
    return new, [copy_slots(load[i], new[i], ep, redundant) for i in range(len(new))]
