"""Rotary position embeddings: the frequency tables of each RoPE variant (default, YaRN, llama3),
DeepSeek's YaRN softmax scale, and the rotation itself.

Below both the models (models/lm.py builds RotaryEmbedding, models/deepseek_v3.py takes the
softmax scale) and the kernel back ends (kernels/reference.py and the CPU back end rotate with
apply_rope; kernels/accelerator.py's Rotary computes the same in fewer ops): it imports nothing
of the package. Plain single-device PyTorch.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


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
