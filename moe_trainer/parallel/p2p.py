"""Pipeline point-to-point under NCCL's rules: the plan of transfers (pure) and its execution.

NCCL runs a rank's point-to-point operations in the order they are issued, on one stream per
communicator, and a large send completes only once the peer has posted the matching receive (the
data does not fit its eager buffers). Issued one at a time, 1F1B's steady state deadlocks: stage s
sends activation i+1 and then waits for gradient i, while stage s+1 sends gradient i and then waits
for activation i+1; each send waits for a receive its peer will only post after its own send.

So transfers are posted in batches (`torch.distributed.batch_isend_irecv`, one NCCL group call):
the sends an operation produced go out together with the receives the next operation needs, as
Megatron-Core's send_forward_recv_backward / send_backward_recv_forward do. `comm_plan` turns any
schedule (a list of ("F" | "B", micro-batch) operations) into that sequence of batches; the
rendezvous simulation in tests/test_p2p.py checks every schedule for p <= 8, m <= 16 under the
rule above, and the pipeline parity tests run their ranks with torch.distributed's point-to-point
calls wrapped so that each send completes only after the peer posted its receive.

Collectives that span stages (the optimizer step's gradient-norm all-reduce over the model-parallel
group) are not transfers: the executor runs them only after the step's final sends are posted,
or a stage would wait in the collective for a stage that waits for its send.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

Op = tuple[str, int]  # ("F" | "B", micro-batch index)


@dataclass(frozen=True)
class Transfer:
    """One tensor between neighbouring stages: "act" (forward activations) or "grad" (their gradient)."""

    kind: str
    micro: int
    peer: int  # global rank of the other stage
    send: bool


def needs(op: Op, prev: Optional[int], next_: Optional[int]) -> list[Transfer]:
    """What `op` must receive before it runs: a forward its activations from the previous stage,
    a backward its output gradient from the next stage."""
    kind, i = op
    if kind == "F" and prev is not None:
        return [Transfer("act", i, prev, send=False)]
    if kind == "B" and next_ is not None:
        return [Transfer("grad", i, next_, send=False)]
    return []


def produces(op: Op, prev: Optional[int], next_: Optional[int]) -> list[Transfer]:
    """What `op` sends when it is done: a forward its activations to the next stage, a backward
    the gradient of its input to the previous stage."""
    kind, i = op
    if kind == "F" and next_ is not None:
        return [Transfer("act", i, next_, send=True)]
    if kind == "B" and prev is not None:
        return [Transfer("grad", i, prev, send=True)]
    return []


def comm_plan(ops: list[Op], prev: Optional[int], next_: Optional[int]) -> list[tuple[list[Transfer], Optional[Op]]]:
    """[(batch, op)]: post `batch` (one batch_isend_irecv, waited), then run `op`. A batch holds the
    sends of the previous operation and the receives of this one; the last entry's op is None
    (the final sends). A batch may be empty: PeerExchange.run then does nothing."""
    plan, pending = [], []
    for op in ops:
        plan.append((pending + needs(op, prev, next_), op))
        pending = produces(op, prev, next_)
    plan.append((pending, None))
    return plan


class PeerExchange:
    """Posts a batch of transfers as one batch_isend_irecv and waits for it. On CUDA the wait
    orders the compute stream after the transfers (no host sync); on gloo it blocks the host."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device, counter=None,
                 record: Optional[Callable[[str, int, float, float], None]] = None):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.counter = counter  # a CommCounter: bytes of every send ("pp_send") and receive ("pp_recv")
        self.record = record  # trace hook: (kind, micro, t0, t1) per transfer

    def run(self, batch: list[Transfer], outgoing: dict) -> dict:
        """Sends outgoing[(kind, micro)] for each send of the batch; returns {(kind, micro): tensor}
        of its receives."""
        if not batch:
            return {}
        t0 = time.perf_counter()
        p2p, received = [], {}
        for tr in batch:
            if tr.send:
                t = outgoing.pop((tr.kind, tr.micro)).contiguous()
                p2p.append(dist.P2POp(dist.isend, t, tr.peer))
            else:
                t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                received[(tr.kind, tr.micro)] = t
                p2p.append(dist.P2POp(dist.irecv, t, tr.peer))
        for work in dist.batch_isend_irecv(p2p):
            work.wait()
        t1 = time.perf_counter()
        nbytes = p2p[0].tensor.numel() * p2p[0].tensor.element_size()
        for tr in batch:
            direction = "send" if tr.send else "recv"
            if self.record is not None:
                self.record(f"{direction}_{'fwd' if tr.kind == 'act' else 'bwd'}", tr.micro, t0, t1)
            if self.counter is not None:
                self.counter.add(f"pp_{direction}", nbytes if tr.send else 0, 0 if tr.send else nbytes)
                self.counter.add_time(f"pp_{direction}", t1 - t0)
        return received
