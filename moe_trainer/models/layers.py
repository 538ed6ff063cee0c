"""Building blocks shared by both architectures: RMSNorm, RoPE variants, SwiGLU.

Plain single-device PyTorch; no process groups here.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype before the gain.

    On a CPU (fp32 or bf16, weight in the input's dtype) one fused C++ pass each way
    (cpu_kernels.py, FusedRMSNorm) replaces the seven ops below and their backward."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.ops_for(x, self.weight) is not None:  # also requires weight in x's dtype
            return FusedRMSNorm.apply(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm.forward by the fused CPU kernel; saves x and the per-row 1/rms (fp32)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = cpu_kernels.kernels().rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = cpu_kernels.kernels().rms_norm_backward(dy.contiguous(), x, weight, rstd)
        return dx, dw.to(weight.dtype), None


class Linear(nn.Linear):
    """nn.Linear (same parameters, state dict and init) whose fp32 GEMMs on a CPU go through
    oneDNN's matmul (OneDNNLinear) when cpu_kernels.onednn_linear_enabled() and the GEMM has at
    least cpu_kernels.ONEDNN_MIN_MACS multiply-adds; everywhere else (GPUs, bf16, small GEMMs,
    oneDNN off) it is F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.weight.dtype == torch.float32 and x.numel():
            min_macs = cpu_kernels.onednn_min_macs()
            if 0 <= min_macs <= x.numel() * self.out_features:
                return OneDNNLinear.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


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
        return cpu_kernels.onednn_linear(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = cpu_kernels.onednn_linear(dy2, weight.t()).view(ctx.shape) if ctx.needs_input_grad[0] else None
        dw = dy2.t().mm(x2) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense FFN of Llama 3 and DeepSeek-V3."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    @staticmethod
    def act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """silu(g) * u: the activation that selective recomputation re-runs (fused on CPU)."""
        if g.shape == u.shape and cpu_kernels.ops_for(g, u) is not None:
            return SiluMul.apply(g, u)
        return F.silu(g) * u


class SiluMul(torch.autograd.Function):
    """silu(g) * u by the fused CPU kernel (cpu_kernels.py), fp32 maths rounded once; saves g and u
    only (autograd's F.silu(g) * u also keeps silu(g))."""

    @staticmethod
    def forward(ctx, g, u):
        g2, u2 = g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1])
        ctx.save_for_backward(g2, u2)
        ctx.shape = g.shape
        return cpu_kernels.kernels().silu_mul_forward(g2, u2).view(g.shape)

    @staticmethod
    def backward(ctx, da):
        g2, u2 = ctx.saved_tensors
        dg, du = cpu_kernels.kernels().silu_mul_backward(da.reshape(g2.shape).contiguous(), g2, u2)
        return dg.view(ctx.shape), du.view(ctx.shape)


# ----------------------------------------------------------------------------- RoPE

def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, theta: float, scaling: Optional[dict], max_position_embeddings: int
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale for a RoPE variant.

    Variants follow the published recipes (and Hugging Face's rope_parameters):
    default, YaRN (DeepSeek-V3's long-context extension), llama3 (Llama 3.1).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling.get("factor", 1.0))
    original = int(scaling.get("original_max_position_embeddings", max_position_embeddings))
    if kind == "llama3":
        low_wavelen = original / scaling.get("low_freq_factor", 1.0)
        high_wavelen = original / scaling.get("high_freq_factor", 4.0)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        # smooth interpolation between the two regimes
        smooth = (original / wavelen - scaling.get("low_freq_factor", 1.0)) / (
            scaling.get("high_freq_factor", 4.0) - scaling.get("low_freq_factor", 1.0))
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    interpolated = 1.0 / (factor * pos_freqs)  # not inv_freq / factor: bit for bit as transformers
    inv_freq = interpolated * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(head_dim: int, scaling: Optional[dict]) -> float:
    """DeepSeek's softmax scale: 1/sqrt(d) times mscale^2 when YaRN's mscale_all_dim is set."""
    scale = head_dim ** -0.5
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        mscale_all = scaling.get("mscale_all_dim", 0)
        if mscale_all:
            m = _yarn_mscale(scaling["factor"], mscale_all)
            scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; both [T, dim] in the model dtype."""

    def __init__(self, dim: int, theta: float, scaling: Optional[dict], max_position_embeddings: int):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(dim, theta, scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]  # (T, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x (B, H, T, D) by cos/sin (T, D).

    `interleaved` rotates the pairs (x0, x1), (x2, x3), ... (DeepSeek's weight
    layout) and returns them de-interleaved (evens then odds), which leaves the
    q.k dot products unchanged since q and k are permuted alike.
    """
    if interleaved:
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return x * cos + rotate_half(x) * sin


# Explicit-scores attention is used on CPUs up to this many score elements
# (B x H x T x S): there the fused SDPA kernels are 2-4x slower in bf16.
EXPLICIT_ATTENTION_MAX_SCORES = 1 << 28


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention, (B, H, T, Dqk) x (B, H, S, Dqk) x (B, H, S, Dv) -> (B, H, T, Dv).

    Query i attends to keys 0..i (SDPA's is_causal). On accelerators this is
    torch's fused SDPA. On a CPU its flash kernel reaches ~70 GFLOP/s in bf16
    (and MLA's v_head_dim != qk head dim sends it to the unfused math kernel),
    while three batched GEMMs around one softmax reach ~10x that, so CPUs use
    ExplicitCausalAttention while the saved probabilities fit the budget.
    """
    if q.device.type == "cpu" and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= EXPLICIT_ATTENTION_MAX_SCORES:
        return ExplicitCausalAttention.apply(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


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
    ops = cpu_kernels.kernels()
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
        ops = cpu_kernels.ops_for(q3.new_empty(0)) if t == s and scale > 0 else None
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
            ops, t = cpu_kernels.kernels(), q3.shape[1]
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
