"""Pipeline point-to-point under NCCL's rules: the plan of transfers (pure) and its execution.

NCCL runs a rank's point-to-point operations in the order they are issued, on one stream per
communicator, and a large send completes only once the peer has posted the matching receive (the
data does not fit its eager buffers). Issued one at a time, 1F1B's steady state deadlocks: stage s
sends activation i+1 and then waits for gradient i, while stage s+1 sends gradient i and then waits
for activation i+1; each send waits for a receive its peer will only post after its own send.

So transfers are posted in batches (`torch.distributed.batch_isend_irecv`, one NCCL group call):
the sends an operation produced go out together with the receives the next operation needs, as
Megatron-Core's send_forward_recv_backward / send_backward_recv_forward do. `comm_plan` turns any
schedule (("F" | "B", micro-batch, chunk) operations, grouped into units) into that sequence of
batches. With v chunks per rank (interleaved 1F1B) a chunk's neighbours depend on the chunk: the
last rank's chunk c feeds rank 0's chunk c + 1 (`chunk_peers`). The rendezvous simulation in
tests/test_p2p.py checks every schedule for p <= 8, m <= 16 (and v in 2, 3, 4 with m a multiple
of p) under the rule above, each message landing in the buffer posted for it; the pipeline parity
tests run their ranks with torch.distributed's point-to-point calls wrapped so that each send
completes only after the peer posted its receive.

Collectives that span stages (the optimizer step's gradient-norm all-reduce over the model-parallel
group) are not transfers: the executor runs them only after the step's final sends are posted,
or a stage would wait in the collective for a stage that waits for its send.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..metrics import StepClock

Op = tuple[str, int, int]  # ("F" | "B", micro-batch index, chunk index on this rank)
Peers = list[tuple[Optional[int], Optional[int]]]  # per chunk: (previous, next) global rank or None


@dataclass(frozen=True)
class Transfer:
    """One tensor between neighbouring (virtual) stages: "act" (forward activations) or "grad" (their
    gradient), of one micro-batch, for or from this rank's chunk `chunk`."""

    kind: str
    micro: int
    peer: int  # global rank of the other stage
    send: bool
    chunk: int = 0

    @property
    def key(self) -> tuple:
        return self.kind, self.micro, self.chunk


def chunk_peers(stage: int, stages: int, chunks: int, ranks: list[int]) -> Peers:
    """(previous, next) global rank of each chunk of pipeline rank `stage`. Chunk c is virtual stage
    g = c * stages + stage; its neighbours are virtual stages g - 1 and g + 1, on ranks (g -+ 1) mod
    stages: with chunks > 1, rank 0's chunk c > 0 follows the last rank's chunk c - 1 (the wrap-around)."""
    last = stages * chunks - 1
    out = []
    for c in range(chunks):
        g = c * stages + stage
        out.append((ranks[(g - 1) % stages] if g > 0 else None, ranks[(g + 1) % stages] if g < last else None))
    return out


def needs(op: Op, peers: Peers) -> list[Transfer]:
    """What `op` must receive before it runs: a forward its activations from the previous stage,
    a backward its output gradient from the next stage."""
    return _transfer(op, peers, send=False)


def produces(op: Op, peers: Peers) -> list[Transfer]:
    """What `op` sends when it is done: a forward its activations to the next stage, a backward
    the gradient of its input to the previous stage."""
    return _transfer(op, peers, send=True)


def _transfer(op: Op, peers: Peers, send: bool) -> list[Transfer]:
    """`op`'s one transfer on its sending or receiving side, none at the ends of the pipeline."""
    kind, i, c = op
    prev, next_ = peers[c]
    # activations flow prev -> next, their gradients next -> prev
    source, target = (prev, next_) if kind == "F" else (next_, prev)
    peer = target if send else source
    if peer is None:
        return []
    return [Transfer("act" if kind == "F" else "grad", i, peer, send=send, chunk=c)]


