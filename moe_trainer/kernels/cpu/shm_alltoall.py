"""all_to_all_single through shared memory, for expert parallelism between CPU ranks of one host.

gloo moves every all-to-all over loopback TCP with a socket round trip per peer; between two busy
single-threaded ranks each exchange costs ~1-2 ms however small (the counts exchange included), and
an MoE layer makes five per micro-batch. Here each rank owns a file in /dev/shm with one byte ring
per destination (csrc/cpu_kernels.cpp: `shm_all_to_all`): a rank streams its chunk for rank j into
ring j and drains its ring in every peer's file, so an exchange costs two memcpys and the wait for
the slowest peer, and chunks larger than a ring stream through it. A rank that has to wait spins
briefly, then sleeps on a futex in its file that a peer rings after changing one of its rings:
with more ranks than cores (4 ranks on 2 here) a spinning rank would hold the core the peer it
waits for needs.

The same rings carry the pipeline's point-to-point transfers between the stages (`exchange`: a
batch of sends and receives as one group call; with MOE_TRAINER_STRICT_P2P=1 each send is held
until its receiver has taken it, as NCCL holds a large one), and the trainer's small per-step
all-reduces (losses, expert counts, the noise scale's norms), which on gloo cost as much as an
all-to-all each.

`ShmAllToAll.create(group)` returns None (and the caller stays on gloo) unless every rank of the
group runs on this host (and sees the others' process ids) with the CPU kernels built and /dev/shm
holds the rings; every rank of the group reaches the same answer. A waiting rank raises as soon as
a peer's process has exited, and after `timeout_s` if a live peer never arrives, instead of hanging.
"""
from __future__ import annotations

import math
import os
import secrets
import socket
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from . import extension as cpu_kernels

# Bytes per ring (one per destination rank in each rank's file): MoE exchanges of a few MB stream
# through in a few passes, and a world of 8 ranks maps 8 x 8 x 4 MB = 256 MB of /dev/shm.
RING_BYTES = 4 << 20
# for the pipeline group's point-to-point: two ranks exchange one activation (or its gradient) at a
# time, in batches that also receive; larger activations stream through the ring
P2P_RING_BYTES = 2 << 20
# for groups that only carry the trainer's small all-reduces (a few KB per step)
SMALL_RING_BYTES = 64 << 10
# all_reduce_ of at most this many bytes gathers every rank's copy (one exchange); larger ones
# reduce-scatter and all-gather (two exchanges, 2 (world - 1) / world of the bytes per rank instead
# of world - 1)
GATHER_ALL_BYTES = 64 << 10
# each wait on the rings runs inside a profiler range of this name + the C++ call's (shm_all_to_all,
# shm_exchange): a torch.profiler trace (debug.profile_steps) sees it as communication
PROFILE_RANGE = "shm_collective::"


# How long a rank with nothing to send or take spins before it sleeps until a peer rings its doorbell
# (a futex in its file). With a core per rank, spinning answers a peer a few microseconds sooner
# than a wake-up would; with more ranks than cores, the spinning rank holds a core that the peer it
# waits for needs, so it sleeps almost at once. MOE_TRAINER_SHM_SPIN_US overrides both.
SPIN_S_OWN_CORE = 5e-3
SPIN_S_SHARED_CORE = 20e-6


def strict_p2p() -> bool:
    """Whether point-to-point sends wait for their receivers (MOE_TRAINER_STRICT_P2P=1: NCCL's rule
    for sends larger than its buffers, which a pipeline's activations at scale are)."""
    return os.environ.get("MOE_TRAINER_STRICT_P2P", "0") == "1"


def spin_seconds(group_world: int) -> float:
    """The spin budget of a rank on this host: short when the host's ranks (LOCAL_SIZE, set by
    the launchers) times this rank's threads outnumber the cores this process may run on."""
    if "MOE_TRAINER_SHM_SPIN_US" in os.environ:
        return float(os.environ["MOE_TRAINER_SHM_SPIN_US"]) * 1e-6
    ranks = max(group_world, int(os.environ.get("LOCAL_SIZE", "0") or 0))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return SPIN_S_SHARED_CORE if ranks * torch.get_num_threads() > cores else SPIN_S_OWN_CORE


