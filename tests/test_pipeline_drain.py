"""The pipeline's drain: each stage posts its last input gradient before it reduces its gradients, so
the stage before never waits for that reduction (the stages' reductions overlap the drain instead of
adding up); and the backward surrogate makes no (B, T, d) copy of the activations or their gradient."""
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import spawn_ranks
from moe_trainer.bench.pp_schedule import HeldEngine, HeldStage
from moe_trainer.parallel.surrogate import backward_surrogate

REDUCE_S = 0.4  # every stage's fake reduction holds its rank this long
SHAPE = (2, 8, 16)  # (B, T, d) carried between stages


class ReducingEngine(HeldEngine):
    """HeldEngine with DeepSpeed ZeRO-1's rule for where the gradient reduction runs: in backward()'s
    epilogue when the accumulation boundary is set, or in allreduce_gradients() at the boundary. The
    reduction holds the rank for `reduce_s`; every call is recorded with the host clock (perf_counter:
    one monotonic clock for every process of the host, so ranks' times compare)."""

    def __init__(self, module, reduce_s: float):
        super().__init__(module)
        self.reduce_s, self.boundary, self.calls = reduce_s, False, []

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self.boundary = boundary

    def backward(self, loss, scale_wrt_gas: bool = True):
        loss.backward()
        self.calls.append(("backward", self.boundary))
        if self.boundary:
            self._reduce()

    def allreduce_gradients(self) -> None:
        if self.boundary:
            self._reduce()

    def _reduce(self) -> None:
        t0 = time.perf_counter()
        time.sleep(self.reduce_s)
        self.calls.append(("reduce", t0, time.perf_counter()))

    def step(self) -> None:
        self.calls.append(("step", self.boundary))


CASES = [("1f1b", 1), ("1f1b", 2), ("gpipe", 1)]  # (schedule, chunks per rank)


