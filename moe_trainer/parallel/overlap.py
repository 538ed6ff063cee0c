"""The overlapped executor (`parallel.overlap: a2a`): one micro-batch's all-to-alls in flight while
another micro-batch computes, at pp = 1; at pp > 1 the pipeline executor runs interleaved 1F1B's
steady pairs with the same generators (StagedPair; see "At pp > 1" below).

Design: Megatron-Core's "combined 1F1B" (its EP A2A overlap), the pairing DualPipe is built on,
with the gradient-accumulation micro-batches as the pair. The forward of micro-batch i + 1 runs
interleaved with the backward of micro-batch i, stage by stage (overlap_model.py cuts a MoE layer
at its dispatch and combine). Each stage ends by issuing its all-to-all asynchronously
(a2a_async.issue) and yields; the other micro-batch's next stage runs; the first one's next stage
starts by waiting for the all-to-all. So each all-to-all, forward or backward, is in flight while
the other micro-batch computes one stage. Micro-batch 0's forward runs alone (nothing to pair it
with), so does the last backward: with m micro-batches, m - 1 pairs. At most two micro-batches'
activations are alive (one more than without overlap, and only while the pair runs).

Why this and not DualPipe: DualPipe pairs the chunks of a bidirectional pipeline and needs pp > 1
and two copies of the model's stages; at pp = 1 the pair is two micro-batches of the same step,
which is exactly combined 1F1B, and it keeps the optimizer step and the gradients as they are.

At pp > 1 (pipeline.py, interleaved 1F1B): in the steady state each backward is paired with the
forward that follows it in the schedule's order (pipeline.schedule_units), another micro-batch's
(or chunk's) on every rank; the pair's forward runs interleaved with the backward through the
chunk's stages (overlap_model.chunk_stage_functions), and its point-to-point transfers go as one
unit: both receives before the pair, both sends after it (deadlock-free under NCCL's rule: the
rendezvous simulation in tests/test_p2p.py). Pairing the forward with the backward after it, as
the interleaved schedule's own units do, would pair the last rank's forward with its own backward.
Warm-up and cool-down run in today's order, each operation alone through the same stages; the pair
keeps one more chunk's activations alive than the schedule does. Plain 1F1B is refused
(resolve.check_overlap): a pair's backward needs the next stage's gradient, which leaves with that
stage's whole pair, whose forward needed this stage's previous pair; so neighbouring stages take
turns and the steady state halves its speed (tests/test_p2p.py's makespan model). Interleaved
1F1B's warm-up runs 2 (p - s - 1) more forwards, which keeps the stages two pairs apart, and its
pairs cost the pipeline nothing. Megatron-Core likewise overlaps the EP all-to-alls at pp > 1 in
its interleaved schedule only (combined 1F1B); DualPipe's bidirectional schedule is not built.

The backward is explicit per stage, in reverse: a stage's outputs (and the tensors it sent) get
their gradients from the next stage's inputs (and, through the reversed all-to-all, from its
received rows), and `engine.backward` runs from a scalar whose gradient is those (the pipeline
executor's backward_surrogate) plus the stage's auxiliary loss / m; the last stage's from the loss.
A stage whose backward ends in an all-to-all (the received rows' gradients going back) runs with the
routed experts' weight gradients held back (kernels/wgrad.py: DualPipe's input-gradient / weight-
gradient split, Megatron-Core's delayed weight-gradient compute): its engine.backward makes the input
gradients only, the all-to-all is issued, and the weight gradients are made while it is in flight,
before the partner's next stage runs; they reach the parameters in the micro-batch's next
engine.backward (a surrogate term each, as the stage outputs' gradients do), so DeepSpeed's hooks see
them as any other. A backward transfer then hides behind its own stage's weight gradients and the
partner's forward stage: without the split it hid behind the forward stage alone, about half as long
as the backward stage a forward transfer hides behind.
Gradients are accumulated into the parameters exactly as one backward per micro-batch would, and the
engine steps as the pipeline executor makes it step (no backward is the accumulation boundary;
allreduce_gradients and the last step() after the last backward), so DeepSpeed's optimizer step is
unchanged. The order of every collective is the schedule's, the same on every rank.

Under train.compile the stages call compiled regions (compile.py: each MoE layer's attention block,
router, routed and shared experts; dense layers, head and loss whole); the all-to-alls this executor
issues and the dispatcher's split-size read stay outside every graph, eager, between the regions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..kernels import wgrad
from ..metrics import StepClock
from .a2a_async import issue
from .overlap_model import stage_functions
from .surrogate import _OutputGradient, reduce_after_backwards


def _leaf(v):
    """A stage's input: a tensor that needs a gradient is cut from the stage before (a new leaf)."""
    if isinstance(v, torch.Tensor) and v.requires_grad:
        return v.detach().requires_grad_()
    if isinstance(v, tuple):
        return tuple(_leaf(t) for t in v)
    return v


