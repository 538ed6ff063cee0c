"""Autograd-aware collectives, with byte accounting.

Backward of an all-to-all is the all-to-all with the splits swapped.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from ..kernels.cpu.shm_alltoall import RING_BYTES, ShmAllToAll
from ..metrics import StepClock
from . import link


# the kinds an expert-parallel MoE layer counts inside a torch.compile graph (parallel/expert.py)
GRAPH_KINDS = tuple(k + grad for k in ("all_to_all", "dispatch", "dispatch_meta", "expert_weights", "combine")
                    for grad in ("", "_grad"))


class CommCounter:
    """Bytes this rank sent and received per kind of collective since reset(), and the seconds
    spent in them (`seconds`, per kind, including the wait for the slowest peer). Times are spans
    of StepClock marks (CUDA events on a GPU, where a collective does not block the host; the
    host clock elsewhere), read by reset() after the step's host sync.

    Inside a torch.compile graph the bytes go into `in_graph` (one row of sent, received and calls per
    GRAPH_KINDS entry, on the layers' `device`) by in-place adds the graph performs: Python ints
    updated there would be guards on their values, and each new total a recompile. On the layers'
    device, not the host, so the adds are device kernels of the graph (a host tensor in a CUDA graph
    would keep inductor from capturing it with CUDA graphs); reset() reads it, after the step's sync."""

    def __init__(self, clock: Optional[StepClock] = None, device: Optional[torch.device] = None):
        self.clock = clock or StepClock()
        self.sent: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.spans: list = []  # (kind, start mark, end mark)
        self.in_graph = torch.zeros(len(GRAPH_KINDS), 3, dtype=torch.int64, device=device)
        self.graph_counted = False  # set by compiled graphs (a stored attribute: no guard on it)

    def mark(self):
        return self.clock.mark()

    def add_span(self, kind: str, start, end=None) -> None:
        """A span from mark `start` to `end` (now when omitted)."""
        self.spans.append((kind, start, self.clock.mark() if end is None else end))

    def add(self, kind: str, sent: int, received: int) -> None:
        if torch.compiler.is_compiling():  # sent, received: symbolic sizes of this call's splits
            if kind not in GRAPH_KINDS:
                raise ValueError(f"CommCounter: kind {kind!r} counted inside a compiled graph is not one of "
                                 f"GRAPH_KINDS {GRAPH_KINDS}")
            row = self.in_graph[GRAPH_KINDS.index(kind)]
            row[0].add_(sent)
            row[1].add_(received)
            row[2].add_(1)
            self.graph_counted = True
            return
        self.sent[kind] += sent
        self.received[kind] += received

    def reset(self, clock: Optional[StepClock] = None) -> dict:
        """What was counted since the last reset. The spans' marks are read with `clock` (default:
        the counter's own), so they must be complete: call it after a host sync."""
        clock = clock or self.clock
        for kind, start, end in self.spans:
            self.seconds[kind] += clock.seconds(start, end)
        self.spans.clear()
        if self.graph_counted:
            # host sync: one copy of (kinds, 3) ints per step, after the step's own sync (reduce_losses)
            for kind, (sent, received, calls) in zip(GRAPH_KINDS, self.in_graph.tolist()):
                if calls:
                    self.sent[kind] += sent
                    self.received[kind] += received
            self.in_graph.zero_()
            self.graph_counted = False
        out = {"sent": dict(self.sent), "received": dict(self.received), "seconds": dict(self.seconds)}
        self.sent.clear()
        self.received.clear()
        self.seconds.clear()
        return out


# process group (None = the world) -> ShmAllToAll: all-to-alls and small all-reduces between CPU
# ranks of one host (shm_alltoall.py)
_SHM_TRANSPORTS: dict = {}


def use_shm_transport(group, transport) -> None:
    """Route this group's all_to_all_single / all_reduce_small calls through `transport`
    (None: back to the process group's backend)."""
    if transport is None:
        _SHM_TRANSPORTS.pop(group, None)
    else:
        _SHM_TRANSPORTS[group] = transport


def shm_transport(group) -> Optional[ShmAllToAll]:
    """The group's shared-memory transport, None if its calls go to the process group."""
    return _SHM_TRANSPORTS.get(group) if group is not None else None


def enable_shm_transport(group, ring_bytes: int = RING_BYTES, timeout_s: float = 300.0) -> bool:
    """Collective over `group` (None = the world): on a gloo group whose ranks can all use shared
    memory, route its calls through it. True if they now do."""
    pg = group if group is not None else dist.group.WORLD
    if dist.get_backend(pg) != "gloo":
        return False
    transport = ShmAllToAll.create(pg, ring_bytes=ring_bytes, timeout_s=timeout_s)
    use_shm_transport(group, transport)
    return transport is not None


def all_reduce_small(t: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """dist.all_reduce (op "sum" or "max") of a small tensor, through the group's shared-memory
    transport when it has one."""
    transport = _SHM_TRANSPORTS.get(group)
    if transport is not None and t.device.type == "cpu":
        return transport.all_reduce_(t, op)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


# ----------------------------------------------------------------------------- DeepSpeed's collectives
# ZeRO's gradient reductions, its gradient-norm and overflow all-reduces and its parameter
# all-gathers go through deepspeed.comm, whose torch backend calls gloo on CPU ranks: over loopback
# TCP each costs milliseconds between busy ranks however small (a rank of world 4 on 2 cores spent
# 13-19 ms per step in the one-scalar norm all-reduce and 29-35 ms reducing 6 MB of gradients).
# route_deepspeed_collectives() sends those calls through the group's shared-memory transport.

class _Completed:
    """The work handle of an async_op call that already finished (the rings are synchronous)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_OPS = {"SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min"}
_REDUCIBLE = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)


def _op_name(op) -> Optional[str]:
    """"sum" / "avg" / "max" / "min" for DeepSpeed's or torch's ReduceOp, None for any other."""
    name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
    return _OPS.get(str(name).upper())


def _routable(group, *tensors: torch.Tensor):
    """The shared-memory transport for a call on `group` with these tensors, or None."""
    transport = _SHM_TRANSPORTS.get(group)
    if transport is None or any(t.device.type != "cpu" or t.dtype not in _REDUCIBLE for t in tensors):
        return None
    return transport


def route_deepspeed_collectives() -> bool:
    """deepspeed.comm's all_reduce, reduce, all_gather_into_tensor and reduce_scatter_tensor of CPU
    tensors on a group that has a shared-memory transport (enable_shm_transport) go through it;
    every other call goes to DeepSpeed's backend unchanged. Call after deepspeed.init_distributed;
    idempotent. True if the routing is in place."""
    from deepspeed.comm import comm as ds_comm
    backend = ds_comm.cdb
    if backend is None:
        return False
    if getattr(backend, "_moe_trainer_shm", False):
        return True
    base = {name: getattr(backend, name) for name in
            ("all_reduce", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")}

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        transport, name = _routable(group, tensor), _op_name(op)
        if transport is None or name is None:
            return base["all_reduce"](tensor, op, group, async_op)
        transport.all_reduce_(tensor, name)
        return _Completed() if async_op else None

    def reduce(tensor, dst, op=dist.ReduceOp.SUM, group=None, async_op=False):
        transport, name = _routable(group, tensor), _op_name(op)
        if transport is None or name is None:
            return base["reduce"](tensor=tensor, dst=dst, op=op, group=group, async_op=async_op)
        transport.reduce_(tensor, dst if group is None else dist.get_group_rank(group, dst), name)
        return _Completed() if async_op else None

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        transport = _routable(group, output_tensor, input_tensor)
        if transport is None or not output_tensor.is_contiguous():
            return base["all_gather_into_tensor"](output_tensor=output_tensor, input_tensor=input_tensor,
                                                  group=group, async_op=async_op)
        transport.all_gather_into_(output_tensor, input_tensor)
        return _Completed() if async_op else None

    def reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        transport, name = _routable(group, output_tensor, input_tensor), _op_name(op)
        if transport is None or name is None:
            return base["reduce_scatter_tensor"](output_tensor=output_tensor, input_tensor=input_tensor, op=op,
                                                 group=group, async_op=async_op)
        transport.reduce_scatter_(output_tensor, input_tensor, name)
        return _Completed() if async_op else None

    for fn in (all_reduce, reduce, all_gather_into_tensor, reduce_scatter_tensor):
        setattr(backend, fn.__name__, fn)
    backend._moe_trainer_shm = True
    return True


# ----------------------------------------------------------------------------- all-to-all under torch.compile
# While dynamo traces a region (train.compile), the expert-parallel all-to-alls go through torch's
# functional collectives, which dynamo and inductor put in the graph (the c10d ops they stand for
# run on the group's own backend: NCCL on GPUs, gloo here; the shared-memory transport is not
# traced). With dynamo's capture_scalar_outputs (compile.py sets it), the split sizes read with
# .tolist() are unbacked symbolic ints, so a MoE layer at ep > 1 stays one graph: no break at the
# split-size exchange. Byte counts are still added (dynamo replays the counter's updates after
# the graph has run); no host clock can be read inside a graph, so the all-to-alls' seconds are
# not measured per kind under compile, and the backward's bytes are counted when the forward runs
# (functional collectives carry their own backward: the all-to-all with the splits swapped).

def traced() -> bool:
    """True while torch.compile traces the calling code."""
    return torch.compiler.is_compiling()


def _functional_group(group):
    return group if group is not None else dist.group.WORLD


def _count_rows(counter: Optional[CommCounter], kind: str, x: torch.Tensor, out_splits, in_splits,
                group, backward_too: bool = False) -> None:
    """Bytes of the rows that leave and reach this rank (its own share stays); with backward_too,
    also kind + "_grad", the backward's all-to-all with the splits swapped."""
    if counter is None:
        return
    me = dist.get_rank(group)
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row; x may have 0 rows
    sent, received = (sum(in_splits) - in_splits[me]) * row, (sum(out_splits) - out_splits[me]) * row
    counter.add(kind, sent, received)
    if backward_too:
        counter.add(kind + "_grad", received, sent)


def offrank_bytes(x: torch.Tensor, out_splits, in_splits, group) -> int:
    """The larger of the bytes of rows x sends to and receives from other ranks (the emulated link's
    load, link.py)."""
    me = dist.get_rank(group)
    row = math.prod(x.shape[1:]) * x.element_size()
    return max(sum(in_splits) - in_splits[me], sum(out_splits) - out_splits[me]) * row


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, out_splits: Optional[list[int]] = None,
                      in_splits: Optional[list[int]] = None, group=None) -> None:
    """dist.all_to_all_single, through the group's shared-memory transport when it has one (a
    functional collective while torch.compile traces)."""
    if traced():
        out.copy_(fc.all_to_all_single(x.contiguous(), out_splits, in_splits, _functional_group(group)))
        return
    transport = _SHM_TRANSPORTS.get(group)
    if transport is not None:
        transport.all_to_all_single(out, x, out_splits, in_splits)
    else:
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                    counter: Optional[CommCounter] = None, kind: str = "all_to_all") -> torch.Tensor:
    """Rows [sum(in_splits), ...] -> rows [sum(out_splits), ...]; differentiable."""
    if traced():
        return traced_all_to_all_rows(x, out_splits, in_splits, group, counter, kind)
    return _AllToAll.apply(x, out_splits, in_splits, group, counter, kind)


