"""NCCL's rules around torch's fake process group, and a record of every collective.

torch's `fake` backend (torch.testing._internal.distributed.fake_pg) completes any collective at
any world size without moving data, and it accepts a CPU tensor; NCCL does not. `NcclRules`
wraps torch.distributed's collective, point-to-point and new_group functions (both the
`torch.distributed` names and the `distributed_c10d` globals that torch's own helpers call; the
coalesced calls; batch_isend_irecv; split_group; the functional collectives of the compiled path,
through the fake mode's hook `functional`) and checks, per simulated rank:

1. device: every tensor of a collective or transfer is a fake tensor on the rank's CUDA device
   (checked at the call: the first violation stops the run); batch_isend_irecv with the rank's
   device current;
2. group creation: every rank enters every new_group in the same order, and every rank of a
   split's parent enters the split with the same groups (each rank's sequence is compared with the
   first simulated rank's; a one-rank group that a rank makes of itself with local synchronisation
   reads as "self", the same entry on every rank). A split needs a bound device and disjoint groups
   of the parent's ranks. The fake backend cannot split: `_split_group` makes the groups instead;
3. the rules across ranks (crossrank.py): the members of a group enter the same collectives in the
   same order, sends meet receives, a batched first call is every member's.

Each collective is recorded as (group kind, op, dtype, bytes) with the bytes this rank sends to
each peer under ring algorithms (as parallel/comm.py counts them): all-reduce 2 (g-1)/g N,
reduce-scatter (g-1)/g N, all-gather (g-1) S, to the next rank of the group's ring; an
all-to-all its split rows to each peer. A peer on the same node (rank // gpus_per_node) makes
them intra-node bytes.
"""
from __future__ import annotations

import inspect
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed import distributed_c10d as c10d

from .fake_cuda import call_site


class RuleError(RuntimeError):
    """A broken NCCL rule: one sentence naming the rule, the rank and the call site."""


@dataclass
class Call:
    """One collective or point-to-point transfer, as one rank entered it."""

    op: str
    group: tuple  # global ranks of the group
    kind: str  # the mesh's name for the group ("world", "dp", "ep", ...), resolved at the rank's end
    dtype: str
    numel: int
    site: str
    sends: list = field(default_factory=list)  # (peer global rank, bytes) this rank sends
    pg: object = None  # the process group (None: the world), dropped once the kind is known
    redop: str = "-"  # the reduction ("sum", "max", ...), "-" for a call without one
    root: int = -1  # broadcast / reduce / gather / scatter: the root's index in the group

    def key(self) -> tuple:
        """What every member must agree on: splits of an all-to-all may differ, sizes elsewhere not."""
        if self.op.startswith("all_to_all"):
            return (self.op, self.dtype)
        return (self.op, self.dtype, self.numel, self.redop, self.root)

    def describe(self) -> str:
        extra = (f", {self.redop}" if self.redop != "-" else "") + (f", root {self.root}" if self.root >= 0 else "")
        return f"{self.op} ({self.dtype}, {self.numel} elements{extra}) at {self.site}"


@dataclass
class RankLog:
    """Everything one simulated rank did under the rules."""

    rank: int
    creations: list = field(default_factory=list)  # (what was created, site, the ranks that must enter it too)
    calls: list = field(default_factory=list)  # collectives, in order
    p2p: list = field(default_factory=list)  # (direction "send"/"recv", peer, bytes, dtype, site)
    first_call: dict = field(default_factory=dict)  # group's ranks -> ("collective" | "batched p2p", site)


COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
               "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter", "all_to_all_single", "all_to_all",
               "barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter")
