"""CPU versions of the dense layers' maths: fused RMSNorm and SiLU-multiply (one C++ pass each
way), fp32 GEMMs through oneDNN's matmul, and causal attention with explicit scores (blocked
GEMMs that skip the masked tiles, a fused causal softmax; one kernel call per step in fp32).

Each is an autograd Function equal to the plain torch ops up to float rounding
(tests/test_cpu_kernels.py, tests/test_moe_kernels.py); the CPU back end (kernels/cpu/__init__.py)
picks them for contiguous CPU tensors and hands everything else to the accelerator path.
"""
from __future__ import annotations

import torch

from . import extension


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm.forward by the fused CPU kernel; saves x and the per-row 1/rms (fp32)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = extension.kernels().rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = extension.kernels().rms_norm_backward(dy.contiguous(), x, weight, rstd)
        return dx, dw.to(weight.dtype), None



class OneDNNLinear(torch.autograd.Function):
    """F.linear by oneDNN in fp32: the output and the input gradient (dY W) by its matmul, the
    weight gradient (dY^T X, a reduction over the tokens) by torch.mm, which measured as fast or
    faster there (cpu_kernels.onednn_linear_enabled). Equal to F.linear up to float rounding
    (tests/test_moe_kernels.py)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.shape, ctx.has_bias = x.shape, bias is not None
        return extension.onednn_linear(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = extension.onednn_linear(dy2, weight.t()).view(ctx.shape) if ctx.needs_input_grad[0] else None
        dw = dy2.t().mm(x2) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db



class SiluMul(torch.autograd.Function):
    """silu(g) * u by the fused CPU kernel (cpu_kernels.py), fp32 maths rounded once; saves g and u
    only (autograd's F.silu(g) * u also keeps silu(g))."""

    @staticmethod
    def forward(ctx, g, u):
        g2, u2 = g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1])
        ctx.save_for_backward(g2, u2)
        ctx.shape = g.shape
        return extension.kernels().silu_mul_forward(g2, u2).view(g.shape)

    @staticmethod
    def backward(ctx, da):
        g2, u2 = ctx.saved_tensors
        dg, du = extension.kernels().silu_mul_backward(da.reshape(g2.shape).contiguous(), g2, u2)
        return dg.view(ctx.shape), du.view(ctx.shape)



# Explicit-scores attention is used on CPUs up to this many score elements
# (B x H x T x S): there the fused SDPA kernels are 2-4x slower in bf16.
EXPLICIT_ATTENTION_MAX_SCORES = 1 << 28


_CAUSAL_MASKS: dict = {}


