"""The published EPLB greedy (DeepSeek's `eplb.py`) and the pieces ours shares with it: layout
checks, balanced packing, replica counts, the groups -> nodes -> GPUs skeleton. Pure."""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

import torch
from torch import Tensor


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
