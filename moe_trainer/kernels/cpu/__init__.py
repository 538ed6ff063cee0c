"""The CPU back end: what CPU ranks run (`MOE_TRAINER_KERNELS=cpu`, or `auto` without a GPU).

Behind the same interface as the accelerator path (kernels/accelerator.py), and apart from it:
- extension.py, csrc/: fused C++ kernels (SwiGLU, RMSNorm, causal softmax and attention, routing
  top-k, a counting sort, the shared-memory all-to-all), built once per machine; oneDNN's matmul
  for large fp32 GEMMs;
- experts.py: routed experts shaped for CPU caches and GEMM libraries; layers.py: the dense
  layers' fused paths;
- shm_alltoall.py: all-to-alls and small all-reduces between the ranks of one host through shared
  memory (gloo goes through loopback TCP);
- allocator.py: glibc settings that keep freed memory for reuse.
Every function takes any tensor: what is not a contiguous CPU tensor of a supported dtype goes to
the accelerator path, so a model built with this back end still runs after `.to("cuda")`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...rope import apply_rope
from ..accelerator import AcceleratorBackend, sdpa_padded_v
from . import experts as cpu_experts
from . import extension
from . import layers as cpu_layers


class CPUBackend(AcceleratorBackend):
    name = "cpu"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.device.type != "cpu":
            return AcceleratorBackend.rms_norm(x, weight, eps)
        if extension.ops_for(x, weight) is not None:  # also requires weight in x's dtype
            return cpu_layers.FusedRMSNorm.apply(x, weight, eps)
        # fp32, cast back before the gain (Hugging Face's order), as the fused kernel computes it
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    @staticmethod
    def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if g.device.type != "cpu":
            return AcceleratorBackend.silu_mul(g, u)
        if g.shape == u.shape and extension.ops_for(g, u) is not None:
            return cpu_layers.SiluMul.apply(g, u)
        return F.silu(g) * u

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """oneDNN's matmul for fp32 GEMMs of at least extension.ONEDNN_MIN_MACS multiply-adds
        (when torch has it), else F.linear."""
        if x.dtype == torch.float32 and x.device.type == "cpu" and weight.dtype == torch.float32 and x.numel():
            min_macs = extension.onednn_min_macs()
            if 0 <= min_macs <= x.numel() * weight.shape[0]:
                return cpu_layers.OneDNNLinear.apply(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        if x.device.type != "cpu":
            return AcceleratorBackend.rope(x, cos, sin, interleaved)
        return apply_rope(x, cos, sin, interleaved)  # plain torch ops, as before the accelerator's Rotary

    @staticmethod
    def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Explicit scores while the saved probabilities fit cpu_layers.EXPLICIT_ATTENTION_MAX_SCORES:
        on a CPU, SDPA's flash kernel reaches ~70 GFLOP/s in bf16 (and MLA's narrower value head
        sends it to the unfused math kernel), three batched GEMMs around one softmax ~10x that."""
        if q.device.type != "cpu":
            return AcceleratorBackend.causal_attention(q, k, v, scale)
        if q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] > cpu_layers.EXPLICIT_ATTENTION_MAX_SCORES:
            return sdpa_padded_v(q, k, v, scale)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return cpu_layers.ExplicitCausalAttention.apply(q, k, v, scale)

    @staticmethod
    def experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gate: Optional[torch.Tensor],
                counts: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return AcceleratorBackend.experts(x, w1, w2, gate, counts)
        c = counts.tolist()  # a CPU tensor: no device sync
        n = sum(c)
        if x.shape[0] > n:  # a compiled region's zero row after the last group (moe/experts.py): no group reads it
            y = cpu_experts.experts_forward(x[:n], w1, w2, gate[:n] if gate is not None else None, c)
            return torch.cat([y, y.new_zeros((x.shape[0] - n,) + tuple(y.shape[1:]))])
        return cpu_experts.experts_forward(x, w1, w2, gate, c)

    @staticmethod
    def sort_by_key(keys: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One counting sort in the extension (stable, with the counts) for a contiguous CPU int64 vector."""
        ops = extension.ops_on_cpu(keys) if keys.dtype == torch.int64 and keys.dim() == 1 else None
        if ops is not None:
            return tuple(ops.counting_sort(keys, n_keys))
        return AcceleratorBackend.sort_by_key(keys, n_keys)

    @staticmethod
    def topk(scores: torch.Tensor, k: int) -> torch.Tensor:
        """One insertion pass per row (largest first, ties to the lower index) on a CPU in fp32."""
        ops = extension.ops_on_cpu(scores) if scores.dtype == torch.float32 and scores.dim() == 2 else None
        if ops is not None:
            return ops.topk_rows(scores, k)
        return AcceleratorBackend.topk(scores, k)