def _tensors(d: dict):
    """(key, tensor) of the tensors that need gradients in a stage's inputs or outputs (tuples flattened)."""
    for k, v in d.items():
        for i, t in enumerate(v if isinstance(v, tuple) else (v,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                yield (k, i), t


class _LateGradient(torch.autograd.Function):
    """A zero scalar hung on a row tensor a stage sends, when it is sent, whose gradient with respect to
    it is given at the backward (box[0]): the stage record keeps this handle instead of the rows, so
    they are freed once the all-to-all has them (as the blocking path frees its send buffer), not kept
    until the micro-batch's backward. Its value is never read, as _OutputGradient's."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, box: list) -> torch.Tensor:
        ctx.box = box
        return out.new_zeros((), dtype=torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, scale: torch.Tensor):
        grad = ctx.box.pop()
        return grad.mul_(scale), None


@dataclass
class _Stage:
    inputs: dict
    received: tuple
    outputs: dict = field(default_factory=dict)
    sent: tuple = ()  # per row tensor sent: (its _LateGradient handle, its box), or None (no gradient)
    specs: tuple = ()
    aux: Optional[torch.Tensor] = None


class StagedPair:
    """One micro-batch's forward and backward as generators over its stages, and the loop that runs
    two of them interleaved: what OverlapExecutor (pp = 1) and the pipeline executor's overlapped
    1F1B pairs (pipeline.py, parallel.overlap=a2a at pp > 1) share."""

    def __init__(self, engine, micro_batches: int, group, counter=None, clock: Optional[StepClock] = None):
        self.engine, self.m, self.group, self.counter = engine, micro_batches, group, counter
        self.clock = clock or StepClock()

    # ------------------------------------------------------------------ one micro-batch
    def _forward(self, inputs: dict, out: list, stages: list):
        """Generator: the `stages` (overlap_model's functions) of one forward; yields with an
        all-to-all in flight. Appends the stage records to `out`, then the last stage's "out"."""
        received = ()
        for fn in stages:
            st = _Stage({n: _leaf(v) for n, v in inputs.items()}, received)
            st.outputs, outbound, st.aux = fn(st.inputs, st.received)
            out.append(st)
            if outbound is None:
                break
            sent, st.specs = outbound
            flights = [issue(t, o, i, self.group, self.counter, kind) for t, (o, i, kind) in zip(sent, st.specs)]
            st.sent = tuple((_LateGradient.apply(t, box), box) if t.requires_grad else None
                            for t, box in ((t, []) for t in sent))
            del sent, outbound
            yield
            received = tuple(f.wait().requires_grad_(h is not None) for f, h in zip(flights, st.sent))
            inputs = st.outputs
        out.append(out[-1].outputs["out"])

    def _backward(self, stages: list, seed: Optional[torch.Tensor] = None, input_grads: Optional[dict] = None):
        """Generator: the stages' backwards in reverse; yields with a gradient all-to-all in flight.
        seed: the gradient of the last stage's "out" (a pipeline chunk's output, received from the
        next pipeline stage; it carries the 1/m), or None: the backward starts from the loss.
        input_grads: filled with the first stage's input gradients, {(key, index): gradient}."""
        result = stages.pop()
        grads: dict = {} if seed is None else {("out", 0): seed}  # (key, index) -> gradient of the stage's output
        sent_grads: tuple = ()
        weights: list = []  # (weight, its held-back gradient), handed over by the next engine.backward
        self.engine.set_gradient_accumulation_boundary(False)
        while stages:
            st = stages.pop()
            through = {}
            held = wgrad.held_back(bool(st.received))  # an all-to-all follows: its weight gradients wait for it
            if seed is None and "out" in st.outputs:  # the last stage: from the loss (the engine divides by m)
                with held as queue:
                    self.engine.backward(result.loss)
            else:
                inputs = dict(_tensors(st.inputs))
                terms = []
                for key, t in _tensors(st.outputs):
                    g = grads.get(key)
                    if g is None:
                        continue
                    if inputs.get(key) is t:  # handed through unchanged: its gradient passes by
                        through[key] = g
                    else:
                        terms.append(_OutputGradient.apply(t, g))
                for h, g in zip(st.sent, sent_grads):
                    if h is not None:
                        h[1].append(g)
                        terms.append(h[0])
                if st.aux is not None:
                    terms.append(st.aux / self.m)
                terms += [_OutputGradient.apply(w, g) for w, g in weights]  # the stage after's, held back
                weights = []
                with held as queue:
                    if terms:
                        self.engine.backward(sum(terms[1:], terms[0]), scale_wrt_gas=False)
            grads = {}
            for key, t in _tensors(st.inputs):
                g = t.grad
                if key in through:
                    g = through[key] if g is None else g + through[key]
                grads[key] = g
            if not st.received:
                if input_grads is not None and not stages:
                    input_grads.update(grads)
                continue
            # the received rows' gradients go back the way they came: the sending stage's splits, swapped
            flights = [issue(r.grad if r.grad is not None else torch.zeros_like(r), i, o, self.group, self.counter,
                             kind + "_grad") for r, (o, i, kind) in zip(st.received, stages[-1].specs)]
            del st
            weights = wgrad.weight_grads(queue)  # while the input gradients are in flight
            del queue
            yield
            sent_grads = tuple(f.wait() for f in flights)

    def _timed(self, gen, spans: list):
        """gen's resumptions, each timed into `spans` (clock mark pairs)."""
        while True:
            t0 = self.clock.mark()
            try:
                next(gen)
            except StopIteration:
                spans.append((t0, self.clock.mark()))
                return
            spans.append((t0, self.clock.mark()))
            yield

    @staticmethod
    def _run(*gens) -> None:
        """Resume the generators in turn (the first, then the second, ...) until all are done."""
        live = list(gens)
        while live:
            for g in list(live):
                try:
                    next(g)
                except StopIteration:
                    live.remove(g)


class OverlapExecutor(StagedPair):
    """One optimizer step at pp = 1 with the EP all-to-alls overlapped (see the module's docstring)."""

    def __init__(self, engine, model: nn.Module, micro_batches: int, group, counter=None,
                 clock: Optional[StepClock] = None, recompute: str = "none",
                 before_reduce: Optional[Callable[[], None]] = None):
        """before_reduce: run after the step's last backward, before the gradient reduction (the redundant
        slots' gradients to their owners: slots.SlotExperts.hand_back)."""
        super().__init__(engine, micro_batches, group, counter, clock)
        self.stages = stage_functions(model, recompute)
        self.poison = False
        self.before_reduce = before_reduce

    def _forward_poisoned(self, inputs: dict, out: list):
        yield from self._forward(inputs, out, self.stages)
        if self.poison:
            result = out[-1]
            result.loss, result.losses["lm"] = result.loss * float("nan"), result.losses["lm"] * float("nan")

    # ------------------------------------------------------------------ the step
    def step(self, get_batch: Callable[[int], tuple]) -> tuple[dict, dict]:
        """Every micro-batch's forward and backward, then the gradient reduction and the optimizer step.
        Returns (summed detached losses, {"data": spans, "forward": spans, "backward": spans}): the
        batches' loading, the forward's and the backward's resumptions."""
        sums: dict = {}
        spans = {"data": [], "forward": [], "backward": []}
        records: list = [None] * self.m

        def forward(i):
            t0 = self.clock.mark()
            ids, labels, positions, documents = get_batch(i)
            spans["data"].append((t0, self.clock.mark()))
            records[i] = []
            return self._timed(self._forward_poisoned({"input_ids": ids, "labels": labels, "positions": positions,
                                                       "documents": documents}, records[i]), spans["forward"])

        def backward(i):
            return self._timed(self._backward(records[i]), spans["backward"])

        self._run(forward(0))
        for i in range(self.m):
            out = records[i][-1]
            for k, v in out.losses.items():
                sums[k] = sums.get(k, 0.0) + v.float()
            if i + 1 < self.m:
                self._run(forward(i + 1), backward(i))
                self.engine.step()  # not the boundary: counts the micro-step
            else:
                self._run(backward(i))
            records[i] = None
        reduce_after_backwards(self.engine, self.before_reduce)
        self.engine.step()
        return sums, spans
