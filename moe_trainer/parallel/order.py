"""The rank order and every group derived from it: pure functions of a Layout (no torch).

The rank order is one string, innermost (fastest-varying) dimension first (config.rank_order):
    MoE    tp-cp-dp-pp   rank = tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i))   (Megatron-Core's tp-cp-ep-dp-pp)
    dense  tp-cp-pp-dp   rank = tp_i + tp * (cp_i + cp * (pp_i + pp * dp_i))   (Llama 3's)
Every group kind is derived from it (group_ranks), as Megatron's RankGenerator derives its groups
from one order; the mesh (parallel/mesh.py), the planner (plan/) and the dry run all call these.
The expert view re-reads the dp x cp ranks of one pipeline stage (and one tp index) as [ep, edp],
ep innermost, which is DeepSpeed's default "E + D" order:
    j = cp_i + cp * dp_i,  ep_i = j % ep,  edp_i = j // ep
so an expert group is `ep` neighbouring data-parallel ranks: with the MoE order, tp * ep
consecutive global ranks, inside one node whenever tp * ep divides the node size, and otherwise
the fewest whole nodes. An expert's replicas (its expert-data-parallel group) are strided by ep.
Routed experts sit on the EP ranks in order (rank e holds experts [e E/ep, (e+1) E/ep)), so the
experts of one routing group (model.n_group) share a node when the nodes of an EP group divide
n_group: topk_group then bounds the nodes a token's copies reach (DeepSeek-V3's M = 4).
"""
from __future__ import annotations

import itertools

from ..config import Layout

DIMS = ("tp", "cp", "pp", "dp")
# group kind -> the coordinates that vary inside one group (the others are fixed)
KINDS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp",),
         "dpcp": ("cp", "dp"),  # ZeRO and the dense gradient reduction: the ranks that replicate a weight
         "mp": ("tp", "pp")}    # one full copy of the model


def _dims(layout: Layout) -> list[str]:
    order = layout.order.split("-")
    if sorted(order) != sorted(DIMS) or order.index("cp") > order.index("dp"):
        raise ValueError(f"rank order {layout.order!r} must name each of {', '.join(DIMS)} once, cp inside dp")
    return order


def coords(rank: int, layout: Layout) -> dict[str, int]:
    """Pure: a rank's coordinates in every view."""
    c, r = {}, rank
    for dim in _dims(layout):
        size = getattr(layout, dim)
        c[dim], r = r % size, r // size
    j = c["cp"] + layout.cp * c["dp"]
    return {**c, "ep": j % layout.ep, "edp": j // layout.ep}


def rank_of(layout: Layout, tp: int = 0, cp: int = 0, pp: int = 0, dp: int = 0) -> int:
    """Pure: the inverse of coords."""
    c, rank, stride = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}, 0, 1
    for dim in _dims(layout):
        rank += c[dim] * stride
        stride *= getattr(layout, dim)
    return rank


def _groups_varying(layout: Layout, varying: tuple[str, ...]) -> list[list[int]]:
    """Every group whose members differ only in `varying`: the fixed coordinates enumerated in rank
    order, the members in rank order (innermost varying fastest), so every list is sorted, as
    torch's new_group stores it, and a member's index in it is its group rank."""
    order = _dims(layout)
    inner = [d for d in order if d in varying]
    outer = [d for d in order if d not in varying]
    out = []
    for fixed in itertools.product(*(range(getattr(layout, d)) for d in reversed(outer))):
        base = dict(zip(reversed(outer), fixed))
        members = []
        for moving in itertools.product(*(range(getattr(layout, d)) for d in reversed(inner))):
            members.append(rank_of(layout, **base, **dict(zip(reversed(inner), moving))))
        out.append(members)
    return out


def group_ranks(layout: Layout) -> dict[str, list[list[int]]]:
    """Pure: every group of every kind, as lists of global ranks.

    tp, cp, pp, dp: varying that one coordinate. dpcp: same (tp, pp), varying (dp, cp) in j order.
    mp: same (dp, cp), varying (pp, tp). ep / edp: splits of each dpcp group, ep neighbouring j
    indices and their stride-ep replicas.
    """
    out = {kind: _groups_varying(layout, varying) for kind, varying in KINDS.items()}
    out["ep"], out["edp"] = [], []
    for dpcp in out["dpcp"]:  # j order: cp fastest, then dp (both orders put cp inside dp)
        out["ep"] += [dpcp[e * layout.ep:(e + 1) * layout.ep] for e in range(layout.edp)]
        out["edp"] += [dpcp[e::layout.ep] for e in range(layout.ep)]
    return out


def node_of(rank: int, layout: Layout) -> int:
    return rank // layout.node_size


def nodes_spanned(layout: Layout) -> dict[str, int]:
    """Pure: the most nodes any one group of each kind spans."""
    return {kind: max(len({node_of(r, layout) for r in ranks}) for ranks in lists)
            for kind, lists in group_ranks(layout).items()}


def fewest_nodes(size: int, layout: Layout) -> int:
    """The fewest nodes a group of `size` ranks could sit on."""
    return -(-size // layout.node_size)


def layout_warnings(layout: Layout) -> list[str]:
    """A sentence for each TP or EP group kind that spans more nodes than its size needs."""
    spans, out = nodes_spanned(layout), []
    for kind, size in (("tp", layout.tp), ("ep", layout.ep)):
        if spans[kind] > fewest_nodes(size, layout):
            out.append(f"warning: {kind} groups of {size} ranks span up to {spans[kind]} nodes of "
                       f"{layout.node_size} although {fewest_nodes(size, layout)} would hold them; choose "
                       f"parallel.{kind} (times parallel.tp for ep) dividing the node size")
    return out


def expert_group_nodes(layout: Layout, n_routed_experts: int, n_group: int) -> int:
    """Pure: the most nodes the experts of one routing group (model.n_group) sit on, with experts in
    order on the ranks of an EP group (rank e of it holds experts [e E/ep, (e+1) E/ep))."""
    ep_ranks = group_ranks(layout)["ep"][0]
    per_rank = n_routed_experts // layout.ep
    per_group = n_routed_experts // max(1, n_group)
    return max(len({node_of(ep_ranks[x // per_rank], layout) for x in range(g * per_group, (g + 1) * per_group)})
               for g in range(max(1, n_group)))


def describe_nodes(layout: Layout, n_routed_experts: int = 0, n_group: int = 1, topk_group: int = 1) -> list[str]:
    """The banner's lines on nodes: how many each kind of group spans, and the warnings."""
    spans = nodes_spanned(layout)
    nodes = -(-layout.world // layout.node_size)
    sizes = {k: len(lists[0]) for k, lists in group_ranks(layout).items()}
    label = {"dpcp": "dp x cp" if layout.cp > 1 else "dp"}
    kinds = ", ".join(f"{label.get(k, k)} {spans[k]}" for k in ("tp", "cp", "ep", "edp", "dpcp", "pp")
                      if sizes[k] > 1) or "none (one rank)"
    lines = [f"nodes: {nodes} of {layout.node_size} rank(s), order {layout.order} (innermost first); "
             f"nodes spanned per group: {kinds}"]
    if n_routed_experts and layout.ep > 1 and n_group > 1:
        per = expert_group_nodes(layout, n_routed_experts, n_group)
        lines.append(f"experts: each of the {n_group} routing groups on {per} node(s) of its EP group, so a token "
                     f"reaches at most {min(spans['ep'], topk_group * per)} node(s) (topk_group {topk_group})")
    return lines + layout_warnings(layout)
