"""Where a plan's traffic goes: bytes inside a node and across nodes, and the time at given link speeds.

Pure: the rank order (parallel/order.py, the same function the mesh and the dry run use) places
every group on nodes; a StageComm's bytes per kind are split by the links they cross.

The model (stated in the report): ring collectives (data parallel, ZeRO, tensor and context
parallel) over a group on one node run at NVLink speed; over a group spanning n nodes, n of the
ring's g edges cross nodes (so n / g of a rank's bytes go over the network on average) and the
ring runs at the network's speed per GPU (one NIC per GPU, as on rail-optimised H100/H800
clusters). The all-to-all sends each remote copy to its destination: the share of the other
members of the EP group that sit on other nodes crosses the network, and the NVLink and network
parts run concurrently (the slower sets the time). Pipeline transfers go to the neighbouring
stages' ranks, each on its node or not.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import Layout
from ..parallel.order import group_ranks, node_of, rank_of

# per GPU, per direction, in gigabits per second: NVLink 4 on an H100 is 450 GB/s each way (the
# H800's is 200 GB/s; DeepSeek-V3 measured ~160 GB/s usable), and one 400 Gb/s NDR InfiniBand NIC
# per GPU (50 GB/s)
NVLINK_GBPS = 3600.0
IB_GBPS = 400.0

RING_KINDS = {"dense_dp": "dpcp", "expert_dp": "edp", "tensor": "tp", "context": "cp"}


@dataclass(frozen=True)
class Links:
    nvlink_gbps: float = NVLINK_GBPS
    ib_gbps: float = IB_GBPS

    def seconds(self, intra: float, inter: float, ring_across: bool) -> float:
        nv, ib = self.nvlink_gbps * 1e9 / 8, self.ib_gbps * 1e9 / 8  # bytes per second
        if ring_across:  # the ring waits on its network edges: all its bytes at the network's pace
            return (intra + inter) / ib
        return max(intra / nv, inter / ib)


@dataclass(frozen=True)
class NodeTraffic:
    """One kind of traffic of one rank per step, split by link."""

    intra_node: float  # bytes sent to ranks of the same node
    inter_node: float  # bytes sent to ranks of other nodes
    nodes: int  # nodes the rank's group of this kind spans
    seconds: float  # at the plan's link speeds


def _group_of(groups: dict, kind: str, rank: int) -> list[int]:
    return next(g for g in groups[kind] if rank in g)


def _ring(total: float, group: list[int], layout: Layout, links: Links) -> NodeTraffic:
    nodes = len({node_of(r, layout) for r in group})
    inter = total * nodes / len(group) if nodes > 1 else 0.0
    return NodeTraffic(total - inter, inter, nodes, links.seconds(total - inter, inter, nodes > 1))


def _spread(total: float, rank: int, peers: list[int], layout: Layout, links: Links, nodes: int) -> NodeTraffic:
    """`total` spread evenly over `peers` (the all-to-all's other members, a stage's neighbours)."""
    if not peers or not total:
        return NodeTraffic(0.0, 0.0, nodes, 0.0)
    remote = sum(node_of(q, layout) != node_of(rank, layout) for q in peers) / len(peers)
    inter = total * remote
    return NodeTraffic(total - inter, inter, nodes, links.seconds(total - inter, inter, False))


def stage_node_traffic(layout: Layout, stage: int, comm, links: Links, groups=None) -> dict[str, NodeTraffic]:
    """Per kind of a StageComm, for the first rank of `stage` (tp = cp = dp = 0): the layout's
    groups are the same shape on every rank of a stage. `groups`: group_ranks(layout), if at hand."""
    groups = groups or group_ranks(layout)
    rank = rank_of(layout, pp=stage)
    out = {name: _ring(getattr(comm, name).total if name.endswith("_dp") else getattr(comm, name),
                       _group_of(groups, kind, rank), layout, links)
           for name, kind in RING_KINDS.items()}
    ep = _group_of(groups, "ep", rank)
    out["all_to_all"] = _spread(comm.all_to_all, rank, [q for q in ep if q != rank], layout, links,
                                len({node_of(q, layout) for q in ep}))
    pp = _group_of(groups, "pp", rank)
    i = pp.index(rank)
    neighbours = [pp[j] for j in (i - 1, i + 1) if 0 <= j < len(pp)]
    out["pipeline"] = _spread(comm.pipeline, rank, neighbours, layout, links, len({node_of(q, layout) for q in pp}))
    return out
