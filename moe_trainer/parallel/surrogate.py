"""The scalar an inner pipeline stage's backward runs from (the pipeline executor's and the overlapped
pairs' backward: pipeline.py, overlap.py), and the hand-over of gradients made outside a backward
(the redundant slots' copies', slots.py), in a module of its own so that all import it one way."""
from __future__ import annotations

from typing import Callable, Optional

import torch


class _OutputGradient(torch.autograd.Function):
    """A zero scalar whose gradient with respect to `out` is `grad`: engine.backward takes a scalar loss,
    and an inner stage's backward starts from the next stage's gradient of its output. Its value is
    never read (the losses are summed from the forwards), so none is computed; nothing of (B, T, d)
    is made in either direction: `grad`, the received buffer, is handed back scaled in place."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return out.new_zeros((), dtype=torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, scale: torch.Tensor):
        # scale: d(engine's loss) / d(this), a 0-dim fp32 tensor (1, or fp16's loss scale). grad stays in
        # the activation dtype, as out's gradient must be: the product is exact for 1 and powers of 2
        (grad,) = ctx.saved_tensors
        return grad.mul_(scale), None


def backward_surrogate(out: torch.Tensor, grad: torch.Tensor, aux: Optional[torch.Tensor],
                       micro_batches: int) -> torch.Tensor:
    """The scalar an inner stage's backward runs from: d/d(out) = grad (B, T, d), which consumes the
    buffer, plus this stage's auxiliary loss with the 1/m that grad already carries for the LM loss."""
    loss = _OutputGradient.apply(out, grad)
    return loss if aux is None else loss + aux / micro_batches


def hand_over(engine, grads: list) -> None:
    """Gradients made outside autograd's backward ([(parameter, gradient)], each in its parameter's dtype and
    shape) added to their parameters by one engine.backward (not the accumulation boundary: the caller
    reduces after it), so DeepSpeed's hooks and accumulation take them as they take every gradient. The
    gradients are consumed (scaled in place, by 1)."""
    if grads:
        engine.backward(sum(_OutputGradient.apply(w, g) for w, g in grads), scale_wrt_gas=False)


def reduce_after_backwards(engine, before_reduce: Optional[Callable[[], None]] = None) -> None:
    """The step's gradient reduction once its backwards are done, none of them the accumulation boundary
    (the executors' and the trainer's with redundant slots): `before_reduce` first (the copies' gradients
    to their owners, slots.SlotExperts.hand_back), then the boundary and what DeepSpeed's backward
    epilogue runs at it."""
    if before_reduce is not None:
        before_reduce()
    engine.set_gradient_accumulation_boundary(True)
    engine.allreduce_gradients()