def traced_all_to_all_rows(x: torch.Tensor, out_splits, in_splits, group, counter: Optional[CommCounter],
                           kind: str) -> torch.Tensor:
    """all_to_all_rows while torch.compile traces: the differentiable functional collective."""
    _count_rows(counter, kind, x, out_splits, in_splits, group, backward_too=x.requires_grad)
    return fc.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, _functional_group(group))


def _exchange(x, out_splits, in_splits, group, counter, kind):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    start = counter.mark() if counter is not None else None
    issued = link.now() if link.enabled() else 0.0
    all_to_all_single(out, x, out_splits, in_splits, group)
    if link.enabled():  # the emulated link (benchmarks, tests): no earlier than its transfer time
        link.hold(link.deadline(issued, offrank_bytes(x, out_splits, in_splits, group)))
    if counter is not None:
        counter.add_span(kind, start)
        _count_rows(counter, kind, x, out_splits, in_splits, group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, counter, kind):
        ctx.splits, ctx.group, ctx.counter, ctx.kind = (out_splits, in_splits), group, counter, kind
        return _exchange(x, out_splits, in_splits, group, counter, kind)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.counter, ctx.kind + "_grad"), \
            None, None, None, None, None


# ----------------------------------------------------------------------------- tensor / context parallel regions
# Bytes are counted as the ring algorithms move them (nccl-tests' bus bytes), so
# that all-reduce = reduce-scatter + all-gather holds for the counts too. Over a
# group of g ranks:
#   all-gather of an S-byte shard:          sent = received = (g - 1) * S
#   reduce-scatter of an M-byte tensor:     sent = received = (g - 1) / g * M
#   all-reduce of an M-byte tensor:         sent = received = 2 (g - 1) / g * M
# Kinds are "<tag>_<collective>" in forward and "<tag>_<collective>_grad" for the
# collective that runs in backward, e.g. tp_all_gather / tp_reduce_scatter_grad.

