"""Asynchronous expert-parallel all-to-alls for the overlapped executor (overlap.py).

issue() starts an all-to-all of rows and returns an Inflight; Inflight.wait() completes it and
returns the received rows. One code path for every device: torch.distributed's
`all_to_all_single(..., async_op=True)`, whose work handle is gloo's asynchronous work on CPU ranks
and, on NCCL, a collective enqueued on NCCL's own communication stream whose wait() only makes the
current stream wait for it (an event: no host synchronisation; the split sizes were read on the host
already, by the dispatcher's one read per layer). The input is kept alive until the wait, so its
memory is not reused while a transfer may still read it.

The shared-memory rings between CPU ranks of one host (comm.enable_shm_transport) are synchronous:
there, the exchange itself runs when the all-to-all is completed, on the rank's own thread (every
rank completes them in the same order, as the rings need). What hides behind the other micro-batch
is then the link's time (debug.link_gbps: the emulated transfer runs from the issue), as on a link
whose transfers a DMA engine carries; the copy through the rings and the wait for a late peer stay
exposed. (A background thread running the rings cost more than it hid on 2 cores: each exchange
became two thread hand-offs, and the split-size exchange had to take the same thread.) gloo
(parallel.cpu_alltoall=gloo) and NCCL run the transfer itself in the background.

A rank's wait in Inflight.wait() is the exposed all-to-all time: counted as the span kind
"a2a_wait" (observers.py adds it to time.exposed_all_to_all_s), a forward transfer's also as
"a2a_wait_forward" (guards.py's straggler naming takes it out of the forward); the transfer's own span (issue to
completion) as "overlapped_<kind>" ("overlapped_dispatch", "overlapped_combine_grad", ...); its bytes
under its kind, as the blocking path counts them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import link
from .comm import CommCounter, _count_rows, offrank_bytes, shm_transport


class _AtCompletion:
    """A shared-memory ring exchange run when the all-to-all is completed (wait()), on the rank's own
    thread: the rings are synchronous, and every rank completes its all-to-alls in the same order."""

    def __init__(self, run):
        self.run = run

    def wait(self) -> None:
        self.run()


class Inflight:
    """One issued all-to-all of rows."""

    def __init__(self, x, out, work, counter: Optional[CommCounter], kind: str, start, until: Optional[float]):
        self.x, self.out, self.work, self.counter, self.kind, self.start = x, out, work, counter, kind, start
        self.until = until

    def wait(self) -> torch.Tensor:
        t0 = self.counter.mark() if self.counter is not None else None
        self.work.wait()
        if self.until is not None:
            link.hold(self.until)
        if self.counter is not None:
            end = self.counter.mark()
            self.counter.add_span("overlapped_" + self.kind, self.start, end)
            self.counter.add_span("a2a_wait", t0, end)
            if not self.kind.endswith("_grad"):  # a forward's share (straggler naming leaves it out)
                self.counter.add_span("a2a_wait_forward", t0, end)
        self.x = self.work = None
        return self.out


def issue(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
          counter: Optional[CommCounter] = None, kind: str = "all_to_all") -> Inflight:
    """Start the all-to-all of rows x [sum(in_splits), ...] -> [sum(out_splits), ...] (no autograd)."""
    x = x.detach().contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    start = counter.mark() if counter is not None else None
    until = link.deadline(link.now(), offrank_bytes(x, out_splits, in_splits, group)) \
        if link.enabled() else None
    transport = shm_transport(group)
    if transport is not None and x.device.type == "cpu":
        work = _AtCompletion(lambda: transport.all_to_all_single(out, x, out_splits, in_splits))
    else:
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    _count_rows(counter, kind, x, out_splits, in_splits, group)
    return Inflight(x, out, work, counter, kind, start, until)
