"""Routed experts with stacked weights: a grouped-GEMM fast path and a loop reference.

Weights follow Hugging Face's layout so checkpoints convert without reshaping:
gate_up_proj (E, 2H, d) and down_proj (E, d, H). Inputs arrive sorted by
expert with per-expert counts; the gate value is multiplied in before the down
projection, so combining is one index_add_.
"""
from __future__ import annotations

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
        a, b = torch.ones(2, 2), torch.ones(1, 2, 2)
        torch._grouped_mm(a, b, offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


GROUPED_MM = _grouped_available()


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

    def forward(self, x: torch.Tensor, counts: list[int], gate: torch.Tensor) -> torch.Tensor:
        """x (M, d) sorted by local expert, counts[e] rows each, gate (M,) -> (M, d) gated outputs."""
        if x.shape[0] == 0:
            # no tokens: keep the weights in the graph so they get (zero) gradients
            return x + 0.0 * (self.gate_up_proj.sum() + self.down_proj.sum()).to(x.dtype)
        return self._forward(x, counts, gate)

    def _swiglu(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return F.silu(g) * u * gate[:, None].to(h.dtype)

    def _grouped(self, x, counts, gate):
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=offs)  # (M, 2H)
        h = _ContiguousGrad.apply(h)
        a = self._swiglu(h, gate)
        out = torch._grouped_mm(a, self.down_proj.transpose(1, 2), offs=offs)  # (M, d)
        return _ContiguousGrad.apply(out)

    def _split_loop(self, x, counts, gate):
        """Fallback without torch._grouped_mm: one matmul pair per non-empty expert."""
        outs = []
        for e, (xe, ge) in enumerate(zip(torch.split(x, counts), torch.split(gate, counts))):
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
                out[start:start + n] = F.linear(self._swiglu(h, gate[start:start + n]), self.down_proj[e])
            start += n
        return out
