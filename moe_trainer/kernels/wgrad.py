"""Weight gradients held back: the input-gradient / weight-gradient split of a backward (DualPipe's
"B" and "W", Megatron-Core's delayed weight-gradient compute in its combined 1F1B).

Inside `held_back()`, the routed experts' backward (every back end's grouped kernel) computes the
input gradients only and queues how to make its weight gradients, from tensors it has already
(the rows, the pre-activation gradient, the activation); `weight_grads(queue)` makes them later. The
overlapped executor (parallel/overlap.py) runs a stage's backward held back, issues the all-to-all
of the input gradients at once, and makes the weight gradients while that all-to-all is in flight:
a backward transfer then hides behind its own stage's weight gradients as well as behind the
partner micro-batch's next stage. The arithmetic is the same ops on the same tensors in another
order, so the gradients are bit for bit those of the plain backward.

The weight gradients are handed to the parameters by the executor, inside its next engine.backward
(a surrogate whose gradient with respect to each weight is its held-back gradient), so DeepSpeed's
hooks and accumulation see them as they see every other gradient. Only leaf weights are held back
(a weight made by an op, such as the slot-owned experts' gathered rows, would need that op's graph
alive for the later hand-over): anything else computes its weight gradients at once.

Outside `held_back()` nothing changes. The queue is a module global, not thread-local: on CUDA the
autograd engine runs the backward on its device thread while the caller waits in engine.backward.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch

_QUEUE: Optional[list] = None


@contextmanager
def held_back(on: bool = True) -> Iterator[Optional[list]]:
    """While inside (and `on`), the kernels queue their weight gradients into the yielded list."""
    global _QUEUE
    if not on:
        yield None
        return
    outer, _QUEUE = _QUEUE, []
    try:
        yield _QUEUE
    finally:
        _QUEUE = outer


def hold(weights: Sequence[torch.Tensor], make: Callable[[], Sequence[torch.Tensor]]) -> bool:
    """Queue `make` (-> the gradients of `weights`, in order) if weight gradients are held back here
    and every weight is a leaf; False: the caller computes them now. Never inside a compiled graph
    (train.compile: the overlapped stages' routed experts, compile.py): its backward is one graph, traced
    once, and a traced read of the queue would be a guard whose failure, when full recomputation re-runs
    the region inside a held-back backward, recompiles it with other saved tensors than the forward's."""
    if torch.compiler.is_compiling() or _QUEUE is None or not all(w.is_leaf for w in weights):
        return False
    _QUEUE.append((tuple(weights), make))
    return True


def weight_grads(queue: Optional[list]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Make the queued weight gradients: [(weight, its gradient)]."""
    out = []
    with torch.no_grad():
        for weights, make in queue or ():
            out.extend(zip(weights, make()))
    return out