def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _count(counter: Optional[CommCounter], kind: str, nbytes: int) -> None:
    if counter is not None:
        counter.add(kind, nbytes, nbytes)


def all_reduce_tensor(x: torch.Tensor, group, counter: Optional[CommCounter] = None, kind: str = "all_reduce",
                      op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A reduced copy of x over `group` (x is untouched); not differentiable."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    g = dist.get_world_size(group)
    _count(counter, kind, 2 * (g - 1) * _nbytes(out) // g)
    return out


def _all_gather(x: torch.Tensor, dim: int, group, counter, kind) -> torch.Tensor:
    g = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((g * x.shape[0],) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)  # rank r's shard lands at rows [r*n, (r+1)*n)
    _count(counter, kind, (g - 1) * _nbytes(x))
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group, counter, kind) -> torch.Tensor:
    g = dist.get_world_size(group)
    if x.shape[dim] % g:
        raise ValueError(f"reduce-scatter needs dimension {dim} ({x.shape[dim]}) divisible by the group size ({g}).")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // g,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    _count(counter, kind, (g - 1) * _nbytes(out))
    return out.movedim(0, dim)


class _CopyToRegion(torch.autograd.Function):
    """Forward identity; backward all-reduce (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group, counter, tag):
        ctx.group, ctx.counter, ctx.tag = group, counter, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_tensor(grad, ctx.group, ctx.counter, f"{ctx.tag}_all_reduce_grad"), None, None, None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward all-reduce; backward identity (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group, counter, tag):
        return all_reduce_tensor(x, group, counter, f"{tag}_all_reduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _GatherAlongDim(torch.autograd.Function):
    """Forward all-gather along `dim`; backward reduce-scatter along `dim`."""

    @staticmethod
    def forward(ctx, x, dim, group, counter, tag):
        ctx.dim, ctx.group, ctx.counter, ctx.tag = dim, group, counter, tag
        return _all_gather(x, dim, group, counter, f"{tag}_all_gather")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.counter, f"{ctx.tag}_reduce_scatter_grad"), \
            None, None, None, None


class _ReduceScatterAlongDim(torch.autograd.Function):
    """Forward reduce-scatter along `dim`; backward all-gather along `dim`."""

    @staticmethod
    def forward(ctx, x, dim, group, counter, tag):
        ctx.dim, ctx.group, ctx.counter, ctx.tag = dim, group, counter, tag
        return _reduce_scatter(x, dim, group, counter, f"{tag}_reduce_scatter")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.counter, f"{ctx.tag}_all_gather_grad"), \
            None, None, None, None


def copy_to_region(x: torch.Tensor, group, counter: Optional[CommCounter] = None, tag: str = "tp") -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: each rank's grad is partial, so sum it."""
    return _CopyToRegion.apply(x, group, counter, tag)


def reduce_from_region(x: torch.Tensor, group, counter: Optional[CommCounter] = None, tag: str = "tp"
                       ) -> torch.Tensor:
    """Leave a tensor-parallel region: sum the ranks' partial outputs (all-reduce)."""
    return _ReduceFromRegion.apply(x, group, counter, tag)


def all_gather_along_dim(x: torch.Tensor, dim: int, group, counter: Optional[CommCounter] = None,
                         tag: str = "tp") -> torch.Tensor:
    """Concatenate the ranks' x along `dim` in group-rank order; the grad is reduce-scattered back."""
    return _GatherAlongDim.apply(x, dim, group, counter, tag)


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group, counter: Optional[CommCounter] = None,
                             tag: str = "tp") -> torch.Tensor:
    """Sum the ranks' x and keep this rank's 1/g slice of `dim`; the grad is all-gathered back."""
    return _ReduceScatterAlongDim.apply(x, dim, group, counter, tag)


