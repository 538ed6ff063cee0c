"""The one mesh: every rank's coordinates and process groups, built once.

Rank order, innermost first, is Llama 3's [tp, cp, pp, dp]:
    rank = tp_i + tp * (cp_i + cp * (pp_i + pp * dp_i))
The expert view re-reads the dp x cp ranks of one pipeline stage (and one tp
index) as [ep, edp], ep innermost, which is DeepSpeed's default "E + D" order:
    j = cp_i + cp * dp_i,  ep_i = j % ep,  edp_i = j // ep
so an expert group is `ep` neighbouring data-parallel ranks, and an expert's
replicas (its expert-data-parallel group) are strided by ep.

The mesh is passed explicitly to whatever needs it; nothing reads a global.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from ..config import Layout


def coords(rank: int, layout: Layout) -> dict[str, int]:
    """Pure: a rank's coordinates in every view."""
    tp_i = rank % layout.tp
    cp_i = (rank // layout.tp) % layout.cp
    pp_i = (rank // (layout.tp * layout.cp)) % layout.pp
    dp_i = rank // (layout.tp * layout.cp * layout.pp)
    j = cp_i + layout.cp * dp_i
    return {"tp": tp_i, "cp": cp_i, "pp": pp_i, "dp": dp_i, "ep": j % layout.ep, "edp": j // layout.ep}


def rank_of(layout: Layout, tp: int = 0, cp: int = 0, pp: int = 0, dp: int = 0) -> int:
    return tp + layout.tp * (cp + layout.cp * (pp + layout.pp * dp))


def group_ranks(layout: Layout) -> dict[str, list[list[int]]]:
    """Pure: every group of every kind, as lists of global ranks.

    mp: same (dp, cp), varying (pp, tp): one full copy of the weights.
    dp: same (tp, cp, pp), varying dp.  dpcp: same (tp, pp), varying (dp, cp)
    (ZeRO and gradient reduction for dense parameters when cp > 1).  ep / edp:
    splits of each dpcp group.  tp, cp, pp: varying that one coordinate.
    """
    L = layout
    out: dict[str, list[list[int]]] = {k: [] for k in ("tp", "cp", "pp", "dp", "dpcp", "ep", "edp", "mp")}
    for dp_i in range(L.dp):
        for pp_i in range(L.pp):
            for cp_i in range(L.cp):
                out["tp"].append([rank_of(L, t, cp_i, pp_i, dp_i) for t in range(L.tp)])
            for t in range(L.tp):
                out["cp"].append([rank_of(L, t, c, pp_i, dp_i) for c in range(L.cp)])
        for t in range(L.tp):
            for cp_i in range(L.cp):
                out["pp"].append([rank_of(L, t, cp_i, p, dp_i) for p in range(L.pp)])
        for cp_i in range(L.cp):  # mp: the ranks that together hold one copy of the model
            out["mp"].append([rank_of(L, t, cp_i, p, dp_i) for p in range(L.pp) for t in range(L.tp)])
    for pp_i in range(L.pp):
        for t in range(L.tp):
            for cp_i in range(L.cp):
                out["dp"].append([rank_of(L, t, cp_i, pp_i, d) for d in range(L.dp)])
            dpcp = [rank_of(L, t, c, pp_i, d) for d in range(L.dp) for c in range(L.cp)]  # j order
            out["dpcp"].append(dpcp)
            for e in range(L.edp):
                out["ep"].append(dpcp[e * L.ep:(e + 1) * L.ep])
            for e in range(L.ep):
                out["edp"].append(dpcp[e::L.ep])
    return out


@dataclass
class Mesh:
    layout: Layout
    rank: int
    coord: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)  # kind -> this rank's ProcessGroup (None when size 1)
    members: dict = field(default_factory=dict)  # kind -> this rank's group's ranks

    @property
    def dp_rank(self) -> int:
        return self.coord["dp"]

    def size(self, kind: str) -> int:
        return len(self.members[kind])

    def index(self, kind: str) -> int:
        return self.members[kind].index(self.rank)

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
        """This rank's group of that kind, None when it has one member."""
        return self.groups[kind]

    def group_or_self(self, kind: str) -> dist.ProcessGroup:
        """Like group(), but a one-rank group instead of None (for DeepSpeed's registry)."""
        return self.groups[kind] or _single_group(self.rank)

    @property
    def is_last_stage(self) -> bool:
        return self.coord["pp"] == self.layout.pp - 1

    @property
    def is_first_stage(self) -> bool:
        return self.coord["pp"] == 0


def build_mesh(layout: Layout, rank: int, distributed: bool = True) -> Mesh:
    """Create every process group of more than one rank. NCCL's rule for new_group: every rank
    calls it for every group, members or not, in the same order with the same ranks; the lists
    and their order come from the layout alone, so they are the same on every rank. Groups of one
    rank are not created (a kind's groups all have the layout's degree for that kind)."""
    mesh = Mesh(layout, rank, coords(rank, layout))
    for kind, lists in group_ranks(layout).items():
        for ranks in lists:
            pg = dist.new_group(ranks) if distributed and len(ranks) > 1 else None
            if rank in ranks:
                mesh.members[kind] = ranks
                mesh.groups[kind] = pg
    return mesh


class DeepSpeedMPU:
    """The `mpu` interface DeepSpeed queries, answered from the mesh.

    DeepSpeed's "data parallel" group is where ZeRO shards and reduces dense
    gradients: dp x cp (context-parallel ranks hold the same weights). Its
    "model parallel" group is pp x tp: gradient norms are summed over it, and
    parameters not marked tensor_model_parallel are counted on tp rank 0 only.
    """

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def _group(self, kind):
        return self.mesh.group_or_self(kind)

    def get_data_parallel_group(self):
        return self._group("dpcp")

    def get_data_parallel_rank(self):
        return self.mesh.index("dpcp")

    def get_data_parallel_world_size(self):
        return self.mesh.size("dpcp")

    def get_data_parallel_group_ranks(self):
        return list(self.mesh.members["dpcp"])

    def get_model_parallel_group(self):
        return self._group("mp")

    def get_model_parallel_rank(self):
        return self.mesh.index("mp")

    def get_model_parallel_world_size(self):
        return self.mesh.size("mp")

    def get_tensor_model_parallel_group(self):
        return self._group("tp")

    def get_tensor_model_parallel_rank(self):
        return self.mesh.index("tp")

    def get_tensor_model_parallel_world_size(self):
        return self.mesh.size("tp")

    def get_tensor_model_parallel_src_rank(self):
        return self.mesh.members["tp"][0]

    def get_pipeline_model_parallel_rank(self):
        return self.mesh.coord["pp"]

    def get_pipeline_model_parallel_world_size(self):
        return self.mesh.layout.pp


_SINGLE: dict = {}


def _single_group(rank: int):
    """A one-rank group for DeepSpeed's APIs, which want a group object even when a degree is 1.
    Local synchronisation: only its member takes part in creating it (no other rank calls
    new_group for it, so ranks never disagree on the groups they create together); made once
    per process, whatever the number of degrees that are 1."""
    if rank not in _SINGLE:
        _SINGLE[rank] = dist.new_group([rank], use_local_synchronization=True)
    return _SINGLE[rank]
