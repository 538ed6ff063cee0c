"""Expert parallelism: each EP rank keeps n_routed_experts / ep experts (global
ids stay stable: expert e lives on EP rank e // n_local) and tokens travel to
them with all_to_all_single (uneven splits; gloo has no list form).

DeepSpeed only treats its own MoE classes as MoE; a parameter-free marker that
subclasses deepspeed.moe.layer.MoE makes the engine build MoE optimizer groups,
and the expert parameters carry `allreduce=False` / `group_name`, so ZeRO-1
reduces and shards them over the expert-data-parallel group only. DeepSpeed's
group registry is filled with the mesh's own groups, so both agree.

With `dedup=True` (DeepSeek-V3's per-node dedup) a token's hidden state crosses
to an EP rank once however many of its top-k experts live there; a small
metadata row (the token's local expert slots and gates, fp32) travels with it.
The receiver expands it to its local experts, applies the gates, sums the
token's outputs and sends one row back. Rows that leave the rank are counted
as "dispatch"/"combine" (what plan.alltoall_bytes_exact predicts, dedup=True);
the metadata as "dispatch_meta".
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..moe.dispatcher import Dispatched, route_order
from ..moe.layer import MoE
from .comm import CommCounter, _exchange, all_to_all_rows
from .mesh import Mesh


@dataclass
class _A2ACtx:
    token_of: torch.Tensor  # (R,) source token of each expert-sorted routed copy
    gate: torch.Tensor  # (R,) gate of each copy, applied at the source on combine
    in_splits: list[int]  # rows sent to each EP rank
    out_splits: list[int]  # rows received from each EP rank
    unsort: torch.Tensor  # received-order position of each expert-major row
    n_tokens: int


class _AllToAllPair(torch.autograd.Function):
    """Rows and their metadata through two all-to-alls with the same splits, as ONE autograd node,
    so every rank runs the two backward all-to-alls in the same order (two separate nodes could
    become ready in a data-dependent order on different ranks and mismatch gloo's collectives)."""

    @staticmethod
    def forward(ctx, rows, meta, out_splits, in_splits, group, counter):
        ctx.splits, ctx.group, ctx.counter = (out_splits, in_splits), group, counter
        return (_exchange(rows, out_splits, in_splits, group, counter, "dispatch"),
                _exchange(meta, out_splits, in_splits, group, counter, "dispatch_meta"))

    @staticmethod
    def backward(ctx, grad_rows, grad_meta):
        out_splits, in_splits = ctx.splits
        return (_exchange(grad_rows, in_splits, out_splits, ctx.group, ctx.counter, "dispatch_grad"),
                _exchange(grad_meta, in_splits, out_splits, ctx.group, ctx.counter, "dispatch_meta_grad"),
                None, None, None, None)


@dataclass
class _DedupCtx:
    tokens: torch.Tensor  # (S,) source token of each sent row, grouped by destination rank
    pair_row: torch.Tensor  # (M,) received row of each expanded (row, local expert) pair, expert-sorted
    in_splits: list[int]
    out_splits: list[int]
    n_received: int
    n_tokens: int


class AllToAllDispatcher:
    """Same interface as LocalDispatcher; experts receive rows grouped by local expert."""

    def __init__(self, n_experts: int, ep: int, group, capacity_factor: Optional[float] = None,
                 counter: Optional[CommCounter] = None, dedup: bool = False):
        self.n_experts, self.ep, self.group = n_experts, ep, group
        self.n_local = n_experts // ep
        self.capacity_factor = capacity_factor
        self.counter = counter
        self.dedup = dedup

    def _time(self, kind: str, t0: float) -> None:
        if self.counter is not None:
            self.counter.add_time(kind, time.perf_counter() - t0)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> Dispatched:
        if self.dedup:
            return self._dispatch_dedup(x, topk_idx, topk_weight)
        n, k = topk_idx.shape
        # a capacity, if set, applies per source rank
        order, counts, dropped = route_order(topk_idx, self.n_experts, self.capacity_factor)
        token_of = order // k
        # 1. exchange per-expert counts: recv[s, e] = rows rank s sends to my local expert e
        recv = torch.empty_like(counts)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, counts, group=self.group)
        send_counts, recv = counts.view(self.ep, self.n_local), recv.view(self.ep, self.n_local)
        in_splits, out_splits = send_counts.sum(1).tolist(), recv.sum(1).tolist()  # host sync
        self._time("dispatch_counts", t0)
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
        if isinstance(c, _DedupCtx):
            # y is gated already: sum each received row's local-expert outputs, send one row back
            rows = y.new_zeros(c.n_received, y.shape[-1]).index_add_(0, c.pair_row, y)
            back = all_to_all_rows(rows, c.in_splits, c.out_splits, self.group, self.counter, "combine")
            out = back.new_zeros(c.n_tokens, back.shape[-1])
            return out.index_add_(0, c.tokens, back)
        back = all_to_all_rows(y[c.unsort], c.in_splits, c.out_splits, self.group, self.counter, "combine")
        out = back.new_zeros(c.n_tokens, back.shape[-1])
        return out.index_add_(0, c.token_of, back * c.gate[:, None].to(back.dtype))

    def _dispatch_dedup(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> Dispatched:
        n, k = topk_idx.shape
        ep, n_local = self.ep, self.n_local
        idx = topk_idx
        dropped = 0
        if self.capacity_factor is not None:  # a capacity, if set, applies per source rank, to copies
            order, _, dropped = route_order(topk_idx, self.n_experts, self.capacity_factor)
            kept = torch.zeros(n * k, dtype=torch.bool, device=x.device)
            kept[order] = True
            idx = torch.where(kept.view(n, k), topk_idx, torch.full_like(topk_idx, -1))
        dest = torch.where(idx >= 0, idx // n_local, torch.full_like(idx, ep))  # ep: dropped copy
        # hit[t, r]: token t goes to EP rank r (once, whatever the number of its experts there)
        hit = torch.zeros(n, ep + 1, dtype=torch.bool, device=x.device)
        hit.scatter_(1, dest, True)
        hit = hit[:, :ep]
        dst_of, tokens = hit.t().nonzero(as_tuple=True)  # grouped by destination rank, token order within
        send_counts = hit.sum(0)
        # metadata per sent row: the token's k slots as (gate, local expert id or -1 when elsewhere)
        here = dest[tokens] == dst_of[:, None]  # (S, k)
        local_id = torch.where(here, idx[tokens] - dst_of[:, None] * n_local, torch.full_like(idx[tokens], -1))
        gate = topk_weight[tokens] * here.to(topk_weight.dtype)
        meta = torch.cat([gate.float(), local_id.float()], 1)  # ids < 2**24 are exact in fp32
        recv_counts = torch.empty_like(send_counts)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()  # host sync
        self._time("dispatch_counts", t0)
        received, rmeta = _AllToAllPair.apply(x[tokens], meta, out_splits, in_splits, self.group, self.counter)
        # expand: one (received row, local expert) pair per slot that names a local expert, expert-major
        r_gate, r_id = rmeta[:, :k], rmeta[:, k:].detach().long()
        pair_row, slot = (r_id >= 0).nonzero(as_tuple=True)
        pair_expert = r_id[pair_row, slot]
        sort = torch.argsort(pair_expert, stable=True)
        pair_row, slot, pair_expert = pair_row[sort], slot[sort], pair_expert[sort]
        counts = torch.bincount(pair_expert, minlength=n_local).tolist()  # host sync
        ctx = _DedupCtx(tokens, pair_row, in_splits, out_splits, received.shape[0], n)
        return Dispatched(received[pair_row], r_gate[pair_row, slot], counts, ctx, dropped)


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


def apply_expert_parallel(model: nn.Module, mesh: Mesh, counter: Optional[CommCounter] = None,
                          dedup: bool = False) -> nn.Module:
    ep = mesh.layout.ep
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    if ep == 1 or not moe:
        return model
    group_name = f"ep_size_{ep}"
    ep_rank = mesh.index("ep")
    for layer in moe:
        shard_experts(layer, ep_rank, ep)
        layer.dispatcher = AllToAllDispatcher(layer.n_experts, ep, mesh.group("ep"),
                                              layer.dispatcher.capacity_factor, counter, dedup)
        for p in layer.experts.parameters():
            p.allreduce = False  # deepspeed.moe.utils.is_moe_param
            p.group_name = group_name
            p.expert_shard = (ep_rank, ep)  # checkpoint.py gathers / slices along dim 0
    model.deepspeed_moe_marker = _deepspeed_moe_marker(moe[0].n_experts, ep, group_name, mesh)
    return model
