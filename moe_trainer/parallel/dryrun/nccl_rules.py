"""NCCL's rules around torch's fake process group, and a record of every collective.

torch's `fake` backend (torch.testing._internal.distributed.fake_pg) completes any collective at
any world size without moving data, and it accepts a CPU tensor; NCCL does not. `NcclRules`
wraps torch.distributed's collective, point-to-point and new_group functions (both the
`torch.distributed` names and the `distributed_c10d` globals that torch's own helpers call) and
checks, per simulated rank:

1. device: every tensor of a collective or transfer is a fake tensor on the rank's CUDA device
   (checked at the call: the first violation stops the run);
2. group creation: every rank enters every new_group in the same order (each rank's sequence is
   compared with the first simulated rank's; a one-rank group that a rank makes of itself with
   local synchronisation reads as "self", the same entry on every rank);
3. with every rank simulated: the members of each group enter the same collectives in the same
   order (op, dtype, element count), and each pair's sends and receives match one to one, in
   order and in bytes (NCCL pairs point-to-point by order per peer).

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
from collections import Counter, defaultdict
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

    def key(self) -> tuple:
        """What every member must agree on: splits of an all-to-all may differ, sizes elsewhere not."""
        return (self.op, self.dtype) if self.op.startswith("all_to_all") else (self.op, self.dtype, self.numel)

    def describe(self) -> str:
        return f"{self.op} ({self.dtype}, {self.numel} elements) at {self.site}"


@dataclass
class RankLog:
    """Everything one simulated rank did under the rules."""

    rank: int
    creations: list = field(default_factory=list)  # (normalised ranks, site)
    calls: list = field(default_factory=list)  # collectives, in order
    p2p: list = field(default_factory=list)  # (direction "send"/"recv", peer, bytes, dtype, site)


COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
               "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter", "all_to_all_single", "all_to_all",
               "barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter")
P2P = ("send", "recv", "isend", "irecv")


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
            call.kind = "world" if call.pg is None else kinds.get(call.pg, "other")
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
        self._wrap("batch_isend_irecv", self._batch)
        self._wrap("new_group", self._new_group)
        self._installed = True

    def _wrap(self, name: str, handler) -> None:
        base = getattr(c10d, name, None)
        if base is None:
            return

        def call(*args, **kwargs):
            outer = getattr(self._depth, "n", 0) == 0 and self.rank is not None
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
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
        site = call_site()
        bound = _bind(base, args, kwargs)
        group = bound.get("group")
        ranks = tuple(range(self.world)) if group is None else tuple(dist.get_process_group_ranks(group))
        tensors = [] if name.endswith(("_object_list", "_object")) else \
            [t for k, v in bound.items() if k != "group" for t in _tensors(v)]
        self.check_device(name, tensors, ranks, site)
        first = tensors[-1] if name in ("all_gather", "all_to_all") and tensors else (tensors[0] if tensors else None)
        dtype = str(first.dtype).replace("torch.", "") if first is not None else "-"
        numel = _input_numel(name, bound)
        call = Call(name, ranks, "", dtype, numel, site, self._sends(name, bound, ranks), pg=group)
        self.logs[self.rank].calls.append(call)

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
        site = call_site()
        ops = args[0] if args else kwargs["p2p_op_list"]
        for p in ops:
            direction = "send" if p.op.__name__ in ("isend", "send") else "recv"
            self._p2p(direction, p.tensor, p.peer, p.group, site)

    def _new_group(self, name: str, base, args, kwargs) -> None:
        bound = _bind(base, args, kwargs)
        ranks = tuple(sorted(bound.get("ranks") or range(self.world)))
        if ranks == (self.rank,) and bound.get("use_local_synchronization"):
            ranks = ("self",)  # every rank making its own one-rank group enters the same creation
        self.logs[self.rank].creations.append((ranks, call_site_chain()))

    # ------------------------------------------------------------------ rule 2: group creations
    def check_creations(self, log: RankLog) -> None:
        first = next(iter(self.logs.values()))
        if first is log:
            return
        a, b = first.creations, log.creations
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b) or a[i][0] != b[i][0]:
                mine = f"creates group {_ranks_text(b[i][0], log.rank)} at {b[i][1]}" if i < len(b) else \
                    "creates no group"
                theirs = f"group {_ranks_text(a[i][0], first.rank)} at {a[i][1]}" if i < len(a) else "none"
                raise RuleError(f"NCCL rule broken (every rank enters every group creation in the same order): "
                                f"rank {log.rank} {mine} as its group creation #{i + 1}, where rank {first.rank} "
                                f"creates {theirs}.")

    # ------------------------------------------------------------------ rule 3: with every rank simulated
    def check_sequences(self) -> None:
        """Each group's members entered the same collectives, in the same order."""
        per_group: dict[tuple, dict[int, list]] = defaultdict(dict)
        for rank, log in self.logs.items():
            for call in log.calls:
                per_group[(call.kind, call.group)].setdefault(rank, []).append(call)
        for (kind, ranks), seqs in per_group.items():
            for r in ranks:
                seqs.setdefault(r, [])
            ref_rank = ranks[0]
            ref = seqs[ref_rank]
            for r in ranks[1:]:
                _compare(kind, ranks, ref_rank, ref, r, seqs[r])

    def check_p2p(self) -> None:
        """Point-to-point under NCCL's pairing: the k-th send from a to b is b's k-th receive from a."""
        sends, recvs = defaultdict(list), defaultdict(list)
        for rank, log in self.logs.items():
            for direction, peer, nbytes, dtype, site in log.p2p:
                (sends[(rank, peer)] if direction == "send" else recvs[(peer, rank)]).append((nbytes, dtype, site))
        for pair in sorted(set(sends) | set(recvs)):
            a, b = sends[pair], recvs[pair]
            for i in range(max(len(a), len(b))):
                if i >= len(a) or i >= len(b) or a[i][:2] != b[i][:2]:
                    s = f"send #{i + 1} is {a[i][0]} bytes of {a[i][1]} at {a[i][2]}" if i < len(a) else \
                        f"sends only {len(a)} tensors"
                    r = f"receive #{i + 1} is {b[i][0]} bytes of {b[i][1]} at {b[i][2]}" if i < len(b) else \
                        f"posts only {len(b)} receives"
                    raise RuleError(f"NCCL rule broken (point-to-point pairs each send with the peer's receive "
                                    f"in order): rank {pair[0]}'s {s}, rank {pair[1]}'s {r} from it.")

    # ------------------------------------------------------------------ the report
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


def _compare(kind: str, ranks: tuple, ra: int, a: list, rb: int, b: list) -> None:
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b):
            more, r, n = (a, ra, len(b)) if len(a) > len(b) else (b, rb, len(a))
            other = rb if r == ra else ra
            raise RuleError(f"NCCL rule broken (the members of a group enter the same collectives in the same "
                            f"order): on group {kind} {list(ranks)} rank {r} enters a collective #{i + 1}, "
                            f"{more[i].describe()}, that rank {other} never enters (it stops after {n}).")
        if a[i].key() != b[i].key():
            raise RuleError(f"NCCL rule broken (the members of a group enter the same collectives in the same "
                            f"order): on group {kind} {list(ranks)} rank {ra}'s collective #{i + 1} is "
                            f"{a[i].describe()}, rank {rb}'s is {b[i].describe()}.")


def _ranks_text(ranks: tuple, rank: int) -> str:
    return f"[{rank}] (its own one-rank group)" if ranks == ("self",) else str(list(ranks))


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
    lists = bound.get("input_list") or bound.get("input_tensor_list") or bound.get("tensor_list")
    return sum(t.numel() for t in lists) if lists else 0