def _drain_worker(rank, world, port, m, transport, results):
    import os
    from moe_trainer.config import Layout
    from moe_trainer.kernels.cpu.shm_alltoall import P2P_RING_BYTES
    from moe_trainer.metrics import StepClock
    from moe_trainer.parallel.comm import enable_shm_transport
    from moe_trainer.parallel.mesh import build_mesh
    from moe_trainer.parallel.pipeline import PipelineExecutor, Trace

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if transport == "gloo":  # batch_isend_irecv held to NCCL's rule; the rings keep it under STRICT_P2P
        import nccl_p2p_rule
        nccl_p2p_rule.install(timeout_s=30)
    else:
        os.environ["MOE_TRAINER_STRICT_P2P"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = build_mesh(Layout(world=world, pp=world, tp=1, cp=1, dp=1, ep=1, edp=1, grad_accum=m), rank)
    if transport == "shm":
        assert enable_shm_transport(mesh.group("pp"), ring_bytes=P2P_RING_BYTES), "no shared-memory rings here"
    device, clock = torch.device("cpu"), StepClock()
    batch = (torch.zeros(1, 1, dtype=torch.long),) * 2 + (None,)
    out = {}
    for schedule, v in CASES:
        stage = HeldStage(rank, world, v, SHAPE, 0.01 / v)
        engine = ReducingEngine(stage, REDUCE_S)
        trace = Trace(enabled=True)
        executor = PipelineExecutor(engine, stage, mesh, m, SHAPE, torch.float32, device, schedule=schedule,
                                    trace=trace, clock=clock)
        dist.barrier()
        trace.start(clock)
        executor.step(lambda i: batch)
        trace.resolve()
        # absolute host times, comparable across ranks
        events = [dict(e, start=trace.origin + e["start"], end=trace.origin + e["end"]) for e in trace.events]
        grad = stage.start.grad.clone() if stage.first else None
        out[(schedule, v)] = (engine.calls, events, grad)
    dist.barrier()
    results[rank] = out
    dist.destroy_process_group()


@pytest.mark.parametrize("world,m,transport", [(2, 4, "gloo"), (3, 3, "shm")])
def test_the_last_gradient_leaves_before_the_reduction(world, m, transport):
    res = spawn_ranks(_drain_worker, world, m, transport)
    for case in CASES:
        reduce_end = {}
        for s in range(world):
            calls, events, grad = res[s][case]
            # the reduction never runs inside a backward: once per step, after every backward, then the step
            assert ("backward", True) not in calls, (case, s, calls)
            reduces = [i for i, c in enumerate(calls) if c[0] == "reduce"]
            assert len(reduces) == 1 and reduces[0] == len(calls) - 2, (case, s, calls)
            assert calls[-1] == ("step", True), (case, s, calls)
            assert sum(c[0] == "backward" for c in calls) == m * case[1]
            _, t0, reduce_end[s] = calls[reduces[0]]
            # ... and after this rank's last gradient send (posted and done) on every stage that sends one
            sends = [e for e in events if e["kind"] == "send_bwd"]
            if s > 0:
                assert max(e["end"] for e in sends) <= t0, (case, s)
            assert max(e["end"] for e in events if e["kind"] == "backward") <= t0, (case, s)
            assert [e["kind"] for e in events].count("reduce") == 1
            if grad is not None:  # Hold is the identity and the loss a mean: d loss / d start = m / numel
                assert torch.allclose(grad, torch.full(SHAPE, m / grad.numel())), (case, grad.flatten()[:4])
        # the stage before got its last gradient before this stage's reduction was over: it did not wait
        # for it (before this order it waited for every later stage's reduction, one after the other)
        for s in range(1, world):
            got = max(e["end"] for e in res[s - 1][case][1] if e["kind"] == "recv_bwd")
            assert got < reduce_end[s] - REDUCE_S / 2, (case, s, got, reduce_end[s])


# ----------------------------------------------------------------------------- the surrogate's allocations

class FreshTensors(TorchDispatchMode):
    """(op, dtype) of every operator output with `numel` elements in storage of its own (not a view or an
    in-place result of an input): the (B, T, d) allocations made while the mode is on."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and \
                    t.untyped_storage().data_ptr() not in inputs:
                self.made.append((str(func), t.dtype))
        return out


def _output_and_grad(dtype):
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=dtype, requires_grad=True)
    return x * 2, torch.randn(SHAPE, dtype=dtype)  # out: (B, T, d), a non-leaf as a stage's output is


def _old_surrogate(out, grad, aux, m):
    """The surrogate before this change (the reference for values and allocations)."""
    s = (out.float() * grad.float()).sum()
    return s + aux / m if aux is not None else s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_backward_surrogate_makes_no_activation_sized_copy(dtype):
    counts, grads = {}, {}
    for name, fn in (("old", _old_surrogate), ("new", backward_surrogate)):
        out, grad = _output_and_grad(dtype)
        w = torch.tensor([0.5, -1.0], requires_grad=True)
        aux = (w ** 2).sum()  # a stage's auxiliary loss
        with FreshTensors(out.numel()) as mode:
            loss = fn(out, grad, aux, 4)
            g_out, g_w = torch.autograd.grad(loss, [out, w])
        counts[name], grads[name] = mode.made, (g_out, g_w)
    fp32 = [d for _, d in counts["old"] if d == torch.float32]
    assert len(fp32) >= 2, counts["old"]  # the counter sees the old fp32 copies (out.float(), grad.float(), ...)
    assert counts["new"] == [], counts["new"]
    g_new, g_old = grads["new"], grads["old"]
    _, grad = _output_and_grad(dtype)
    assert g_new[0].dtype == dtype and torch.equal(g_new[0], grad)  # d loss / d out = the received gradient
    assert torch.equal(g_new[0], g_old[0]) and torch.allclose(g_new[1], g_old[1])
    assert torch.allclose(g_new[1], torch.tensor([0.5, -1.0]) * 2 / 4)  # the aux loss carries 1/m
