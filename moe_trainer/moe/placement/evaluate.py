"""How good a placement is: per-GPU loads, max over mean, and the lower bound no plan can beat."""
from __future__ import annotations

import torch
from torch import Tensor

from .eplb import _effective_layout, _group_loads, _waterfill_max, check_layout
from .search import _node_set_bounds, _partitions



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
