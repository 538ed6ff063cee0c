"""Building blocks shared by both architectures: RMSNorm, Linear, SwiGLU, RoPE, causal attention.

Plain single-device PyTorch; no process groups here. Each module takes the kernel back end
(moe_trainer.kernels) when it is built and hands its maths off to it in one line: the
device-generic accelerator path (what GPUs run), the CPU back end, or the plain reference.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .. import kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype before the gain (Hugging Face's order)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels.backend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear (same parameters, state dict and init) whose GEMM is the kernel back end's
    (F.linear, or oneDNN's matmul for large fp32 GEMMs on CPU ranks)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.kernels = kernels.backend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense FFN of Llama 3 and DeepSeek-V3."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.kernels = self.gate_proj.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """silu(g) * u: the activation that selective recomputation re-runs."""
        return self.kernels.silu_mul(g, u)


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
    """cos/sin tables for positions in the model dtype."""

    def __init__(self, dim: int, theta: float, scaling: Optional[dict], max_position_embeddings: int):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(dim, theta, scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) or, restarting at each document, (B, T) -> cos, sin (T, dim) or (B, T, dim)."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # (T, dim/2) or (B, T, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x (B, H, T, D) by cos/sin (T, D) or (B, 1, T, D).

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




def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     backend: Optional["kernels.Backend"] = None) -> torch.Tensor:
    """Causal softmax attention: query i attends to keys 0..i.
    (B, H, T, Dqk) x (B, Hkv, S, Dqk) x (B, Hkv, S, Dv) -> (B, H, T, Dv); Hkv divides H (grouped-query
    attention: each k/v head serves H / Hkv query heads); Dv may differ from Dqk (MLA)."""
    return (backend or kernels.backend()).causal_attention(q, k, v, scale)


class DocumentAttention:
    """(q, k, v, scale, documents) -> causal attention inside documents (data.document_mask):
    documents (B, T) int32 are the tokens' document ids, queries and keys the same T tokens.
    Context parallelism swaps in its own (parallel/context.py), whose keys are the whole sequence."""

    def __init__(self, backend: "kernels.Backend"):
        self.kernels = backend

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 documents: torch.Tensor) -> torch.Tensor:
        return self.kernels.document_attention(q, k, v, scale, documents, documents)
