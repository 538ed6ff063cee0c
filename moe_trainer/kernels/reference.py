"""The simple reference every fast path is held against: plain torch ops, one expert at a time,
attention with explicit scores. Correct on any device and slow everywhere (it reads the expert
counts on the host, as Megatron's SequentialMLP does)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..rope import apply_rope
from .accelerator import AcceleratorBackend
from .document_attention import document_mask, query_positions


class ReferenceBackend(AcceleratorBackend):
    """The accelerator path's interface with the simple version of each fast piece (the linear
    layers and top-k are plain torch ops there already, and shared)."""

    name = "reference"

    @staticmethod
    def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        return apply_rope(x, cos, sin, interleaved)  # the plain maths

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """softmax(scale q k^T, masked) v in fp32; mask (T, S) or (B, 1, T, S) bool, True where a query may attend."""
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)

    @classmethod
    def chunked_causal_attention(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                 q_chunks: tuple[int, ...]) -> torch.Tensor:
        """The same with explicit scores under the mask of global positions (T/cp, S)."""
        c = q.shape[2] // len(q_chunks)
        q_pos = torch.cat([torch.arange(a * c, (a + 1) * c, device=q.device) for a in q_chunks])
        mask = q_pos[:, None] >= torch.arange(k.shape[2], device=q.device)[None, :]
        return cls.attention(q, k, v, mask, scale)

    @classmethod
    def document_attention(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           q_docs: torch.Tensor, k_docs: torch.Tensor,
                           q_chunks: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """The same with explicit scores under the (B, 1, T, S) mask: not later, same document."""
        q_pos = query_positions(q.shape[2], q_chunks, q.device)
        mask = document_mask(q_docs, k_docs, q_pos, torch.arange(k.shape[2], device=q.device))
        return cls.attention(q, k, v, mask, scale)

    @classmethod
    def causal_attention(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        t, s = q.shape[2], k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril_()  # as SDPA's is_causal
        return cls.attention(q, k, v, mask, scale)

    @staticmethod
    def experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gate: Optional[torch.Tensor],
                counts: torch.Tensor) -> torch.Tensor:
        """SequentialMLP-style: F.linear per expert over its rows."""
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):  # host sync: the reference reads the counts
            if n:
                g, u = F.linear(x[start:start + n], w1[e]).chunk(2, dim=-1)
                a = F.silu(g) * u
                if gate is not None:
                    a = a * gate[start:start + n, None].to(a.dtype)
                out[start:start + n] = F.linear(a, w2[e])
            start += n
        return out

    @staticmethod
    def sort_by_key(keys: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.argsort(keys, stable=True), torch.bincount(keys, minlength=n_keys)