def comm_plan(units: list[list[Op]], peers: Peers) -> list[tuple[list[Transfer], Optional[Op]]]:
    """[(batch, op)]: post `batch` (one batch_isend_irecv, waited), then run `op`. `units`: the
    schedule's operations in order, grouped (pipeline.schedule_units); a batch holds the sends of
    the previous unit and the receives of this one, so a unit's operations after its first get
    an empty batch. The last entry's op is None (the final sends). `peers`: one (previous, next)
    per chunk (`chunk_peers`).

    Units are single operations except in the interleaved schedule's steady state, where a forward
    and the backward after it are one unit: both receives before the pair, both sends after it, as
    Megatron-Core's send_forward_backward_recv_forward_backward. One operation at a time, that
    order deadlocks: rank 0's forward of chunk 0 posts alone the gradient its backward of chunk 1
    just produced, while the last rank first waits to send a gradient that rank 0 will only
    receive after that forward. The price: the forward also waits for the backward's gradient, so
    a slow box holds the ranks it exchanges with (bench.pp.executor_bubble replays it; with equal
    boxes it costs nothing). Posting the backward's receive as a second group right after the
    forward's deadlocks under the rule too (tests/test_p2p.py)."""
    plan, pending = [], []
    for unit in units:
        plan.append((pending + [t for op in unit for t in needs(op, peers)], unit[0]))
        plan += [([], op) for op in unit[1:]]
        pending = [t for op in unit for t in produces(op, peers)]
    plan.append((pending, None))
    return plan


class PeerExchange:
    """Posts a batch of transfers as one batch_isend_irecv and waits for it. On CUDA the wait
    orders the compute stream after the transfers (no host sync); on gloo it blocks the host.

    CPU ranks of one host may pass `transport`, the pipeline group's shared-memory rings
    (kernels/cpu/shm_alltoall.py, `exchange`): the same batch as one call there, matched per pair
    of ranks in the same order, with a memcpy on each side instead of gloo's loopback TCP, whose
    copies and socket calls take the cores that compute. Its sends complete once in the ring
    (gloo's and NCCL's below its buffer size do too); under MOE_TRAINER_STRICT_P2P=1 (the tests)
    only once the receiver took them, NCCL's rule for large ones. `ranks`: the group's global
    ranks in group order."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device, counter=None,
                 record: Optional[Callable] = None, clock=None, transport=None, ranks: Optional[list[int]] = None):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.counter = counter  # a CommCounter: bytes of every send ("pp_send") and receive ("pp_recv")
        self.record = record  # trace hook: (kind, micro, start mark, end mark, chunk) per transfer
        self.clock = clock or StepClock(device)  # marks: CUDA events on a GPU, read after the step's sync
        self.transport = transport if device.type == "cpu" else None
        self.group_rank = {g: i for i, g in enumerate(ranks or [])}
        if self.transport is not None and not self.group_rank:
            raise ValueError("PeerExchange: a shared-memory transport needs the group's ranks")

    def run(self, batch: list[Transfer], outgoing: dict) -> dict:
        """Sends outgoing[transfer.key] for each send of the batch; returns {transfer.key: tensor}
        of its receives (keys: (kind, micro, chunk), the chunk being this rank's)."""
        if not batch:
            return {}
        t0 = self.clock.mark()
        sends, recvs, received = [], [], {}
        for tr in batch:
            if tr.send:
                sends.append((tr.peer, outgoing.pop(tr.key).contiguous()))
            else:
                t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                received[tr.key] = t
                recvs.append((tr.peer, t))
        if self.transport is not None:
            self.transport.exchange([(self.group_rank[peer], t) for peer, t in sends],
                                    [(self.group_rank[peer], t) for peer, t in recvs])
        else:
            p2p = [dist.P2POp(dist.isend, t, peer) for peer, t in sends] + \
                [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs]
            for work in dist.batch_isend_irecv(p2p):
                work.wait()
        t1 = self.clock.mark()
        some = (sends or recvs)[0][1]
        nbytes = some.numel() * some.element_size()
        for tr in batch:
            direction = "send" if tr.send else "recv"
            if self.record is not None:
                self.record(f"{direction}_{'fwd' if tr.kind == 'act' else 'bwd'}", tr.micro, t0, t1, tr.chunk)
            if self.counter is not None:
                self.counter.add(f"pp_{direction}", nbytes if tr.send else 0, 0 if tr.send else nbytes)
                self.counter.add_span(f"pp_{direction}", t0, t1)
        return received