def causal_mask(t: int, s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(T, S) additive mask: 0 where query i may see key j (j <= i), -inf elsewhere. Cached."""
    key = (t, s, dtype, device)
    if key not in _CAUSAL_MASKS:
        _CAUSAL_MASKS[key] = torch.full((t, s), float("-inf"), dtype=dtype, device=device).triu_(1)
    return _CAUSAL_MASKS[key]


# Query/key blocks of the fused causal path: the GEMMs skip the score tiles above the
# diagonal blocks, (nb + 1) / (2 nb) of the full work for nb blocks. Smaller blocks skip more
# but run smaller GEMMs; measured best on 2 cores at T = 256-1024: 128 rows in fp32, 256 in bf16
# (bf16 GEMMs are ~5x faster, so per-block costs weigh more).
CAUSAL_BLOCK_ROWS = {torch.float32: 128, torch.bfloat16: 256}
# fp32 through the fused kernel (one task per batch x head, cpu_kernels.cpp): its GEMMs cost
# little per call, so smaller blocks skip more of the masked tiles; measured on 2 cores.
FUSED_CAUSAL_BLOCK_ROWS = 64


def fused_attention_ops(q: torch.Tensor):
    """The kernels when the fp32 attention kernel takes q's dtype and device (and found a BLAS)."""
    if q.dtype != torch.float32 or q.device.type != "cpu":
        return None
    ops = extension.kernels()
    return ops if ops is not None and hasattr(ops, "has_blas") and ops.has_blas() else None


def causal_blocks(t: int, block: int) -> list[tuple[int, int]]:
    """[(r0, r1)] splitting t rows into ceil(t / block) near-equal blocks."""
    nb = max(1, -(-t // block))
    bounds = [t * i // nb for i in range(nb + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class ExplicitCausalAttention(torch.autograd.Function):
    """softmax(scale * q k^T + causal mask) v with the probabilities saved for backward.

    Forward: one baddbmm (mask added in the GEMM), softmax, one bmm. Backward:
    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = scale dS K,
    dK = scale dS^T Q. The softmax runs in float32 inside its kernel whatever
    the input dtype.

    On a CPU (T == S, fp32 or bf16) the fused path splits queries and keys into
    blocks of about CAUSAL_BLOCK_ROWS: every GEMM skips the tiles above the diagonal,
    and the fused causal softmax (cpu_kernels.py) replaces the mask, the softmax
    and the scaling of dQ and dK. Query block b keeps its probabilities against
    keys [0, end of b); dK and dV sum the blocks' contributions in fp32. In fp32 one
    kernel call does all of it (cpu_kernels.cpp: causal_attention_forward/backward),
    a (batch, head) per task on one thread. Checked against
    F.scaled_dot_product_attention in tests/test_models.py and against the
    torch-op path in tests/test_cpu_kernels.py.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale):
        b, h, t, d = q.shape
        s = k.shape[2]
        q3, k3, v3 = q.reshape(b * h, t, d), k.reshape(b * h, s, d), v.reshape(b * h, s, v.shape[-1])
        # the fused path depends only on device and dtype (every tensor it touches is made here)
        ops = extension.ops_for(q3.new_empty(0)) if t == s and scale > 0 else None
        whole = fused_attention_ops(q3) if ops is not None else None
        ctx.scale, ctx.bh, ctx.fused, ctx.whole = scale, (b, h), ops is not None, whole
        if whole is not None:
            q3, k3, v3 = q3.contiguous(), k3.contiguous(), v3.contiguous()
            out, probs = whole.causal_attention_forward(q3, k3, v3, scale, FUSED_CAUSAL_BLOCK_ROWS)
            ctx.save_for_backward(q3, k3, v3, probs)
            return out.view(b, h, t, v.shape[-1])
        if ops is None:
            scores = torch.baddbmm(causal_mask(t, s, q.dtype, q.device), q3, k3.transpose(1, 2), alpha=scale)
            probs = torch.softmax(scores, dim=-1)
            del scores
            ctx.save_for_backward(q3, k3, v3, probs)
            return torch.bmm(probs, v3).view(b, h, t, v.shape[-1])
        out, probs = [], []
        for r0, r1 in causal_blocks(t, CAUSAL_BLOCK_ROWS[q.dtype]):  # query block r0..r1 sees keys 0..r1
            p = ops.causal_softmax_forward_(torch.bmm(q3[:, r0:r1], k3[:, :r1].transpose(1, 2)), scale, r0)
            out.append(torch.bmm(p, v3[:, :r1]))
            probs.append(p)
        ctx.save_for_backward(q3, k3, v3, *probs)
        return torch.cat(out, dim=1).view(b, h, t, v.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        q3, k3, v3, *probs = ctx.saved_tensors
        b, h = ctx.bh
        g3 = grad_out.reshape(b * h, grad_out.shape[2], grad_out.shape[3])
        if ctx.whole is not None:
            dq, dk, dv = ctx.whole.causal_attention_backward(g3.contiguous(), q3, k3, v3, probs[0], ctx.scale,
                                                             FUSED_CAUSAL_BLOCK_ROWS)
        elif ctx.fused:
            ops, t = extension.kernels(), q3.shape[1]
            blocks = causal_blocks(t, CAUSAL_BLOCK_ROWS[q3.dtype])
            if len(blocks) == 1:
                (p,) = probs
                dv = torch.bmm(p.transpose(1, 2), g3)
                ds = ops.causal_softmax_backward_(torch.bmm(g3, v3.transpose(1, 2)), p, ctx.scale, 0)
                dq, dk = torch.bmm(ds, k3), torch.bmm(ds.transpose(1, 2), q3)
            else:  # dK and dV sum over query blocks, in fp32 (in bf16 each block's GEMM rounds once)
                dk, dv = k3.new_zeros(k3.shape, dtype=torch.float32), v3.new_zeros(v3.shape, dtype=torch.float32)
                dq = []
                for (r0, r1), p in zip(blocks, probs):
                    g = g3[:, r0:r1]
                    dv[:, :r1] += torch.bmm(p.transpose(1, 2), g)
                    ds = ops.causal_softmax_backward_(torch.bmm(g, v3[:, :r1].transpose(1, 2)), p, ctx.scale, r0)
                    dq.append(torch.bmm(ds, k3[:, :r1]))
                    dk[:, :r1] += torch.bmm(ds.transpose(1, 2), q3[:, r0:r1])
                dq, dk, dv = torch.cat(dq, dim=1), dk.to(k3.dtype), dv.to(v3.dtype)
        else:
            (probs,) = probs
            dv = torch.bmm(probs.transpose(1, 2), g3)
            dscores = torch._softmax_backward_data(torch.bmm(g3, v3.transpose(1, 2)), probs, -1, probs.dtype)
            dq = torch.bmm(dscores, k3).mul_(ctx.scale)
            dk = torch.bmm(dscores.transpose(1, 2), q3).mul_(ctx.scale)
        return dq.view(b, h, *dq.shape[1:]), dk.view(b, h, *dk.shape[1:]), dv.view(b, h, *dv.shape[1:]), None
