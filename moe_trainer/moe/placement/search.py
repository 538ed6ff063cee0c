"""Ours: EPLB's pieces improved by swap local search under the equal-slot-count constraint, the
best of several group-to-node splits, and single-replica moves; never worse than EPLB. Pure."""
from __future__ import annotations

import functools
import heapq
import itertools
import math
import numpy as np
import torch
from torch import Tensor

from .eplb import (PlacementError, _balanced_packing_row, _effective_layout, _eplb_flat, _eplb_layer, _eplb_node_groups,
                   _group_loads, _replicate_row, _waterfill_max, check_layout)



def _swap_search(items: np.ndarray, max_iters: int) -> np.ndarray:
    """Lower the heaviest bin by swapping items with other bins; bin sizes never change.

    items: [B, K] item loads, bin b holding row b. Returns a permutation
    perm [B*K] of the flattened items (new flat position -> old flat position).
    A swap is taken only if both bins end strictly below the old maximum, so
    the sorted vector of bin loads decreases lexicographically and the search
    terminates. One-for-one swaps first; two-for-two when those are exhausted.
    """
    B, K = items.shape
    items = items.astype(np.float64).copy()
    idx = np.arange(B * K).reshape(B, K)
    loads = items.sum(1)
    tol = 1e-12 * max(float(loads.max()), 1e-300)
    singles = np.arange(K, dtype=np.int64).reshape(-1, 1)
    pairs = np.array(list(itertools.combinations(range(K), 2)), dtype=np.int64).reshape(-1, 2)
    for _ in range(max_iters):
        a = int(loads.argmax())
        if not (_try_swap(items, idx, loads, a, singles, tol) or
                (len(pairs) and _try_swap(items, idx, loads, a, pairs, tol))):
            break
    return idx.reshape(-1)


def _apply_best(worst: np.ndarray, limit: float) -> tuple[int, ...] | None:
    flat = int(worst.argmin())
    if worst.flat[flat] < limit:
        return np.unravel_index(flat, worst.shape)
    return None


def _try_swap(items, idx, loads, a, groups, tol) -> bool:
    """Swap a group of bin a's items for a group of another bin's (groups [C, g]: each row g
    positions within a bin; one-for-one swaps are groups of one). Of all such swaps, the one whose
    heavier bin ends lightest, taken only if both bins end below loads[a] - tol; items, idx and
    loads change in place."""
    group_sum = items[:, groups].sum(-1)  # [B, C]
    d = group_sum[a][:, None, None] - group_sum[None, :, :]  # [C, B, C]: load moved from bin a to bin b
    worst = np.maximum(loads[a] - d, loads[None, :, None] + d)
    worst[:, a, :] = np.inf
    hit = _apply_best(worst, loads[a] - tol)
    if hit is None:
        return False
    p, b, q = (int(x) for x in hit)
    delta = d[p, b, q]
    for i, j in zip(groups[p], groups[q]):
        items[a, i], items[b, j] = items[b, j], items[a, i]
        idx[a, i], idx[b, j] = idx[b, j], idx[a, i]
    loads[a] -= delta
    loads[b] += delta
    return True


def _lpt_max(loads: list[float], num_gpus: int, per_gpu: int) -> float:
    """Max GPU load of EPLB's balanced packing (heaviest first to the least-loaded GPU with room)."""
    heap = [(0.0, g) for g in range(num_gpus)]  # (load, gpu) of GPUs with room
    sizes = [0] * num_gpus
    top = 0.0
    for x in sorted(loads, reverse=True):
        load, g = heapq.heappop(heap)
        load += x
        sizes[g] += 1
        top = max(top, load)
        if sizes[g] < per_gpu:
            heapq.heappush(heap, (load, g))
    return top


def _replica_loads(weight: np.ndarray, cnt: np.ndarray) -> list[float]:
    return np.repeat(weight / cnt, cnt).tolist()


def _pack_counts(weight: np.ndarray, cnt: np.ndarray, num_gpus: int) -> tuple[list[int], float]:
    """Pack cnt[e] replicas of every expert: balanced packing, then swap search.

    Returns (slot -> local expert [M], max GPU load).
    """
    experts = np.repeat(np.arange(len(weight)), cnt)  # replica -> expert
    loads = weight[experts] / cnt[experts]
    per_gpu = len(experts) // num_gpus
    pack, rank = _balanced_packing_row(loads.tolist(), num_gpus)
    slot_of = np.asarray(pack) * per_gpu + np.asarray(rank)
    slots = np.empty_like(experts)
    slots[slot_of] = experts
    perm = _swap_search(loads[np.argsort(slot_of)].reshape(num_gpus, per_gpu), max_iters=50 * num_gpus)
    slots = slots[perm]
    top = float((weight[slots] / cnt[slots]).reshape(num_gpus, per_gpu).sum(1).max())
    return slots.tolist(), top


