"""Expert placement with redundant experts: the problem DeepSeek's EPLB solves.

Given the load of every logical expert of every MoE layer, choose R >= E
physical expert slots (every logical expert at least once, hot experts
replicated) and put them on P GPUs, S = R / P slots each, so that the most
loaded GPU is as light as possible. Tokens routed to a replicated expert are
spread evenly over its replicas, so one replica carries load_e / count_e.

Slot layout (as in EPLB): GPU g holds physical slots [g*S, (g+1)*S); node n
holds GPUs [n*P/N, (n+1)*P/N). When the number of expert groups G (the unit
of DeepSeek-V3's group-limited routing) is divisible by the number of nodes N
the policy is hierarchical: every group lives on one node, G/N groups per node,
so a token's experts span few nodes. Otherwise the policy is global (one pool
of P GPUs, groups ignored), as in EPLB.

Solvers (pure: tensors in, tensors out, no torch.distributed):
- `eplb_reference`: our implementation of the published EPLB greedy
  (balanced packing of groups to nodes -> per node, greedily give the next
  replica to the expert with the largest load per replica -> balanced packing
  of the physical experts to the node's GPUs).
- `rebalance_experts`: ours, built on EPLB's pieces:
  1. group-to-node splits: EPLB's, EPLB's improved by swapping groups between
     nodes, and (when the splits can be enumerated, e.g. G <= 8) the best few
     by the node-level lower bound;
  2. per node: EPLB's greedy replica counts (they minimise the max load per
     replica), packed by EPLB's balanced packing and then improved by swap
     local search between the most loaded GPU and the others (one-for-one,
     then two-for-two, so every GPU keeps R/P slots);
  3. then single replicas are moved between experts (e.g. one replica fewer
     for a hot expert, one more for another) while that lowers the node's max
     GPU load: minimising the max replica load is not the same as minimising
     the max GPU load once every GPU must hold exactly R/P replicas.
  Per layer the best of these plans and EPLB's own is returned, so the result
  is never worse than EPLB by construction.
Evaluation: `gpu_loads`, `max_over_mean` and `lower_bound` (what no plan can beat).

Applying a plan (pure pieces; parallel/replicas.py builds on them):
- `check_plan`: a phy2log table against a model and an EP size;
- `relabel_gpus`: which EP rank hosts each plan GPU, so that as many slots as
  possible hold an expert whose weights already live on that rank;
- `replica_candidates` / `pick_replicas`: the physical slot each routed copy
  goes to (a replica on the sender's own rank if there is one, else round-robin
  over the expert's replicas).
"""
from __future__ import annotations

import functools
import heapq
import itertools
import math
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "PlacementError",
    "check_layout",
    "is_hierarchical",
    "balanced_packing",
    "replicate_experts",
    "eplb_reference",
    "rebalance_experts",
    "gpu_loads",
    "max_over_mean",
    "lower_bound",
    "log2phy_from_phy2log",
    "check_plan",
    "relabel_gpus",
    "replica_candidates",
    "pick_replicas",
]


class PlacementError(ValueError):
    """Bad placement input: the message is one user-facing sentence."""


# ---------------------------------------------------------------------------
# Layout checks
# ---------------------------------------------------------------------------