# ----------------------------------------------------------------------------- DeepSpeed's ZeRO traffic

def _bus_bytes(name: str, args, g: int) -> int:
    """Bytes one rank sends in deepspeed.comm call `name` over g ranks (the ring counts above)."""
    if name == "all_reduce":
        return 2 * (g - 1) * _nbytes(args["tensor"]) // g
    if name == "reduce":
        return (g - 1) * _nbytes(args["tensor"]) // g
    if name == "reduce_scatter_tensor":
        return (g - 1) * _nbytes(args["input_tensor"]) // g
    if name == "all_gather_into_tensor":
        return (g - 1) * _nbytes(args["input_tensor"])
    return (g - 1) * _nbytes(args["tensor"])  # all_gather into a list


def count_deepspeed_collectives(counter: CommCounter, groups: dict) -> bool:
    """Count deepspeed.comm's reductions and gathers on `groups` ({process group: name}) in
    `counter` as "zero_<name>_<collective>", sent = received = the ring's bytes: what ZeRO's
    gradient reductions and parameter all-gathers move, beside the all-to-alls' counts. Wraps
    the backend's methods as they are now (after route_deepspeed_collectives, so the
    shared-memory routes are counted too); a later call moves the counting to its counter and
    groups. True if the counting is in place."""
    import inspect
    from deepspeed.comm import comm as ds_comm
    backend = ds_comm.cdb
    if backend is None:
        return False
    wrapped = hasattr(backend, "_moe_trainer_counting")
    backend._moe_trainer_counting = (counter, {g: n for g, n in groups.items() if g is not None})
    if wrapped:
        return True

    def wrap(name: str, base):
        signature = inspect.signature(base)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            now, names = backend._moe_trainer_counting
            kind = names.get(bound.arguments.get("group"))
            if kind is not None:
                g = dist.get_world_size(bound.arguments["group"])
                _count(now, f"zero_{kind}_{name}", _bus_bytes(name, bound.arguments, g))
            return base(*args, **kwargs)
        return call

    for name in ("all_reduce", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather"):
        setattr(backend, name, wrap(name, getattr(backend, name)))
    return True