COALESCED = ("all_reduce_coalesced", "all_gather_coalesced")  # one NCCL group call each
P2P = ("send", "recv", "isend", "irecv")
# torch.distributed._functional_collectives' ops (the compiled path's) -> the c10d call each one is
FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "broadcast": "broadcast",
              "broadcast_": "broadcast", "all_gather_into_tensor": "all_gather_into_tensor",
              "all_gather_into_tensor_out": "all_gather_into_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor",
              "all_to_all_single": "all_to_all_single", "all_reduce_coalesced": "all_reduce_coalesced",
              "all_reduce_coalesced_": "all_reduce_coalesced",
              "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
              "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced"}


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class NcclRules:
    """The wrapper layer (install once per process) and the per-rank logs it keeps."""

    def __init__(self, world: int, gpus_per_node: int):
        self.world, self.gpus_per_node = world, gpus_per_node
        self.logs: dict[int, RankLog] = {}
        self.rank: int | None = None
        self.device: torch.device | None = None
        self._depth = threading.local()
        self._installed = False

    # ------------------------------------------------------------------ rank lifetime
    def begin_rank(self, rank: int) -> RankLog:
        self.rank = rank
        self.device = torch.device("cuda", rank % self.gpus_per_node)
        self.logs[rank] = RankLog(rank)
        return self.logs[rank]

    def end_rank(self, kinds: dict) -> None:
        """Name each call's group from `kinds` ({process group: kind}) before the groups go, then
        check this rank's group creations against the first simulated rank's."""
        log = self.logs[self.rank]
        for call in log.calls:
            world = call.pg is None or call.pg == c10d._get_default_group()  # also when passed as group.WORLD
            call.kind = "world" if world else kinds.get(call.pg, "other")
            call.pg = None
        self.check_creations(log)
        self.rank = None

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        if self._installed:
            return
        for name in COLLECTIVES:
            self._wrap(name, self._collective)
        for name in P2P:
            self._wrap(name, self._point_to_point)
        for name in COALESCED:  # the fake backend has no coalesced kernels: run as their single calls
            self._wrap(name, self._coalesced, replace=True)
        self._wrap("batch_isend_irecv", self._batch)
        self._wrap("new_group", self._new_group)
        self._wrap("split_group", self._split_group, replace=True)
        # NCCL's backend splits communicators (a bound device then sends the mesh to split_group, and
        # makes torch's new_group a split too, non-members taking part with no colour); the fake backend
        # says it does, and _split_group makes the groups a split would
        from torch._C._distributed_c10d import FakeProcessGroup
        FakeProcessGroup.supports_splitting = property(lambda backend: True)
        FakeProcessGroup.perform_nocolor_split = lambda backend, device: None
        self._installed = True

    def _wrap(self, name: str, handler, replace: bool = False) -> None:
        """torch.distributed's `name` (and c10d's) checked by `handler(name, base, args, kwargs)` before
        it runs; with `replace`, the handler's result is the call's (it runs in place of torch's)."""
        base = getattr(c10d, name, None)
        if base is None:
            return

        def call(*args, **kwargs):
            outer = getattr(self._depth, "n", 0) == 0 and self.rank is not None
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
                if replace:
                    return handler(name, base, args, kwargs)
                if outer:  # torch's helpers (all_gather_object, batch_isend_irecv) call these again
                    handler(name, base, args, kwargs)
                return base(*args, **kwargs)
            finally:
                self._depth.n -= 1
        call.__name__, call.__wrapped__ = name, base
        setattr(c10d, name, call)
        if getattr(dist, name, None) is base:
            setattr(dist, name, call)

    # ------------------------------------------------------------------ rule 1: the rank's CUDA device
    def check_device(self, op: str, tensors: list, group_ranks: tuple, site: str) -> None:
        for t in tensors:
            if not isinstance(t, FakeTensor) or t.device != self.device:
                where = t.device if isinstance(t, FakeTensor) else f"{t.device} (a host tensor)"
                raise RuleError(f"NCCL rule broken (collectives take tensors on the rank's CUDA device): rank "
                                f"{self.rank} passes a tensor on {where} to {op} on group {list(group_ranks)} "
                                f"at {site}, not on {self.device}.")

    # ------------------------------------------------------------------ handlers
    def _group(self, args, kwargs, position: int):
        group = kwargs.get("group", args[position] if len(args) > position else None)
        ranks = tuple(range(self.world)) if group is None else tuple(dist.get_process_group_ranks(group))
        return group, ranks

    def _collective(self, name: str, base, args, kwargs) -> None:
        bound = _bind(base, args, kwargs)
        group = bound.get("group")
        ranks = tuple(range(self.world)) if group is None else tuple(dist.get_process_group_ranks(group))
        tensors = [] if name.endswith(("_object_list", "_object")) else \
            [t for k, v in bound.items() if k != "group" for t in _tensors(v)]
        first = tensors[-1] if name in ("all_gather", "all_to_all") and tensors else (tensors[0] if tensors else None)
        root = bound.get("src", bound.get("dst"))
        self._record(name, group, ranks, tensors, first, _redop(bound.get("op")), root, bound, collective_site())

    def _coalesced(self, name: str, base, args, kwargs):
        """all_reduce_coalesced / all_gather_coalesced: checked and recorded as one call, then run as the
        single calls they coalesce (the fake backend has no coalesced kernels)."""
        if self.rank is not None and getattr(self._depth, "n", 0) == 1:
            self._collective(name, base, args, kwargs)
        bound = _bind(base, args, kwargs)
        group, async_op = bound.get("group"), bound.get("async_op", False)
        single = c10d.all_reduce.__wrapped__ if name == "all_reduce_coalesced" else c10d.all_gather.__wrapped__
        if name == "all_reduce_coalesced":
            works = [single(t, op=bound.get("op", dist.ReduceOp.SUM), group=group, async_op=async_op)
                     for t in bound["tensors"]]
        else:
            works = [single(out, t, group=group, async_op=async_op)
                     for out, t in zip(bound["output_tensor_lists"], bound["input_tensor_list"])]
        return works[-1] if async_op and works else None

    def functional(self, func, args, kwargs) -> None:
        """A functional collective (torch.distributed._functional_collectives: the compiled path's,
        which never reaches the c10d functions above) entering the fake mode: the same checks and
        record as the c10d call it stands for."""
        op = func._schema.name.split("::")[-1]
        if self.rank is None or op not in FUNCTIONAL:
            return  # wait_tensor, or a rank's teardown
        bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
        bound.update(kwargs or {})
        group = c10d._resolve_process_group(bound["group_name"])
        ranks = tuple(dist.get_process_group_ranks(group))
        tensors = _tensors(bound.get("input", bound.get("inputs")))
        root = bound.get("src")
        root = dist.get_global_rank(group, root) if root is not None else None
        self._record(FUNCTIONAL[op], group, ranks, tensors, tensors[0] if tensors else None,
                     _redop(bound.get("reduce_op")), root, bound, collective_site())

    def _record(self, name: str, group, ranks: tuple, tensors: list, first, redop: str, root, bound: dict,
                site: str) -> None:
        self.check_device(name, tensors, ranks, site)
        dtype = str(first.dtype).replace("torch.", "") if first is not None else "-"
        call = Call(name, ranks, "", dtype, _input_numel(name, bound), site, self._sends(name, bound, ranks),
                    pg=group, redop=redop, root=ranks.index(root) if root in ranks else -1)
        self.logs[self.rank].calls.append(call)
        self.logs[self.rank].first_call.setdefault(ranks, ("collective", site))

    def _sends(self, name: str, bound: dict, ranks: tuple) -> list:
        """(peer, bytes) this rank sends in the call, ring algorithms for reductions and gathers."""
        g = len(ranks)
        if g == 1 or self.rank not in ranks:
            return []
        me = ranks.index(self.rank)
        ring_next = ranks[(me + 1) % g]
        if name == "all_to_all_single":
            x, splits = bound["input"], bound.get("input_split_sizes")
            row = _nbytes(x) // max(1, x.shape[0]) if x.dim() else _nbytes(x)
            rows = list(splits) if splits else [x.shape[0] // g] * g
            return [(ranks[j], rows[j] * row) for j in range(g) if j != me]
        if name == "all_to_all":
            return [(ranks[j], _nbytes(t)) for j, t in enumerate(bound["input_tensor_list"]) if j != me]
        if name in ("all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"):
            n = 2 * (g - 1) / g if name == "all_reduce_coalesced" else (g - 1) / g
            size = sum(_nbytes(t) for t in _tensors(bound.get("tensors", bound.get("inputs"))))
            return [(ring_next, int(n * size * (g if name.startswith("all_gather") else 1)))]
        n = {"all_reduce": 2 * (g - 1) / g, "reduce": (g - 1) / g, "broadcast": 1.0,
             "reduce_scatter_tensor": (g - 1) / g, "_reduce_scatter_base": (g - 1) / g,
             "reduce_scatter": (g - 1) / g}.get(name)
        if n is not None:
            t = bound.get("tensor", bound.get("input"))
            if name == "reduce_scatter":
                size = sum(_nbytes(v) for v in bound["input_list"])
            else:
                size = _nbytes(t) if isinstance(t, torch.Tensor) else 0
            return [(ring_next, int(n * size))]
        if name in ("all_gather", "all_gather_into_tensor", "_all_gather_base"):
            t = bound.get("tensor", bound.get("input_tensor"))
            return [(ring_next, (g - 1) * _nbytes(t))]
        return []

    def _point_to_point(self, name: str, base, args, kwargs) -> None:
        bound = _bind(base, args, kwargs)
        self._p2p(name.lstrip("i"), bound["tensor"], bound.get("dst", bound.get("src")), bound.get("group"),
                  call_site())

    def _p2p(self, direction: str, tensor, peer: int, group, site: str) -> None:
        if group is not None:
            peer = dist.get_global_rank(group, peer)
        ranks = (self.rank, peer)
        self.check_device(f"{direction} to rank {peer}" if direction == "send" else f"recv from rank {peer}",
                          [tensor], ranks, site)
        self.logs[self.rank].p2p.append((direction, peer, _nbytes(tensor), str(tensor.dtype), site))

    def _batch(self, name: str, base, args, kwargs) -> None:
        """batch_isend_irecv: NCCL's rules for it, then each transfer as a send or receive. On NCCL it
        needs the rank's device set current (else it hangs), and where it is the first call on its
        group every rank of the group must make it (checked across ranks: check_first_calls)."""
        site = call_site()
        ops = args[0] if args else kwargs["p2p_op_list"]
        if torch.cuda.current_device() != self.device.index:
            raise RuleError(f"NCCL rule broken (batched point-to-point needs the rank's device set current): rank "
                            f"{self.rank} calls batch_isend_irecv at {site} with cuda:{torch.cuda.current_device()} "
                            f"current, not {self.device}.")
        group = ops[0].group if ops else None
        ranks = tuple(range(self.world)) if group is None else tuple(dist.get_process_group_ranks(group))
        self.logs[self.rank].first_call.setdefault(ranks, ("batched p2p", site))
        for p in ops:
            direction = "send" if p.op.__name__ in ("isend", "send") else "recv"
            self._p2p(direction, p.tensor, p.peer, None, site)  # P2POp.peer: the global rank

    def _new_group(self, name: str, base, args, kwargs) -> None:
        bound = _bind(base, args, kwargs)
        ranks = tuple(sorted(bound.get("ranks") or range(self.world)))
        if ranks == (self.rank,) and bound.get("use_local_synchronization"):
            ranks = ("self",)  # every rank making its own one-rank group enters the same creation
        self.logs[self.rank].creations.append((ranks, call_site_chain(), None))

    def _split_group(self, name: str, base, args, kwargs):
        """dist.split_group, as NCCL runs it (ncclCommSplit of the parent's communicator): every rank of
        the parent enters it, in the same order, with the same split (checked across ranks with the other
        creations), from a parent this rank belongs to, with a device bound, into disjoint groups. The fake
        backend cannot split, so the groups are made as torch's new_group makes them: every rank of the
        world makes every group, one after another. Returns this rank's group (None: in none)."""
        bound = _bind(base, args, kwargs)
        parent, lists, site = bound.get("parent_pg"), bound.get("split_ranks"), call_site_chain()
        parent_ranks = tuple(range(self.world)) if parent is None else tuple(dist.get_process_group_ranks(parent))
        problem = None
        if c10d._get_default_group().bound_device_id is None:
            problem = "no device is bound to the default process group (init_process_group's device_id)"
        elif self.rank not in parent_ranks:
            problem = f"it is not a member of the parent group {list(parent_ranks)}"
        elif not lists or any(not g for g in lists):
            problem = "a split group is empty"
        flat = [r for g in lists or [] for r in g]
        if problem is None and (len(flat) != len(set(flat)) or not all(0 <= r < len(parent_ranks) for r in flat)):
            problem = f"the split {lists} is not disjoint groups of the parent's {len(parent_ranks)} group ranks"
        if problem:
            raise RuleError(f"NCCL rule broken (a communicator split: every rank of the parent enters it with the "
                            f"same disjoint groups): rank {self.rank} at {site}: {problem}.")
        split = tuple(sorted(tuple(sorted(parent_ranks[r] for r in g)) for g in lists))  # one colour each
        if self.rank is not None:
            self.logs[self.rank].creations.append((("split", parent_ranks, split), site, parent_ranks))
        make = c10d.new_group.__wrapped__ if hasattr(c10d.new_group, "__wrapped__") else c10d.new_group
        mine = None
        for ranks in (tuple(sorted(parent_ranks[r] for r in g)) for g in lists):  # the caller's order
            pg = make(list(ranks), timeout=bound.get("timeout"))
            if self.rank in ranks:
                mine = pg
                mine.bound_device_id = c10d._get_default_group().bound_device_id
        return mine

    # ------------------------------------------------------------------ rule 2: group creations
    def check_creations(self, log: RankLog) -> None:
        """This rank's group creations against the first simulated rank's: the ones both must enter
        (new_group: every rank of the world; a split: every rank of its parent), in the same order."""
        first = next(iter(self.logs.values()))
        if first is log:
            return

        def shared(entries, other):
            return [e for e in entries if e[2] is None or other in e[2]]
        a, b = shared(first.creations, log.rank), shared(log.creations, first.rank)
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b) or a[i][0] != b[i][0]:
                mine = f"creates {_created_text(b[i][0], log.rank)} at {b[i][1]}" if i < len(b) else \
                    "creates no group"
                theirs = f"{_created_text(a[i][0], first.rank)} at {a[i][1]}" if i < len(a) else "none"
                raise RuleError(f"NCCL rule broken (every rank enters every group creation in the same order): "
                                f"rank {log.rank} {mine} as its group creation #{i + 1}, where rank {first.rank} "
                                f"creates {theirs}.")

    # ------------------------------------------------------------------ the report
    def creation_counts(self, rank: int) -> dict:
        """{"split": communicator splits, "new_group": other group creations} this rank entered."""
        kinds = Counter("split" if what and what[0] == "split" else "new_group"
                        for what, _, _ in self.logs[rank].creations)
        return {k: kinds.get(k, 0) for k in ("split", "new_group")}

    def traffic(self, rank: int, calls: slice = slice(None), p2p: slice = slice(None)) -> dict:
        """Collective counts by (group kind, op) and the bytes this rank sends inside / across nodes,
        over the slices `calls` and `p2p` of its log (default all of it)."""
        log = self.logs[rank]
        counts: Counter = Counter()
        intra = inter = 0
        for call in log.calls[calls]:
            counts[f"{call.kind}.{call.op}"] += 1
            for peer, nbytes in call.sends:
                if peer // self.gpus_per_node == rank // self.gpus_per_node:
                    intra += nbytes
                else:
                    inter += nbytes
        for direction, peer, nbytes, _, _ in log.p2p[p2p]:
            counts[f"pp.{direction}"] += 1
            if direction == "send":
                if peer // self.gpus_per_node == rank // self.gpus_per_node:
                    intra += nbytes
                else:
                    inter += nbytes
        return {"collectives": dict(sorted(counts.items())), "intra_node_bytes": intra, "inter_node_bytes": inter}


