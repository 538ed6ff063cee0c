"""The pipeline executor with fixed, balanced stage costs: the bubble of the schedule and the
transport alone (bench_pp.sh --parts schedule).

A CPU's compute is a poor clock for a pipeline's bubble: on this 2-core machine a chunk's forward
varies by 20% from one micro-batch to the next and from one core to the other, and ranks that share
a core take turns. A GPU's kernels take the same time every time and leave the host free. This part
runs the real PipelineExecutor (its interleaved order, its batches of transfers, PeerExchange over
the shared-memory rings or gloo's batch_isend_irecv, a real process group per rank) on stages whose
forward and backward hold the rank for a fixed time without using a core (a sleep: F = stage
forward / v per chunk, B = 2 F), so the measured bubble is what the schedule and the transfers cost,
next to (p-1)/(v m+p-1). "strict" holds each send until its receiver has taken it (NCCL's rule for
sends larger than its buffers, which activations at scale are).

Measured as in the trainer's trace (pipeline_trace.measured_bubble: 1 - busy / span per rank, the
mean over ranks) for each step after the first; the median and range over the steps.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .turns import free_port

TRANSPORTS = ("shm", "shm-strict", "gloo")


class Hold(torch.autograd.Function):
    """Identity that holds the rank for `forward_s` in forward and `backward_s` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad.clone(), None, None


@dataclass
class HeldOutput:
    loss: torch.Tensor
    losses: dict = field(default_factory=dict)


class HeldStage(nn.Module):
    """What PipelineExecutor needs of a PipelineStage, each chunk one Hold."""

    def __init__(self, stage: int, stages: int, chunks: int, shape: tuple, forward_s: float):
        super().__init__()
        self.chunks = [[f"{c * stages + stage}"] for c in range(chunks)]
        self.first, self.last = stage == 0, stage == stages - 1
        self.start = nn.Parameter(torch.zeros(shape))
        self.forward_s = forward_s

    def is_first(self, chunk: int) -> bool:
        return self.first and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.last and chunk == len(self.chunks) - 1

    def forward(self, carried, input_ids, labels=None, positions=None, chunk: int = 0):
        x = self.start if self.is_first(chunk) else carried
        out = Hold.apply(x, self.forward_s, 2 * self.forward_s)
        if self.is_last(chunk):
            loss = out.float().mean()
            return HeldOutput(loss, {"lm": loss.detach()}), None
        return out, None


class HeldEngine:
    """The DeepSpeed engine's calls the executor makes, without an optimizer."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss, scale_wrt_gas: bool = True):
        loss.backward()

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        pass

    def allreduce_gradients(self) -> None:
        pass

    def step(self) -> None:
        pass


def _worker(rank: int, world: int, port: int, v: int, m: int, transport: str, stage_forward_s: float,
            steps: int, shape: tuple, results) -> None:
    import torch.distributed as dist
    from ..config import Layout
    from ..kernels.cpu.allocator import keep_freed_memory
    from ..kernels.cpu.shm_alltoall import P2P_RING_BYTES
    from ..metrics import StepClock
    from ..parallel.comm import enable_shm_transport
    from ..parallel.mesh import build_mesh
    from ..parallel.pipeline import PipelineExecutor, Trace
    from ..pipeline_trace import measured_bubble

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      MOE_TRAINER_STRICT_P2P="1" if transport == "shm-strict" else "0")
    torch.set_num_threads(1)
    keep_freed_memory()  # as a trainer's CPU rank (train.py): received buffers reuse freed pages
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = build_mesh(Layout(world=world, pp=world, tp=1, cp=1, dp=1, ep=1, edp=1, grad_accum=m), rank)
    if transport.startswith("shm"):
        assert enable_shm_transport(mesh.group("pp"), ring_bytes=P2P_RING_BYTES), "no shared-memory rings here"
    stage = HeldStage(rank, world, v, shape, stage_forward_s / v)
    device = torch.device("cpu")
    clock = StepClock(device)
    trace = Trace(enabled=True)
    executor = PipelineExecutor(HeldEngine(stage), stage, mesh, m, shape, torch.float32, device, trace=trace,
                                clock=clock)
    batch = (torch.zeros(1, 1, dtype=torch.long),) * 2 + (None,)
    bubbles = []
    for _ in range(steps):
        dist.barrier()
        trace.start(clock)
        executor.step(lambda i: batch)
        trace.resolve()
        events = [None] * world
        dist.all_gather_object(events, trace.events)
        bubbles.append(measured_bubble(events))
    dist.barrier()
    if rank == 0:
        results[0] = bubbles
    dist.destroy_process_group()


def run_schedule(pp: int, v: int, m: int, transport: str, stage_forward_s: float, steps: int,
                 shape: tuple = (4, 128, 256)) -> list[float]:
    """Measured bubble of each step (the first included) of `steps` executor steps."""
    import torch.multiprocessing as mp
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(pp, free_port(), v, m, transport, stage_forward_s, steps, shape, results), nprocs=pp,
             join=True)
    return list(results[0])


def bench_schedule(pps: list[int], vs: list[int], ms: list[int], transports: list[str], stage_forward_s: float,
                   steps: int) -> list[dict]:
    """Every (pp, v, m), the transports in turn (their order alternating from one row to the next)."""
    from ..parallel.pipeline import theoretical_bubble
    rows, flip = [], False
    for pp in pps:
        for v in vs:
            for m in ms:
                if v > 1 and m % pp:
                    continue
                row = {"pp": pp, "v": v, "m": m, "theoretical": theoretical_bubble(pp, m, v), "measured": {}}
                for transport in (transports[::-1] if flip else transports):
                    per_step = run_schedule(pp, v, m, transport, stage_forward_s, steps)[1:]
                    row["measured"][transport] = {"median": statistics.median(per_step), "min": min(per_step),
                                                  "max": max(per_step), "steps": per_step}
                flip = not flip
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def schedule_table(rows: list[dict], transports: list[str]) -> str:
    out = ["| pp | v | m | (p-1)/(v m+p-1) | " + " | ".join(f"{t}: measured (range) | {t} / formula"
                                                          for t in transports) + " |",
           "|---|---|---|---|" + "---|---|" * len(transports)]
    for r in rows:
        cells = []
        for t in transports:
            x = r["measured"][t]
            cells.append(f"{100 * x['median']:.1f}% ({100 * x['min']:.1f}-{100 * x['max']:.1f}) | "
                         f"{x['median'] / r['theoretical']:.2f}")
        out.append(f"| {r['pp']} | {r['v']} | {r['m']} | {100 * r['theoretical']:.1f}% | " + " | ".join(cells) + " |")
    return "\n".join(out)
