"""Expert parallelism: each EP rank keeps n_routed_experts / ep experts (global
ids stay stable: expert e lives on EP rank e // n_local) and tokens travel to
them with all_to_all_single (uneven splits; gloo has no list form).

DeepSpeed only treats its own MoE classes as MoE; a parameter-free marker that
subclasses deepspeed.moe.layer.MoE makes the engine build MoE optimizer groups,
and the expert parameters carry `allreduce=False` / `group_name`, so ZeRO-1
reduces and shards them over the expert-data-parallel group only. DeepSpeed's
group registry is filled with the mesh's own groups, so both agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..moe.dispatcher import Dispatched, route_order
from ..moe.layer import MoE
from .comm import CommCounter, all_to_all_rows
from .mesh import Mesh


@dataclass
class _A2ACtx:
    token_of: torch.Tensor  # (R,) source token of each expert-sorted routed copy
    gate: torch.Tensor  # (R,) gate of each copy, applied at the source on combine
    in_splits: list[int]  # rows sent to each EP rank
    out_splits: list[int]  # rows received from each EP rank
    unsort: torch.Tensor  # received-order position of each expert-major row
    n_tokens: int


class AllToAllDispatcher:
    """Same interface as LocalDispatcher; experts receive rows grouped by local expert."""

    def __init__(self, n_experts: int, ep: int, group, capacity_factor: Optional[float] = None,
                 counter: Optional[CommCounter] = None):
        self.n_experts, self.ep, self.group = n_experts, ep, group
        self.n_local = n_experts // ep
        self.capacity_factor = capacity_factor
        self.counter = counter

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> Dispatched:
        n, k = topk_idx.shape
        # a capacity, if set, applies per source rank
        order, counts, dropped = route_order(topk_idx, self.n_experts, self.capacity_factor)
        token_of = order // k
        # 1. exchange per-expert counts: recv[s, e] = rows rank s sends to my local expert e
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        send_counts, recv = counts.view(self.ep, self.n_local), recv.view(self.ep, self.n_local)
        in_splits, out_splits = send_counts.sum(1).tolist(), recv.sum(1).tolist()  # host sync
        # 2. send token copies (rows are expert-sorted, so each rank's rows are contiguous)
        received = all_to_all_rows(x[token_of], out_splits, in_splits, self.group, self.counter, "dispatch")
        # 3. regroup received rows (source-major) into local-expert-major order
        local_expert = torch.repeat_interleave(torch.arange(self.n_local, device=x.device).repeat(self.ep),
                                               recv.reshape(-1))
        regroup = torch.argsort(local_expert, stable=True)
        gate = topk_weight.reshape(-1)[order]
        ctx = _A2ACtx(token_of, gate, in_splits, out_splits, torch.argsort(regroup), n)
        return Dispatched(received[regroup], None, recv.sum(0).tolist(), ctx, dropped)

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        c = d.ctx
        back = all_to_all_rows(y[c.unsort], c.in_splits, c.out_splits, self.group, self.counter, "combine")
        out = back.new_zeros(c.n_tokens, back.shape[-1])
        return out.index_add_(0, c.token_of, back * c.gate[:, None].to(back.dtype))


def _deepspeed_moe_marker(num_experts: int, ep_size: int, group_name: str, mesh: Mesh) -> nn.Module:
    """A parameter-free module DeepSpeed's engine recognises as MoE."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class ExpertParallelMarker(DeepSpeedMoE):
        def __init__(self):
            nn.Module.__init__(self)
            self.num_experts, self.ep_size, self.expert_group_name = num_experts, ep_size, group_name

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            register_deepspeed_groups(mesh, group_name)

        def forward(self, *args, **kwargs):  # never called: our MoE layers do the work
            raise RuntimeError("the DeepSpeed MoE marker has no forward")

    return ExpertParallelMarker()


def register_deepspeed_groups(mesh: Mesh, group_name: str) -> None:
    """Tell DeepSpeed's group registry the mesh's EP and expert-DP groups."""
    from deepspeed.utils import groups
    groups._EXPERT_PARALLEL_GROUP[group_name] = mesh.group("ep") or dist.new_group([mesh.rank])
    groups._EXPERT_DATA_PARALLEL_GROUP[group_name] = mesh.group("edp") or _self_group(mesh)
    groups._EXPERT_PARALLEL_GROUP_RANKS[group_name] = mesh.members["ep"]
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name] = mesh.members["edp"]


def _self_group(mesh: Mesh):
    return dist.new_group([mesh.rank])


def shard_experts(layer: MoE, ep_rank: int, ep: int) -> None:
    """Keep this rank's slice of the (identically initialised) stacked expert weights."""
    ex = layer.experts
    n_local = ex.n_local // ep
    lo = ep_rank * n_local
    with torch.no_grad():
        ex.gate_up_proj = nn.Parameter(ex.gate_up_proj[lo:lo + n_local].clone())
        ex.down_proj = nn.Parameter(ex.down_proj[lo:lo + n_local].clone())
    ex.n_local, ex.expert_offset = n_local, lo


def apply_expert_parallel(model: nn.Module, mesh: Mesh, counter: Optional[CommCounter] = None) -> nn.Module:
    ep = mesh.layout.ep
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    if ep == 1 or not moe:
        return model
    group_name = f"ep_size_{ep}"
    ep_rank = mesh.index("ep")
    for layer in moe:
        shard_experts(layer, ep_rank, ep)
        layer.dispatcher = AllToAllDispatcher(layer.n_experts, ep, mesh.group("ep"),
                                              layer.dispatcher.capacity_factor, counter)
        for p in layer.experts.parameters():
            p.allreduce = False  # deepspeed.moe.utils.is_moe_param
            p.group_name = group_name
            p.expert_shard = (ep_rank, ep)  # checkpoint.py gathers / slices along dim 0
    model.deepspeed_moe_marker = _deepspeed_moe_marker(moe[0].n_experts, ep, group_name, mesh)
    return model
