"""Applying a plan at run time (what parallel/replicas.py and the EP dispatcher use): the plan's
check, GPU -> EP rank relabelling, and the slot each routed copy goes to. Pure: tensors in,
tensors out, no collectives or process groups."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .eplb import PlacementError



def check_plan(phy2log: object, num_layers: int, num_experts: int, num_gpus: int) -> None:
    """Raise PlacementError naming the first problem of a plan's phy2log table.

    phy2log: one row per MoE layer of R logical expert ids (ints in [0, E)),
    every expert at least once, R divisible by num_gpus (the EP size).
    """
    if not isinstance(phy2log, list) or not all(isinstance(r, list) for r in phy2log):
        raise PlacementError("phy2log must be a list of rows (one list of expert ids per MoE layer).")
    if len(phy2log) != num_layers:
        raise PlacementError(f"phy2log has {len(phy2log)} rows but the model has {num_layers} MoE layers "
                             f"(one row per MoE layer: main layers, then MTP layers).")
    for i, row in enumerate(phy2log):
        if len(row) != len(phy2log[0]):
            raise PlacementError(f"phy2log row {i} has {len(row)} slots but row 0 has {len(phy2log[0])}.")
        if len(row) % num_gpus:
            raise PlacementError(f"phy2log rows have {len(row)} slots, which {num_gpus} GPUs (parallel.ep) "
                                 f"cannot share evenly; make the plan with --gpus {num_gpus}.")
        for j, e in enumerate(row):
            if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < num_experts:
                raise PlacementError(f"phy2log row {i} slot {j} is {e!r}, but expert ids run from 0 to "
                                     f"{num_experts - 1} (model.n_routed_experts = {num_experts}).")
        missing = sorted(set(range(num_experts)) - set(row))
        if missing:
            raise PlacementError(f"phy2log row {i} has no replica of expert {missing[0]}; every expert "
                                 f"needs at least one slot.")


def _home_scores(row: Sequence[int], num_experts: int, num_gpus: int) -> list[list[int]]:
    """score[g][r]: slots of plan GPU g whose expert's weights live on EP rank r (expert e on e // (E/P))."""
    per_gpu, per_rank = len(row) // num_gpus, num_experts // num_gpus
    score = [[0] * num_gpus for _ in range(num_gpus)]
    for slot, e in enumerate(row):
        score[slot // per_gpu][e // per_rank] += 1
    return score


def _best_assignment(score: list[list[int]]) -> list[int]:
    """perm maximising sum score[g][perm[g]]; ties prefer perm[g] == g. Exact (subset DP) up to 8
    GPUs, greedy (largest score first) above."""
    n = len(score)
    w = [[s * (n + 1) + (g == r) for r, s in enumerate(row)] for g, row in enumerate(score)]
    if n <= 8:
        best = {0: (0, [])}  # mask of used ranks -> (value, ranks of GPUs 0 .. popcount-1)
        for g in range(n):
            nxt: dict[int, tuple[int, list[int]]] = {}
            for mask, (v, perm) in best.items():
                for r in range(n):
                    if not mask >> r & 1:
                        cand = (v + w[g][r], perm + [r])
                        if cand[0] > nxt.get(mask | 1 << r, (-1,))[0]:
                            nxt[mask | 1 << r] = cand
            best = nxt
        return best[(1 << n) - 1][1]
    perm, used = [-1] * n, set()
    for _, g, r in sorted(((-w[g][r], g, r) for g in range(n) for r in range(n))):
        if perm[g] < 0 and r not in used:
            perm[g] = r
            used.add(r)
    return perm


def relabel_gpus(row: Sequence[int], num_experts: int, num_gpus: int, num_nodes: int = 1) -> list[int]:
    """perm[g] = the EP rank that hosts plan GPU g's slots, maximising the slots whose expert already
    lives on that rank (expert e's weights live on EP rank e // (E/P)); any permutation is correct.
    With several nodes GPUs move only within their node, keeping a hierarchical plan's locality."""
    if num_gpus % num_nodes:
        num_nodes = 1
    block = num_gpus // num_nodes
    score = _home_scores(row, num_experts, num_gpus)
    perm: list[int] = []
    for b in range(0, num_gpus, block):
        sub = [s[b:b + block] for s in score[b:b + block]]
        perm += [b + r for r in _best_assignment(sub)]
    return perm


def replica_candidates(slots: Sequence[int], rank: int, slots_per_rank: int, num_experts: int
                       ) -> tuple[Tensor, Tensor]:
    """Physical slots a copy routed to each expert may go to, for tokens on EP rank `rank`
    (slot p lives on rank p // slots_per_rank): the expert's replicas on `rank` if it has any,
    else all of its replicas. Built on host lists, with no tensor op but the two results: the dry
    run builds the tables under fake tensors, where `nonzero` has no size.

    Args:
        slots: [R] logical expert of each physical slot (host ints; -1 = an empty slot).
    Returns:
        cand [E, W] (int64, -1 padded) and count [E] (int64, >= 1 when every expert has a slot).
    """
    rows: list[list[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(slots):
        if e >= 0:
            rows[e].append(p)
    rows = [[p for p in r if p // slots_per_rank == rank] or r for r in rows]
    width = max(1, max(len(r) for r in rows))
    return (torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64),
            torch.tensor([len(r) for r in rows], dtype=torch.int64))


def pick_replicas(expert: Tensor, cand: Tensor, count: Tensor, offset: int = 0) -> Tensor:
    """Physical slot of each routed copy: the j-th copy (in order) routed to expert e takes
    cand[e, (j + offset) % count[e]]; round-robin spreads an expert's copies evenly over its
    candidates, and a per-sender `offset` keeps senders from all starting on the same replica.

    Args:
        expert: [M] logical expert ids; cand [E, W], count [E] from `replica_candidates`.
    Returns:
        [M] physical slot ids (int64).
    """
    order = torch.argsort(expert, stable=True)
    sorted_e = expert[order]
    # per-expert counts by scatter_add: bincount would read its maximum on the host
    per_expert = torch.zeros(cand.shape[0], dtype=torch.int64, device=expert.device).scatter_add_(
        0, expert, torch.ones_like(expert))
    pos = torch.arange(expert.numel(), device=expert.device) - (per_expert.cumsum(0) - per_expert)[sorted_e]
    c = count.to(expert.device)[sorted_e]  # (cand and count are on expert's device already at run time)
    slot = torch.empty_like(expert)
    slot[order] = cand.to(expert.device)[sorted_e, (pos + offset) % c]
    return slot