def _count_moves(cnt: np.ndarray, weight: np.ndarray, hot: list[int], top_k: int) -> list[tuple[int, int]]:
    """Candidate moves of one replica from expert x to expert y.

    hot: the experts on the most loaded GPU. Either one of them gets one more
    replica (taken from any replicated expert) or, if replicated, gives one
    to a heavy or replicated expert (fewer, larger replicas of a hot expert can
    pack better against the equal-slot constraint).
    """
    multi = np.flatnonzero(cnt >= 2).tolist()
    heavy = np.argsort(-(weight / cnt), kind="stable")[:top_k].tolist()
    moves = {(x, y) for y in hot for x in multi if x != y}
    moves |= {(x, y) for x in hot if cnt[x] >= 2 for y in set(heavy) | set(multi) if y != x}
    return sorted(moves)


def _improved_flat(weight: list[float], num_slots: int, num_gpus: int,
                   max_rounds: int = 32, tries: int = 3) -> list[int]:
    """Place one node's experts: replica counts and packing improved beyond EPLB's.

    Starts from the greedy replica counts (optimal max load per replica), packs
    them (balanced packing + swap search), then moves single replicas between
    experts while that lowers the max GPU load. Moves are ranked by the cheap
    balanced-packing max; the best `tries` are packed fully.
    """
    if num_gpus == 1:
        return _eplb_flat(weight, num_slots, num_gpus)
    w = np.asarray(weight, dtype=np.float64)
    per_gpu = num_slots // num_gpus
    _, greedy = _replicate_row(weight, num_slots)
    cnt = np.asarray(greedy)
    slots, best = _pack_counts(w, cnt, num_gpus)
    for _ in range(max_rounds):
        loads = (w[slots] / cnt[slots]).reshape(num_gpus, per_gpu).sum(1)
        a = int(loads.argmax())
        hot = sorted(set(slots[a * per_gpu:(a + 1) * per_gpu]))
        scored = []
        for x, y in _count_moves(cnt, w, hot, top_k=per_gpu + 3):
            trial = cnt.copy()
            trial[x] -= 1
            trial[y] += 1
            scored.append((_lpt_max(_replica_loads(w, trial), num_gpus, per_gpu), x, y))
        scored.sort()
        for _, x, y in scored[:tries]:
            trial = cnt.copy()
            trial[x] -= 1
            trial[y] += 1
            trial_slots, top = _pack_counts(w, trial, num_gpus)
            if top < best * (1 - 1e-12):
                cnt, slots, best = trial, trial_slots, top
                break
        else:
            break
    return slots


def _improved_node_groups(group_load: list[float], num_nodes: int) -> list[list[int]]:
    """EPLB's group-to-node packing, then swaps of groups between nodes lowering the max node load."""
    nodes = _eplb_node_groups(group_load, num_nodes)
    if num_nodes == 1:
        return nodes
    ids = np.asarray(nodes)  # [N, G/N]
    perm = _swap_search(np.asarray(group_load, dtype=np.float64)[ids], max_iters=50 * num_nodes)
    return ids.reshape(-1)[perm].reshape(ids.shape).tolist()


# Enumerate every way of splitting the groups over the nodes when that is cheap
# (always for DeepSeek-V3's 8 groups): it gives both the best candidates and an
# exact node-level lower bound.
_MAX_PARTITIONS = 20000
_MAX_NODE_SETS = 3000


@functools.lru_cache(maxsize=16)
def _partitions(num_groups: int, num_nodes: int) -> tuple[np.ndarray, list[tuple[int, ...]]] | None:
    """All splits of G groups into N unordered nodes of G/N groups.

    Returns (parts [num_partitions, N] of node-set ids, node_sets [id] -> sorted
    group tuple), or None when there are more than _MAX_PARTITIONS splits.
    """
    k = num_groups // num_nodes
    count = math.factorial(num_groups) // (math.factorial(k) ** num_nodes * math.factorial(num_nodes))
    if count > _MAX_PARTITIONS or math.comb(num_groups, k) > _MAX_NODE_SETS:
        return None
    node_sets = list(itertools.combinations(range(num_groups), k))
    set_id = {c: i for i, c in enumerate(node_sets)}
    parts: list[list[int]] = []

    def extend(rest: tuple[int, ...], chosen: list[int]) -> None:
        if not rest:
            parts.append(list(chosen))
            return
        first = rest[0]  # the lowest free group anchors the next node: each split once
        for others in itertools.combinations(rest[1:], k - 1):
            node = (first, *others)
            extend(tuple(g for g in rest if g not in node), chosen + [set_id[node]])

    extend(tuple(range(num_groups)), [])
    return np.asarray(parts, dtype=np.int64), node_sets


