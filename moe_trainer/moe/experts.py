"""Routed experts with stacked weights: a grouped-GEMM fast path and a loop reference.

Weights follow Hugging Face's layout so checkpoints convert without reshaping:
gate_up_proj (E, 2H, d) and down_proj (E, d, H). Inputs arrive sorted by
expert with per-expert counts; the gate value is multiplied in before the down
projection, so combining is one index_add_.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous
    (torch._grouped_mm's backward rejects expanded/strided gradients)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_available() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # rows of 8 fp32 = 32 bytes: _grouped_mm rejects strides that are not multiples of 16 bytes
        a, b = torch.ones(4, 8), torch.ones(2, 8, 8)
        torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


GROUPED_MM = _grouped_available()


def _aligned(t: torch.Tensor) -> bool:
    """_grouped_mm needs a 16-byte aligned data pointer and row strides that are multiples of 16 bytes."""
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


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
        self._forward = self._grouped if impl == "grouped" and GROUPED_MM else self._split_loop
        if impl == "loop":
            self._forward = self._reference_loop

    def forward(self, x: torch.Tensor, counts: list[int], gate: Optional[torch.Tensor]) -> torch.Tensor:
        """x (M, d) sorted by local expert, counts[e] rows each, gate (M,) or None (the
        dispatcher applies it on combine) -> (M, d) outputs."""
        if x.shape[0] == 0:
            # no tokens: keep the weights in the graph so they get (zero) gradients
            return x + 0.0 * (self.gate_up_proj.sum() + self.down_proj.sum()).to(x.dtype)
        return self._forward(x, counts, gate)

    def _swiglu(self, h: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
        return a if gate is None else a * gate[:, None].to(h.dtype)

    def _grouped(self, x, counts, gate):
        if not (_aligned(x) and _aligned(self.gate_up_proj) and _aligned(self.down_proj)):
            return self._split_loop(x, counts, gate)  # e.g. hidden sizes that are not multiples of 16 bytes
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=offs)  # (M, 2H)
        h = _ContiguousGrad.apply(h)
        a = self._swiglu(h, gate)
        out = torch._grouped_mm(a, self.down_proj.transpose(1, 2), offs=offs)  # (M, d)
        return _ContiguousGrad.apply(out)

    def _split_loop(self, x, counts, gate):
        """Fallback without torch._grouped_mm: one matmul pair per non-empty expert."""
        outs = []
        gates = torch.split(gate, counts) if gate is not None else [None] * len(counts)
        for e, (xe, ge) in enumerate(zip(torch.split(x, counts), gates)):
            if xe.shape[0]:
                h = xe @ self.gate_up_proj[e].t()
                outs.append(self._swiglu(h, ge) @ self.down_proj[e].t())
        return torch.cat(outs)

    def _reference_loop(self, x, counts, gate):
        """The simple reference: SequentialMLP-style, F.linear per expert."""
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                xe = x[start:start + n]
                h = F.linear(xe, self.gate_up_proj[e])
                ge = gate[start:start + n] if gate is not None else None
                out[start:start + n] = F.linear(self._swiglu(h, ge), self.down_proj[e])
            start += n
        return out
