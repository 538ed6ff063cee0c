"""The one mesh: every rank's coordinates and process groups, built once.

The rank order and the groups come from parallel/order.py (pure, shared with the planner and the
dry run); this module creates the process groups and answers DeepSpeed's `mpu` queries.
The mesh is passed explicitly to whatever needs it; nothing reads a global.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..config import Layout
from .order import coords, group_ranks


@dataclass
class Mesh:
    layout: Layout
    rank: int
    coord: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)  # kind -> this rank's ProcessGroup (None when size 1)
    members: dict = field(default_factory=dict)  # kind -> this rank's group's ranks
    single: Optional[dist.ProcessGroup] = None  # this rank alone (made by build_mesh, with every rank)

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
        pg = self.groups[kind] or self.single
        if pg is None:
            raise RuntimeError(f"no process group for {kind}: the mesh was built without distributed groups")
        return pg

    @property
    def is_last_stage(self) -> bool:
        return self.coord["pp"] == self.layout.pp - 1

    @property
    def is_first_stage(self) -> bool:
        return self.coord["pp"] == 0


def build_mesh(layout: Layout, rank: int, distributed: bool = True, timeout_s: Optional[float] = None) -> Mesh:
    """Create the process groups, collectively on every rank.

    NCCL's rule for group creation: every rank of the world enters every creation, members or not,
    in the same order with the same ranks (with a device bound, each one is a communicator split of
    the world). The lists and their order come from the layout alone, so they are the same on every
    rank, and every rank makes every call here, whatever its stage holds. Each distinct rank set gets
    one communicator: kinds with the same groups share it (dp and dpcp when cp is 1, ep and dpcp
    when edp is 1, mp and pp when tp is 1). Kinds of degree 1 have no group (None); the one-rank
    groups DeepSpeed's registries want instead (group_or_self) are made here too, by every rank.
    `timeout_s` (parallel.timeout_s) bounds every collective on them: torch gives a new group its
    backend's default (30 minutes on gloo), not the world's."""
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    mesh = Mesh(layout, rank, coords(rank, layout))
    made: dict = {}  # tuple of the kind's group lists -> this rank's group of them
    for kind, lists in group_ranks(layout).items():
        mine = next(ranks for ranks in lists if rank in ranks)
        mesh.members[kind] = mine
        if len(mine) == 1:
            mesh.groups[kind] = None
            continue
        key = tuple(sorted(map(tuple, lists)))  # the same partition, whatever order a kind lists it in
        if key not in made:
            made[key] = _partition(lists, rank, timeout) if distributed else None
        mesh.groups[kind] = made[key]
    if distributed and any(len(m) == 1 for m in mesh.members.values()):
        mesh.single = _partition([[r] for r in range(layout.world)], rank, timeout)
    return mesh


def _partition(lists: list[list[int]], rank: int, timeout: Optional[timedelta] = None):
    """This rank's group of a partition of the world, every rank of the world taking part. On a
    backend that splits communicators (NCCL with a bound device) one split makes every group of
    the partition; elsewhere one new_group per list, every rank calling each in the same order."""
    world = dist.group.WORLD
    backend = world._get_backend(world.bound_device_id) if getattr(world, "bound_device_id", None) else None
    if backend is not None and getattr(backend, "supports_splitting", False):
        return dist.split_group(split_ranks=lists, timeout=timeout)
    mine = None
    for ranks in lists:
        pg = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = pg
    return mine


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

    def get_pipeline_model_parallel_group(self):
        # BF16_Optimizer sums expert gradient norms over the pipeline stages (experts are not tp-sharded)
        return self._group("pp")