def _node_set_bounds(weight: list[float], node_sets: list[tuple[int, ...]], group_size: int,
                     slots: int, gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """Per node-set: (load, lower bound on its max GPU load).

    The bound is max(load / gpus, water-filled max load per replica of the
    node's experts over its `slots` slots).
    """
    loads, bounds = [], []
    for groups in node_sets:
        w = [weight[g * group_size + j] for g in groups for j in range(group_size)]
        loads.append(sum(w))
        bounds.append(max(sum(w) / gpus, _waterfill_max(w, slots)))
    return np.asarray(loads), np.asarray(bounds)


def _canonical(node_groups: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(sorted(tuple(sorted(g)) for g in node_groups))


def _candidate_node_groups(weight: list[float], groups: int, nodes: int, slots: int, gpus: int,
                           top: int = 3) -> list[list[list[int]]]:
    """Distinct group-to-node splits worth solving in full.

    EPLB's split, the swap-improved split and, when the splits are few enough to
    enumerate, the `top` best by node-level lower bound (ties: max node load).
    """
    group_load = _group_loads(weight, groups)
    found = [_eplb_node_groups(group_load, nodes), _improved_node_groups(group_load, nodes)]
    enum = _partitions(groups, nodes) if nodes > 1 else None
    if enum is not None:
        parts, node_sets = enum
        loads, bounds = _node_set_bounds(weight, node_sets, len(weight) // groups, slots, gpus)
        order = np.lexsort((loads[parts].max(1), bounds[parts].max(1)))[:top]
        found += [[list(node_sets[i]) for i in parts[j]] for j in order.tolist()]
    unique: dict = {}
    for node_groups in found:
        unique.setdefault(_canonical(node_groups), node_groups)
    return list(unique.values())


def _max_gpu_load(weight: list[float], phy2log: list[int], num_gpus: int) -> float:
    w = np.asarray(weight, dtype=np.float64)
    p = np.asarray(phy2log)
    cnt = np.bincount(p, minlength=len(w))
    return float((w[p] / cnt[p]).reshape(num_gpus, -1).sum(1).max())


def _improved_layer(weight: list[float], num_replicas: int, num_groups: int, num_nodes: int,
                    num_gpus: int) -> list[int]:
    groups, nodes = _effective_layout(len(weight), num_groups, num_nodes)
    size = len(weight) // groups
    slots, gpus = num_replicas // nodes, num_gpus // nodes
    solved: dict[tuple[int, ...], list[int]] = {}  # node's groups -> its slots' logical ids

    def solve(node_groups: list[list[int]]) -> list[int]:
        phy2log: list[int] = []
        for node in node_groups:
            key = tuple(node)
            if key not in solved:
                experts = [g * size + j for g in node for j in range(size)]
                local = _improved_flat([weight[e] for e in experts], slots, gpus)
                solved[key] = [experts[i] for i in local]
            phy2log += solved[key]
        return phy2log

    candidates = [_eplb_layer(weight, num_replicas, num_groups, num_nodes, num_gpus)]
    candidates += [solve(c) for c in _candidate_node_groups(weight, groups, nodes, slots, gpus)]
    # Never worse than EPLB: on ties the earliest candidate (EPLB's) wins.
    return min(candidates, key=lambda c: _max_gpu_load(weight, c, num_gpus))


def rebalance_experts(weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[Tensor, Tensor, Tensor]:
    """Place R physical experts on P GPUs; per layer never worse than `eplb_reference`.

    Args:
        weight: [L, E] load per logical expert (non-negative, e.g. token counts).
        num_replicas: R physical expert slots, a multiple of num_gpus, >= E.
        num_groups: G expert groups (E % G == 0); hierarchical when G % N == 0.
        num_nodes: N nodes of num_gpus / N GPUs each.
        num_gpus: P GPUs; GPU g holds physical slots [g*R/P, (g+1)*R/P).
    Returns:
        phy2log [L, R], log2phy [L, E, max_count] (-1 padded), logcnt [L, E]; int64.
    """
    if weight.dim() != 2:
        raise PlacementError(f"The load must be a 2-D tensor [layers, experts], got shape {list(weight.shape)}.")
    check_layout(weight.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    rows = [_improved_layer(w, num_replicas, num_groups, num_nodes, num_gpus)
            for w in weight.double().tolist()]  # host sync
    phy2log = torch.tensor(rows, dtype=torch.int64).reshape(weight.shape[0], num_replicas)
    log2phy, logcnt = log2phy_from_phy2log(phy2log, weight.shape[1])
    return phy2log, log2phy, logcnt


def log2phy_from_phy2log(phy2log: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """phy2log [L, R] -> log2phy [L, E, max_count] (physical slots of each expert, -1 padded), logcnt [L, E]."""
    L, R = phy2log.shape
    logcnt = torch.zeros(L, num_experts, dtype=torch.int64).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    width = max(int(logcnt.max()), 1) if L else 1  # host sync
    log2phy = torch.full((L, num_experts, width), -1, dtype=torch.int64)
    for layer, row in enumerate(phy2log.tolist()):
        seen = [0] * num_experts
        for slot, e in enumerate(row):
            log2phy[layer, e, seen[e]] = slot
            seen[e] += 1
    return log2phy, logcnt
