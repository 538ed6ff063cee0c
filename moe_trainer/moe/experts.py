"""Routed experts with stacked weights: a grouped-GEMM fast path and a loop reference.

Weights follow Hugging Face's layout so checkpoints convert without reshaping:
gate_up_proj (E, 2H, d) and down_proj (E, d, H). Inputs arrive sorted by
expert with per-expert counts; the gate value is multiplied in before the down
projection, so combining is one sum per token.

The fast path is one autograd Function (`GroupedSwiGLUExperts`): forward is two
grouped GEMMs around a SwiGLU computed in place; backward computes every
gradient itself (two grouped GEMMs for the input gradients, two for the weight
gradients straight into the weights' own layout) and recomputes silu from the
saved pre-activation instead of keeping the intermediate tensors autograd would.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


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
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor) -> bool:
    """_grouped_mm needs a 16-byte aligned data pointer and row strides that are multiples of 16 bytes."""
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


# ----------------------------------------------------------------------------- grouped GEMMs

def gmm(a: torch.Tensor, b: torch.Tensor, counts: list[int], offs: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows of a (M, K) in groups of counts[e], each times b[e] (K, N) -> (M, N).
    offs (int32 cumulative counts) selects torch._grouped_mm; None selects a loop of mm."""
    if offs is not None:
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(a[start:start + n], b[e], out=out[start:start + n])
        start += n
    return out


def gmm_wgrad(a: torch.Tensor, b: torch.Tensor, counts: list[int], offs: Optional[torch.Tensor]) -> torch.Tensor:
    """Per group e: a_e^T (P, n_e) @ b_e (n_e, Q) -> (E, P, Q); zero for empty groups."""
    if offs is not None:
        out = torch._grouped_mm(a.t(), b, offs=offs)
        empty = [e for e, n in enumerate(counts) if n == 0]
        if empty:
            out[empty] = 0
        return out
    out = a.new_zeros(len(counts), a.shape[1], b.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(a[start:start + n].t(), b[start:start + n], out=out[e])
        start += n
    return out


# ----------------------------------------------------------------------------- SwiGLU pieces (no autograd)

def swiglu_forward(h: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    """silu(g) * u (* gate) for h = [g | u] (M, 2H), rounding in the same order as
    `F.silu(g) * u * gate[:, None]`; one new (M, H) tensor, no chunk copies."""
    hid = h.shape[-1] // 2
    g, u = h[:, :hid], h[:, hid:]
    a = F.silu(g)
    a.mul_(u)
    if gate is not None:
        a.mul_(gate[:, None].to(a.dtype))
    return a


def swiglu_backward(da: torch.Tensor, h: torch.Tensor, gate: Optional[torch.Tensor], need_gate_grad: bool
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of swiglu_forward: dh (M, 2H), its two halves written in place (no
    concatenation, no other (M, H) temporary), and dgate (M,) in gate's dtype (or None).
    silu(g) is recomputed from h. Overwrites da."""
    hid = h.shape[-1] // 2
    g, u = h[:, :hid], h[:, hid:]
    dh = torch.empty_like(h)
    dg, du = dh[:, :hid], dh[:, hid:]
    torch.ops.aten.silu.out(g, out=du)
    du.mul_(da)  # da * silu(g)
    dgate = None
    if gate is not None:
        gcol = gate[:, None].to(da.dtype)
        if need_gate_grad:  # sum_j da * silu(g) * u (the sum accumulates in fp32 for bf16)
            dgate = torch.linalg.vecdot(du, u).to(gate.dtype)
        du.mul_(gcol)  # d/du = da * gate * silu(g)
        da.mul_(gcol)
    da.mul_(u)  # da * gate * u
    torch.ops.aten.silu_backward.grad_input(da, g, grad_input=dg)  # d/dg
    return dh, dgate


class GroupedSwiGLUExperts(torch.autograd.Function):
    """out = grouped( (silu(x W1g^T) * x W1u^T * gate) W2^T ) over expert groups of rows.

    x (M, d) sorted by expert, w1 (E, 2H, d), w2 (E, d, H), gate (M,) or None,
    counts (host ints), offs (int32 cumsum for torch._grouped_mm, or None for a loop)."""

    @staticmethod
    def forward(ctx, x, w1, w2, gate, counts, offs):
        h = gmm(x, w1.transpose(1, 2), counts, offs)  # (M, 2H)
        a = swiglu_forward(h, gate)  # (M, H), gate applied
        out = gmm(a, w2.transpose(1, 2), counts, offs)  # (M, d)
        ctx.save_for_backward(w1, w2, gate)
        # the large activations are kept as attributes (not saved tensors) so that backward
        # can drop each one as soon as it is used: lower peak memory in backward
        ctx.x, ctx.h, ctx.a = x, h, a
        ctx.counts, ctx.offs = counts, offs
        return out

    @staticmethod
    def backward(ctx, dy):
        w1, w2, gate = ctx.saved_tensors
        counts, offs = ctx.counts, ctx.offs
        need_x, need_w1, need_w2, need_gate = ctx.needs_input_grad[:4]
        dy = dy.contiguous()
        dw2 = gmm_wgrad(dy, ctx.a, counts, offs) if need_w2 else None  # (E, d, H), down_proj's layout
        del ctx.a
        da = gmm(dy, w2, counts, offs)  # (M, H)
        del dy
        dh, dgate = swiglu_backward(da, ctx.h, gate, need_gate and gate is not None)
        del da, ctx.h
        dw1 = gmm_wgrad(dh, ctx.x, counts, offs) if need_w1 else None  # (E, 2H, d), gate_up_proj's layout
        del ctx.x
        dx = gmm(dh, w1, counts, offs) if need_x else None  # (M, d)
        return dx, dw1, dw2, dgate, None, None


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
        x = x.contiguous()
        if not (x.dtype in _GROUPED_DTYPES and _aligned(x) and _aligned(self.gate_up_proj)
                and _aligned(self.down_proj)):
            return self._split_loop(x, counts, gate)  # e.g. hidden sizes that are not multiples of 16 bytes
        offs = torch.tensor(counts, dtype=torch.int64).cumsum_(0).to(device=x.device, dtype=torch.int32)
        return GroupedSwiGLUExperts.apply(x, self.gate_up_proj, self.down_proj, gate, counts, offs)

    def _split_loop(self, x, counts, gate):
        """Fallback without torch._grouped_mm: the same Function with one mm per non-empty expert."""
        return GroupedSwiGLUExperts.apply(x.contiguous(), self.gate_up_proj, self.down_proj, gate, counts, None)

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