def _created_text(what: tuple, rank: int) -> str:
    if what == ("self",):
        return f"group [{rank}] (its own one-rank group)"
    if what and what[0] == "split":
        return f"a split of group {list(what[1])} into {[list(g) for g in what[2]]}"
    return f"group {list(what)}"


def _redop(op) -> str:
    """A reduction's name: ReduceOp.SUM, RedOpType.SUM and the functional "sum" all read "sum"."""
    if op is None:
        return "-"
    return str(getattr(op, "name", op)).split(".")[-1].lower()


def collective_site() -> str:
    """Where a collective was called: the innermost frame outside torch (DeepSpeed's, or ours), and
    when that is a helper of ours or DeepSpeed's, the moe_trainer frame that called it."""
    frame, first, ours = sys._getframe(1), None, []
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        inside = "/parallel/dryrun/" in path or "/torch/" in path or "/contextlib.py" in path
        if not inside:
            where = (path.split("/site-packages/", 1)[-1] if "/site-packages/" in path else
                     "moe_trainer/" + path.split("/moe_trainer/", 1)[1] if "/moe_trainer/" in path else path)
            if first is None:
                first = (where, frame.f_lineno)
            if "/moe_trainer/" in path and where != first[0] and (not ours or ours[-1][0] == first[0]):
                ours.append((where, frame.f_lineno))
                break
        frame = frame.f_back
    if first is None:
        return "?"
    text = f"{first[0]}:{first[1]}"
    return text + (f" (called from {ours[0][0]}:{ours[0][1]})" if ours else "")


