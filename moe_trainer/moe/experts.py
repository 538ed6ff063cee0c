"""Routed experts with stacked weights.

Weights follow Hugging Face's layout so checkpoints convert without reshaping:
gate_up_proj (E, 2H, d) and down_proj (E, d, H). Inputs arrive sorted by
expert with per-expert counts (an int64 tensor on the inputs' device); the gate
value is multiplied in before the down projection, so combining is one sum per
token. The maths is the kernel back end's (moe_trainer.kernels): one grouped GEMM
per expert GEMM on the accelerator path, CPU-shaped paths on CPU ranks, and the
loop over experts (Megatron's SequentialMLP) as the reference (`impl="loop"`).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .. import kernels


class Experts(nn.Module):
    """`n_local` SwiGLU experts; global ids [expert_offset, expert_offset + n_local)."""

    def __init__(self, n_local: int, hidden_size: int, intermediate_size: int, impl: str = "grouped",
                 expert_offset: int = 0):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_local, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n_local, hidden_size, intermediate_size))
        self.n_local, self.intermediate_size = n_local, intermediate_size
        self.expert_offset = expert_offset
        self.impl = impl
        # compiled as a region of its own (compile.py, parallel.overlap=a2a): MoE marks the rows' count an
        # unbacked size, since it changes every call and may be 0 (or 1), which a backed size would
        # specialise on and recompile for
        self.rows_unbacked = False
        if impl == "loop":
            from ..kernels.reference import ReferenceBackend
            self.kernels = ReferenceBackend()
        else:
            self.kernels = kernels.backend()

    def forward(self, x: torch.Tensor, counts: Union[torch.Tensor, Sequence[int]],
                gate: Optional[torch.Tensor]) -> torch.Tensor:
        """x (M, d) sorted by local expert, counts (n_local,) int64 rows each (on x's device; host
        ints are copied there), gate (M,) or None (the dispatcher applies it on combine) -> (M, d)."""
        if not isinstance(counts, torch.Tensor):
            counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
        rows = x.shape[0]
        if torch.compiler.is_compiling() and not guard_or_false(rows > 0):
            # torch.compile at ep > 1: the rows received are an unbacked size that may be 0, which
            # the grouped GEMM refuses; one zero row after the last group (no group reads it, and
            # it is cut off) keeps the graph whole, where eager would branch
            pad = x.new_zeros(1, x.shape[1])
            gate = torch.cat([gate, gate.new_zeros(1)]) if gate is not None else None
            return self.kernels.experts(torch.cat([x, pad]), self.gate_up_proj, self.down_proj, gate, counts)[:rows]
        if rows == 0:
            # no tokens: keep the weights in the graph so they get (zero) gradients
            return x + 0.0 * (self.gate_up_proj.sum() + self.down_proj.sum()).to(x.dtype)
        return self.kernels.experts(x, self.gate_up_proj, self.down_proj, gate, counts)