class ShmAllToAll:
    """The shared-memory rings of one process group (every rank of it on this host)."""

    def __init__(self, ops, handle: int, group, timeout_s: float):
        self.ops, self.handle, self.timeout_s = ops, handle, timeout_s
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.spin_s = spin_seconds(self.world)
        self.strict = strict_p2p()  # exchange's default, read once: set before the rings are made

    @classmethod
    def create(cls, group, ring_bytes: int = RING_BYTES, timeout_s: float = 300.0) -> Optional["ShmAllToAll"]:
        """Collective over `group`: the transport, or None on every rank if any rank cannot use it."""
        ops = cpu_kernels.kernels()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        # every rank's (host-name hash, pid): one host, and pids a waiting rank can watch
        mine = torch.tensor([zlib.crc32(socket.gethostname().encode()), os.getpid()], dtype=torch.int64)
        ids = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(ids, mine, group=group)
        hosts, pids = [int(i[0]) for i in ids], [int(i[1]) for i in ids]
        # a name no other job uses (drawn without touching torch's generator, which the run seeds)
        token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        dist.broadcast(token, src=dist.get_global_rank(group, 0), group=group)
        usable = (ops is not None and hasattr(ops, "shm_all_to_all") and len(set(hosts)) == 1
                  and all(_visible(p) for p in pids))
        handle = ops.shm_channel_create(f"/dev/shm/moe_trainer_a2a_{token.item():x}", rank, world, ring_bytes) \
            if usable else -1
        if not _all_ranks_agree(handle >= 0, group):
            if handle >= 0:
                ops.shm_channel_close(handle)
            return None
        attached = ops.shm_channel_attach(handle)
        if not _all_ranks_agree(attached, group):
            ops.shm_channel_close(handle)
            return None
        ops.shm_channel_set_pids(handle, pids)
        ops.shm_channel_unlink(handle)  # every peer has mapped it: the name can go
        return cls(ops, handle, group, timeout_s)

    def all_to_all_single(self, out: torch.Tensor, x: torch.Tensor, out_splits: Optional[list[int]] = None,
                          in_splits: Optional[list[int]] = None, what: str = "all-to-all") -> None:
        """dist.all_to_all_single(out, x, out_splits, in_splits) for contiguous CPU tensors (splits
        in rows of dim 0; None = equal). `what`: the collective it serves, named in a failure."""
        if out_splits is None:
            out_splits = [out.shape[0] // self.world] * self.world
        if in_splits is None:
            in_splits = [x.shape[0] // self.world] * self.world
        row = x.element_size() * math.prod(x.shape[1:])
        _collective(self.ops.shm_all_to_all, self.handle, _bytes(x), [n * row for n in in_splits], _bytes(out),
                    [n * row for n in out_splits], self.timeout_s, self.spin_s, what=what)

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
                 rendezvous: Optional[bool] = None) -> None:
        """Point-to-point as one NCCL group call (dist.batch_isend_irecv, waited): each (peer, tensor)
        of `sends` goes to that rank of the group, each of `recvs` is filled from it. Transfers
        between two ranks match in the order they are listed, call after call. A send completes
        once it is in the ring, as NCCL's sends do while they fit its buffers (and gloo's always);
        with `rendezvous` (default: MOE_TRAINER_STRICT_P2P=1 when the rings were made, which the
        tests set) only once its receiver has taken it: NCCL's rule for large messages, so an order
        that deadlocks on GPUs fails here after timeout_s instead of passing."""
        if rendezvous is None:
            rendezvous = self.strict
        _collective(self.ops.shm_exchange, self.handle, [_bytes(t) for _, t in sends], [peer for peer, _ in sends],
                    [_bytes(t) for _, t in recvs], [peer for peer, _ in recvs], rendezvous, self.timeout_s, self.spin_s)

    # ------------------------------------------------------------------ collectives on top
    # Every reduction is done by one rank per element, adding the ranks' copies in rank order
    # (in float32 for 16-bit tensors), so all ranks end with the same bits.

    def _gather_shares(self, out: torch.Tensor, share: torch.Tensor, sizes: list[int], what: str) -> None:
        """All-gather: flat `out` (sum(sizes) elements) receives rank j's flat `share` (sizes[j]
        elements, this rank's = share.numel()) in rank order."""
        self.all_to_all_single(out, share.repeat(self.world), sizes, [share.numel()] * self.world,  # a copy per rank
                               what=what)

    def _reduce_share(self, flat: torch.Tensor, sizes: list[int], op: str, what: str) -> torch.Tensor:
        """Reduce-scatter: flat `flat` cut into consecutive shares of sizes[j] elements; returns the
        reduction over the ranks of this rank's share."""
        mine = flat.new_empty(self.world, sizes[self.rank])
        self.all_to_all_single(mine.view(-1), flat, [sizes[self.rank]] * self.world, sizes, what=what)
        return _reduce_rows(mine, op)

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a CPU tensor, op "sum", "avg", "max" or "min". Up to
        GATHER_ALL_BYTES every rank gathers every copy and reduces them itself (one exchange);
        above, a reduce-scatter (each rank reduces 1/world of the elements) and an all-gather
        (two exchanges, half the bytes at world 4)."""
        flat = t.detach().reshape(-1).contiguous()  # t's own memory when t is contiguous
        n = flat.numel()
        if n * flat.element_size() <= GATHER_ALL_BYTES:
            gathered = flat.new_empty(self.world, n)
            self._gather_shares(gathered.view(-1), flat, [n] * self.world, "all-reduce")
            flat.copy_(_reduce_rows(gathered, op))
        else:
            sizes = _shares(n, self.world)
            self._gather_shares(flat, self._reduce_share(flat, sizes, op, "all-reduce"), sizes, "all-reduce")
        if flat.data_ptr() != t.data_ptr():
            with torch.no_grad():
                t.copy_(flat.view_as(t))
        return t

    def reduce_(self, t: torch.Tensor, dst: int, op: str = "sum") -> torch.Tensor:
        """dist.reduce: rank `dst` of the group ends with the reduction of every rank's `t`; the
        others' `t` are unchanged."""
        flat = t.detach().reshape(-1).contiguous()
        n, w = flat.numel(), self.world
        to_dst = [n if j == dst else 0 for j in range(w)]
        gathered = flat.new_empty(w if self.rank == dst else 0, n)
        self.all_to_all_single(gathered.view(-1), flat, [n] * w if self.rank == dst else [0] * w, to_dst, what="reduce")
        if self.rank == dst:
            with torch.no_grad():
                t.copy_(_reduce_rows(gathered, op).view_as(t))
        return t

    def all_gather_into_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dist.all_gather_into_tensor: `out` (world x numel(x) elements) holds every rank's `x`
        in rank order."""
        flat = x.detach().reshape(-1).contiguous()
        assert out.is_contiguous() and out.numel() == self.world * flat.numel() and out.dtype == flat.dtype, \
            "all_gather_into_tensor: the output must be contiguous, world x the input's elements, same dtype"
        self._gather_shares(out.view(-1), flat, [flat.numel()] * self.world, "all-gather")
        return out

    def reduce_scatter_(self, out: torch.Tensor, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """dist.reduce_scatter_tensor: `out` holds the reduction of every rank's slice `rank` of `x`
        (world equal slices)."""
        flat = x.detach().reshape(-1).contiguous()
        n = out.numel()
        assert flat.numel() == self.world * n and out.dtype == flat.dtype, \
            "reduce_scatter_tensor: the input must have world x the output's elements, same dtype"
        with torch.no_grad():
            out.copy_(self._reduce_share(flat, [n] * self.world, op, "reduce-scatter").view_as(out))
        return out

    def close(self) -> None:
        self.ops.shm_channel_close(self.handle)


def _shares(n: int, world: int) -> list[int]:
    """n elements split into world nearly equal consecutive shares (the first n % world one larger)."""
    return [n // world + (1 if j < n % world else 0) for j in range(world)]


def _reduce_rows(rows: torch.Tensor, op: str) -> torch.Tensor:
    """rows[0] op rows[1] op ... in rank order; sums of 16-bit rows accumulate in float32."""
    if op in ("max", "min"):
        acc = rows[0].clone()
        for r in range(1, rows.shape[0]):
            (torch.maximum if op == "max" else torch.minimum)(acc, rows[r], out=acc)
        return acc
    if op not in ("sum", "avg"):
        raise ValueError(f"shared-memory reduction: unsupported op {op!r} (sum, avg, max, min)")
    wide = rows.dtype in (torch.bfloat16, torch.float16)
    acc = rows[0].float() if wide else rows[0].clone()
    for r in range(1, rows.shape[0]):
        acc += rows[r]
    if op == "avg":
        acc /= rows.shape[0]
    return acc.to(rows.dtype) if wide else acc


def _collective(op, *args, what: Optional[str] = None) -> None:
    """op(*args), a wait on the peers: its failure (a peer exited, or none came for timeout_s) raises
    DistError, as a gloo or NCCL collective's does, so the trainer ends the job with its one line.
    `what`: the collective an all-to-all serves (a ZeRO all-gather, a loss all-reduce), named in the
    message instead of the rings' own "shm all-to-all"."""
    try:
        with torch.profiler.record_function(f"{PROFILE_RANGE}{op.__name__}"):  # debug.profile_steps: its time
            op(*args)
    except RuntimeError as e:
        text = str(e)
        if what is not None and text.startswith("shm all-to-all"):
            text = f"shm {what}" + text[len("shm all-to-all"):]
        raise dist.DistError(text) from None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    assert t.is_contiguous() and t.device.type == "cpu", "the shared-memory all-to-all takes contiguous CPU tensors"
    return t.view(-1).view(torch.uint8)


def _visible(pid: int) -> bool:
    """Whether this process sees `pid` (the same PID namespace), so that its death can be noticed."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _all_ranks_agree(ok: bool, group) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