def call_site_chain() -> str:
    """The innermost moe_trainer frame and the frame that called into its file."""
    frame, sites = sys._getframe(1), []
    while frame is not None and len(sites) < 2:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/moe_trainer/" in path and "/parallel/dryrun/" not in path:
            where = "moe_trainer/" + path.split("/moe_trainer/", 1)[1]
            if not sites or sites[-1][0] != where:
                sites.append((where, frame.f_lineno))
        frame = frame.f_back
    if not sites:
        return call_site()
    text = f"{sites[0][0]}:{sites[0][1]}"
    return text + (f" (called from {sites[1][0]}:{sites[1][1]})" if len(sites) > 1 else "")


_SIGNATURES: dict = {}


def _bind(fn, args, kwargs) -> dict:
    """The call's arguments by name, defaults included."""
    sig = _SIGNATURES.get(fn) or _SIGNATURES.setdefault(fn, inspect.signature(fn))
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return dict(kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _input_numel(name: str, bound: dict) -> int:
    for key in ("tensor", "input", "input_tensor"):
        t = bound.get(key)
        if isinstance(t, torch.Tensor):
            return t.numel()
    lists = (bound.get("input_list") or bound.get("input_tensor_list") or bound.get("tensor_list")
             or bound.get("tensors") or bound.get("inputs"))
    return sum(t.numel() for t in lists) if lists else 0