def check_layout(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    """Raise PlacementError naming the first inconsistent number of a layout."""
    for name, v in (("experts", num_experts), ("replicas", num_replicas), ("groups", num_groups),
                    ("nodes", num_nodes), ("gpus", num_gpus)):
        if not isinstance(v, int) or v < 1:
            raise PlacementError(f"The number of {name} must be a positive integer, got {v!r}.")
    if num_replicas < num_experts:
        raise PlacementError(f"replicas ({num_replicas}) must be at least the number of experts "
                             f"({num_experts}) so that every expert has a slot.")
    if num_experts % num_groups:
        raise PlacementError(f"groups ({num_groups}) must divide the number of experts ({num_experts}).")
    if num_gpus % num_nodes:
        raise PlacementError(f"nodes ({num_nodes}) must divide gpus ({num_gpus}).")
    if num_replicas % num_gpus:
        raise PlacementError(f"gpus ({num_gpus}) must divide replicas ({num_replicas}) "
                             f"so every GPU holds the same number of expert slots.")


def is_hierarchical(num_groups: int, num_nodes: int) -> bool:
    """EPLB's rule: groups are kept on one node when G is divisible by N."""
    return num_groups % num_nodes == 0


# ---------------------------------------------------------------------------
# EPLB building blocks (reference greedy), on one row; batched wrappers below
# ---------------------------------------------------------------------------

def _balanced_packing_row(weight: Sequence[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Heaviest item first, each to the least-loaded pack that still has room.

    Every pack receives exactly len(weight) / num_packs items. Ties go to the
    lower item index and the lower pack index. Returns (pack, rank_in_pack).
    """
    n = len(weight)
    per_pack = n // num_packs
    order = sorted(range(n), key=lambda i: -weight[i])  # stable: equal weights keep index order
    loads = [0.0] * num_packs
    sizes = [0] * num_packs
    pack = [0] * n
    rank = [0] * n
    for i in order:
        p = min((q for q in range(num_packs) if sizes[q] < per_pack), key=lambda q: loads[q])
        pack[i], rank[i] = p, sizes[p]
        loads[p] += weight[i]
        sizes[p] += 1
    return pack, rank


def _replicate_row(weight: Sequence[float], num_phy: int) -> tuple[list[int], list[int]]:
    """Greedy replication: each extra slot goes to the expert with the largest load per replica.

    Returns (phy2log [num_phy], logcnt [n]); physical slot i < n is expert i,
    the extra slots follow in the order they were handed out. The greedy
    minimises max_e weight_e / count_e over all counts (each >= 1, num_phy in
    all): every expert it grew had, at its last increment, a load per replica
    >= the final maximum m, so a plan with a maximum below m needs at least the
    greedy count for each of them and one more for the expert attaining m,
    which is more than num_phy slots.
    """
    n = len(weight)
    cnt = [1] * n
    phy2log = list(range(n))
    heap = [(-w, i) for i, w in enumerate(weight)]  # (-load per replica, expert); ties: lower id
    heapq.heapify(heap)
    for _ in range(num_phy - n):
        _, e = heapq.heappop(heap)
        cnt[e] += 1
        phy2log.append(e)
        heapq.heappush(heap, (-weight[e] / cnt[e], e))
    return phy2log, cnt


def _waterfill_max(weight: Sequence[float], num_phy: int) -> float:
    """min over replica counts (each >= 1, summing to num_phy) of max_e weight_e / count_e."""
    _, cnt = _replicate_row(weight, num_phy)
    return max(w / c for w, c in zip(weight, cnt))


def balanced_packing(weight: Tensor, num_packs: int) -> tuple[Tensor, Tensor]:
    """EPLB balanced packing of n items into num_packs packs of n / num_packs items.

    Args:
        weight: [X, n] item weights; num_packs must divide n.
    Returns:
        pack_index [X, n], rank_in_pack [X, n] (int64).
    """
    rows = [_balanced_packing_row(w, num_packs) for w in weight.double().tolist()]  # host sync
    return (torch.tensor([p for p, _ in rows], dtype=torch.int64),
            torch.tensor([r for _, r in rows], dtype=torch.int64))


def replicate_experts(weight: Tensor, num_phy: int) -> tuple[Tensor, Tensor]:
    """EPLB greedy replication of n logical experts into num_phy >= n physical ones.

    Args:
        weight: [X, n] load per logical expert.
    Returns:
        phy2log [X, num_phy] and logcnt [X, n] (int64).
    """
    rows = [_replicate_row(w, num_phy) for w in weight.double().tolist()]  # host sync
    return (torch.tensor([p for p, _ in rows], dtype=torch.int64),
            torch.tensor([c for _, c in rows], dtype=torch.int64))


# ---------------------------------------------------------------------------
# Shared skeleton: groups -> nodes, then one "flat" problem per node
# ---------------------------------------------------------------------------

# A flat solver places the experts of one node: (loads [n], slots M, gpus Q) ->
# local expert index for each of the node's M slots, GPU q owning [q*M/Q, (q+1)*M/Q).
FlatSolver = Callable[[list[float], int, int], list[int]]


def _eplb_flat(weight: list[float], num_slots: int, num_gpus: int) -> list[int]:
    phy2log, cnt = _replicate_row(weight, num_slots)
    phy_load = [weight[e] / cnt[e] for e in phy2log]
    pack, rank = _balanced_packing_row(phy_load, num_gpus)
    per_gpu = num_slots // num_gpus
    out = [0] * num_slots
    for j, e in enumerate(phy2log):
        out[pack[j] * per_gpu + rank[j]] = e
    return out


def _place(weight: list[float], node_groups: list[list[int]], group_size: int,
           num_replicas: int, num_gpus: int, flat: FlatSolver) -> list[int]:
    """Solve each node's flat problem and write its slots into the global phy2log row."""
    num_nodes = len(node_groups)
    slots_per_node, gpus_per_node = num_replicas // num_nodes, num_gpus // num_nodes
    phy2log: list[int] = []
    for groups in node_groups:
        experts = [g * group_size + j for g in groups for j in range(group_size)]
        local = flat([weight[e] for e in experts], slots_per_node, gpus_per_node)
        phy2log.extend(experts[i] for i in local)
    return phy2log


def _effective_layout(num_experts: int, num_groups: int, num_nodes: int) -> tuple[int, int]:
    """(groups, nodes) actually used: the global policy is hierarchy with one group on one node."""
    return (num_groups, num_nodes) if is_hierarchical(num_groups, num_nodes) else (1, 1)


def _eplb_node_groups(group_load: list[float], num_nodes: int) -> list[list[int]]:
    pack, rank = _balanced_packing_row(group_load, num_nodes)
    nodes: list[list[int]] = [[] for _ in range(num_nodes)]
    for g in sorted(range(len(group_load)), key=lambda g: rank[g]):
        nodes[pack[g]].append(g)
    return nodes


def _group_loads(weight: list[float], num_groups: int) -> list[float]:
    size = len(weight) // num_groups
    return [sum(weight[g * size:(g + 1) * size]) for g in range(num_groups)]


def _eplb_layer(weight: list[float], num_replicas: int, num_groups: int, num_nodes: int,
                num_gpus: int) -> list[int]:
    groups, nodes = _effective_layout(len(weight), num_groups, num_nodes)
    node_groups = _eplb_node_groups(_group_loads(weight, groups), nodes)
    return _place(weight, node_groups, len(weight) // groups, num_replicas, num_gpus, _eplb_flat)


def eplb_reference(weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                   num_gpus: int) -> Tensor:
    """Reference: the published EPLB greedy (hierarchical when G % N == 0, else global).

    Args:
        weight: [L, E] load per logical expert (non-negative).
    Returns:
        phy2log [L, R] (int64): logical expert id of every physical slot.
    """
    check_layout(weight.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    rows = [_eplb_layer(w, num_replicas, num_groups, num_nodes, num_gpus)
            for w in weight.double().tolist()]  # host sync
    return torch.tensor(rows, dtype=torch.int64).reshape(weight.shape[0], num_replicas)


# ---------------------------------------------------------------------------
# Our improvement: swap local search under the equal-slot-count constraint
# ---------------------------------------------------------------------------

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
    pairs = np.array(list(itertools.combinations(range(K), 2)), dtype=np.int64).reshape(-1, 2)
    for _ in range(max_iters):
        a = int(loads.argmax())
        if not (_try_single_swap(items, idx, loads, a, tol) or
                (len(pairs) and _try_pair_swap(items, idx, loads, a, pairs, tol))):
            break
    return idx.reshape(-1)


def _apply_best(worst: np.ndarray, limit: float) -> tuple[int, ...] | None:
    flat = int(worst.argmin())
    if worst.flat[flat] < limit:
        return np.unravel_index(flat, worst.shape)
    return None


def _try_single_swap(items, idx, loads, a, tol) -> bool:
    d = items[a][:, None, None] - items[None, :, :]  # [K, B, K]: load moved from bin a to bin b
    worst = np.maximum(loads[a] - d, loads[None, :, None] + d)
    worst[:, a, :] = np.inf
    hit = _apply_best(worst, loads[a] - tol)
    if hit is None:
        return False
    i, b, j = (int(x) for x in hit)
    delta = d[i, b, j]
    items[a, i], items[b, j] = items[b, j], items[a, i]
    idx[a, i], idx[b, j] = idx[b, j], idx[a, i]
    loads[a] -= delta
    loads[b] += delta
    return True


def _try_pair_swap(items, idx, loads, a, pairs, tol) -> bool:
    pair_sum = items[:, pairs[:, 0]] + items[:, pairs[:, 1]]  # [B, C]
    d = pair_sum[a][:, None, None] - pair_sum[None, :, :]  # [C, B, C]
    worst = np.maximum(loads[a] - d, loads[None, :, None] + d)
    worst[:, a, :] = np.inf
    hit = _apply_best(worst, loads[a] - tol)
    if hit is None:
        return False
    p, b, q = (int(x) for x in hit)
    delta = d[p, b, q]
    for i, j in zip(pairs[p], pairs[q]):
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


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------

def gpu_loads(weight: Tensor, phy2log: Tensor, num_gpus: int) -> Tensor:
    """Load of every GPU under a plan.

    Args:
        weight: [L, E] load per logical expert; phy2log: [L, R].
    Returns:
        [L, P] float64: sum over the GPU's slots of load_e / count_e.
    """
    w = weight.double()
    L, E = w.shape
    ones = torch.ones_like(phy2log, dtype=torch.float64)
    logcnt = torch.zeros(L, E, dtype=torch.float64).scatter_add_(1, phy2log, ones)
    per_slot = torch.gather(w, 1, phy2log) / torch.gather(logcnt, 1, phy2log)  # [L, R]
    return per_slot.reshape(L, num_gpus, -1).sum(-1)


def max_over_mean(weight: Tensor, phy2log: Tensor, num_gpus: int) -> Tensor:
    """[L] float64: max GPU load over mean GPU load (1 = perfect); 1 for a layer with no load."""
    loads = gpu_loads(weight, phy2log, num_gpus)
    mean = loads.mean(-1)
    return torch.where(mean > 0, loads.max(-1).values / mean.clamp_min(1e-300), torch.ones_like(mean))


def _node_load_bound(group_load: list[float], num_nodes: int) -> float:
    """A lower bound on the max node load when every node hosts G/N whole groups.

    At least total / N; and for j = 0 .. G/N - 1, some node hosts j + 1 of the
    j*N + 1 heaviest groups (pigeonhole), so it carries at least the j + 1
    lightest of those plus the G/N - j - 1 lightest of the remaining groups.
    """
    g = sorted(group_load, reverse=True)
    k = len(g) // num_nodes
    best = sum(g) / num_nodes
    for j in range(k):
        top, rest = g[:j * num_nodes + 1], g[j * num_nodes + 1:]
        best = max(best, sum(top[-(j + 1):]) + sum(sorted(rest)[:k - j - 1]))
    return best


def lower_bound(weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                num_gpus: int) -> Tensor:
    """A lower bound on max_over_mean that no plan of this layout can beat.

    Args:
        weight: [L, E] load per logical expert.
    Returns:
        [L] float64, >= 1 (1 for a layer with no load).

    In units of the mean GPU load (total / P), the max GPU load is at least:
    - 1 (some GPU carries at least the mean);
    - the heaviest replica: min over replica counts (each >= 1, R in all) of
      max_e load_e / count_e, which greedy water-filling attains; this implies
      max_e load_e / (R - E + 1), since no expert can get more than R - E + 1;
    - hierarchical policy, per node: a node hosts G/N whole groups on R/N slots
      and P/N GPUs, so its heaviest GPU carries at least
      max(node load / (P/N), water-filled max replica load of its experts over
      R/N slots). When the splits of groups over nodes are few enough to
      enumerate (always for G <= 8), the bound is the minimum over splits of the
      max over nodes of that, which is exact at the node level. Otherwise it
      combines the pigeonhole bound on the max node load (`_node_load_bound`)
      divided by P/N and, per group, the water-filled replica load with the
      R/N - E/N + E/G slots a group can get at most (the other experts of its
      node need one slot each).
    """
    check_layout(weight.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    num_experts = weight.shape[1]
    groups, nodes = _effective_layout(num_experts, num_groups, num_nodes)
    size, slots, gpus = num_experts // groups, num_replicas // nodes, num_gpus // nodes
    enum = _partitions(groups, nodes) if nodes > 1 else None
    out = []
    for w in weight.double().tolist():  # host sync
        total = sum(w)
        if total <= 0:
            out.append(1.0)
            continue
        if enum is not None:
            parts, node_sets = enum
            _, bounds = _node_set_bounds(w, node_sets, size, slots, gpus)
            bound = float(bounds[parts].max(1).min())
        else:
            group_slots = slots - num_experts // nodes + size
            replica = max(_waterfill_max(w[g * size:(g + 1) * size], group_slots) for g in range(groups))
            bound = max(replica, _node_load_bound(_group_loads(w, groups), nodes) / gpus)
        out.append(max(1.0, bound / (total / num_gpus)))
    return torch.tensor(out, dtype=torch.float64)


# ---------------------------------------------------------------------------
# Applying a plan
# ---------------------------------------------------------------------------

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


def replica_candidates(phy2log: Tensor, rank: int, slots_per_rank: int, num_experts: int
                       ) -> tuple[Tensor, Tensor]:
    """Physical slots a copy routed to each expert may go to, for tokens on EP rank `rank`
    (slot p lives on rank p // slots_per_rank): the expert's replicas on `rank` if it has any,
    else all of its replicas.

    Args:
        phy2log: [R] logical expert of each physical slot.
    Returns:
        cand [E, W] (int64, -1 padded) and count [E] (int64, >= 1 when every expert has a slot).
    """
    rows = []
    for e in range(num_experts):
        slots = (phy2log == e).nonzero().view(-1).tolist()
        local = [p for p in slots if p // slots_per_rank == rank]
        rows.append(local or slots)
    width = max(1, max(len(r) for r in rows))
    cand = torch.full((num_experts, width), -1, dtype=torch.int64)
    for e, r in enumerate(rows):
        cand[e, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return cand, torch.tensor([len(r) for r in rows], dtype=torch.int64)


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
