"""Building blocks shared by both architectures: RMSNorm, Linear, SwiGLU, causal attention
(RoPE, below both the models and the kernels, is moe_trainer/rope.py).

Plain single-device PyTorch; no process groups here. Each module takes the kernel back end
(moe_trainer.kernels) when it is built and hands its maths off to it in one line: the
device-generic accelerator path (what GPUs run), the CPU back end, or the plain reference.
"""
from __future__ import annotations

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
