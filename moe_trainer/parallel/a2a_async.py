"""Asynchronous expert-parallel all-to-alls for the overlapped executor (overlap.py).

issue() starts an all-to-all of rows and returns an Inflight; Inflight.wait() completes it and
returns the received rows. One code path for every device: torch.distributed's
`all_to_all_single(..., async_op=True)`, whose work handle is gloo's asynchronous work on CPU ranks
and, on NCCL, a collective enqueued on NCCL's own communication stream whose wait() only makes the
current stream wait for it (an event: no host synchronisation; the split sizes were read on the host
already, by the dispatcher's one read per layer). The input is kept alive until the wait, so its
memory is not reused while a transfer may still read it.

The shared-memory rings (comm.enable_shm_transport) are synchronous: overlapped, the group's
transport is wrapped in a SerialTransport, one background thread that runs every call on that group
(asynchronous ones and blocking ones alike, such as the split-size exchange) in the order they were
made: the same order on every rank, as the rings need. The rings release the GIL while they wait.

A rank's wait in Inflight.wait() is the exposed all-to-all time: counted as the span kind
"a2a_wait" (observers.py adds it to time.exposed_all_to_all_s); the transfer's own span (issue to
completion) as "overlapped_<kind>" ("overlapped_dispatch", "overlapped_combine_grad", ...); its bytes
under its kind, as the blocking path counts them.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..kernels.cpu.shm_alltoall import SPIN_S_SHARED_CORE
from . import link
from .comm import CommCounter, _count_rows, offrank_bytes, shm_transport, use_shm_transport


class SerialTransport:
    """A synchronous transport's calls on one background thread, first in first out. submit() returns
    a future; any other method of the transport is called through the thread and waited for."""

    def __init__(self, transport):
        self.transport = transport
        # the thread waits for peers while this rank computes: a spinning wait would take the core the
        # compute needs, so it spins only briefly before sleeping on the rings' doorbell
        transport.spin_s = min(transport.spin_s, SPIN_S_SHARED_CORE)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ep-all-to-all")

    def submit(self, name: str, *args) -> concurrent.futures.Future:
        return self.pool.submit(getattr(self.transport, name), *args)

    def __getattr__(self, name):
        attr = getattr(self.transport, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            return self.pool.submit(attr, *args, **kwargs).result()
        return call


def serialize_transport(group) -> None:
    """Run the group's shared-memory transport (if it has one) on a SerialTransport; idempotent."""
    transport = shm_transport(group)
    if transport is not None and not isinstance(transport, SerialTransport):
        use_shm_transport(group, SerialTransport(transport))


class Inflight:
    """One issued all-to-all of rows."""

    def __init__(self, x, out, work, counter: Optional[CommCounter], kind: str, start, until: Optional[float]):
        self.x, self.out, self.work, self.counter, self.kind, self.start = x, out, work, counter, kind, start
        self.until = until

    def wait(self) -> torch.Tensor:
        t0 = self.counter.mark() if self.counter is not None else None
        if isinstance(self.work, concurrent.futures.Future):
            self.work.result()
        else:
            self.work.wait()
        if self.until is not None:
            link.hold(self.until)
        if self.counter is not None:
            end = self.counter.mark()
            self.counter.add_span("overlapped_" + self.kind, self.start, end)
            self.counter.add_span("a2a_wait", t0, end)
        self.x = self.work = None
        return self.out


def issue(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
          counter: Optional[CommCounter] = None, kind: str = "all_to_all") -> Inflight:
    """Start the all-to-all of rows x [sum(in_splits), ...] -> [sum(out_splits), ...] (no autograd)."""
    x = x.detach().contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    start = counter.mark() if counter is not None else None
    until = link.deadline(time.perf_counter(), offrank_bytes(x, out_splits, in_splits, group)) \
        if link.enabled() else None
    transport = shm_transport(group)
    if isinstance(transport, SerialTransport) and x.device.type == "cpu":
        work = transport.submit("all_to_all_single", out, x, out_splits, in_splits)
    else:
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    _count_rows(counter, kind, x, out_splits, in_splits, group)
    return Inflight(x, out, work, counter, kind, start, until)
