"""The device-generic path: what CUDA runs, and what `MOE_TRAINER_KERNELS=accelerator` runs on CPU.

- Routed experts: one `torch._grouped_mm` per expert GEMM over all local experts, the weight
  gradients included (6 grouped GEMMs per layer, forward and backward, whatever the number of
  experts). The groups are the expert-sorted rows back to back (`group_ends`: bf16 grouped GEMMs
  need aligned strides, not aligned group offsets), so there is no padded copy and the per-expert
  counts never leave the device: no host sync.
- Attention: `F.scaled_dot_product_attention` (flash / memory-efficient kernels on GPUs);
  grouped-query attention through `enable_gqa`; MLA's value head, narrower than its query/key
  head, goes in unpadded (CUDA's cuDNN / memory-efficient kernels take two head sizes; CPU ranks
  pad it, `sdpa_padded_v`, since the CPU flash kernel does not), with cuDNN asked first on CUDA
  (`sdpa_backends`: torch's own order would pick the memory-efficient kernel). Context parallelism's attention
  of query chunks over the whole sequence runs without a mask, by chunk pairs merged on their
  log-sum-exps (kernels/chunked_attention.py).
- RMSNorm: one `F.rms_norm` in the compute dtype (one kernel each way on CUDA, fp32 inside).
- SwiGLU (routed experts inside GroupedExperts, dense and shared experts as SiluMul): forward and
  backward in the compute dtype, silu(g) recomputed in backward rather than saved.
- RoPE: one autograd function (Rotary), 5 ops each way.
- Sorting tokens by expert: `torch.argsort(stable=True)` and counts by `scatter_add_`
  (`torch.bincount` reads its maximum on the host).
Nothing here branches on the device type, and every tensor it makes is on its inputs' device.
"""
from __future__ import annotations

from typing import Optional

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import wgrad
from .chunked_attention import chunked_causal_attention
from .document_attention import document_attention

# SDPA's backends for a value head narrower than the query/key head (MLA: 128 vs 192), best first
TWO_HEAD_SIZES = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.MATH]


def sdpa_backends(device_type: str, qk_head_dim: int, v_head_dim: int) -> Optional[list]:
    """SDPA's backends in the order to try them, or None for torch's own order (flash, memory-efficient,
    math, cuDNN), which suits one head size on every device. On CUDA with two head sizes (MLA) flash
    attention cannot run (it takes one), so torch's order picks the memory-efficient kernel, whose
    backward is slow above head dim 128 (MLA: 192); cuDNN's fused attention takes 192/128 and runs
    Hopper's tensor-core pipeline both ways, but torch tries it last. So cuDNN first, then the rest in
    torch's order: a shape or setting cuDNN refuses (an old GPU or cuDNN, a head size it lacks) falls
    back to the kernel torch would have picked. Padding V to 192 for flash attention instead costs 1.5x
    the PV GEMMs, a padded copy of V and a slice of the output each way, on flash attention 2."""
    if device_type != "cuda" or qk_head_dim == v_head_dim:
        return None
    return list(TWO_HEAD_SIZES)


def sdpa_order(q: torch.Tensor, v: torch.Tensor):
    """The context SDPA runs in for these shapes (sdpa_backends), set as a priority order."""
    backends = sdpa_backends(q.device.type, q.shape[-1], v.shape[-1])
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends, set_priority=True)


def sdpa_padded_v(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA with a narrower value head zero-padded to the query/key size and the output cut
    back: on a CPU, SDPA's flash kernel wants one head size (else the unfused math kernel runs)."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[..., :dv] if out.shape[-1] != dv else out


@torch.library.custom_op("moe_trainer::grouped_mm", mutates_args=())
def _grouped_mm_any_dtype(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm for dtypes its meta kernel refuses (it takes bf16 only): an opaque op with
    its own shape rule, so torch.compile and fake tensors (the dry run) trace fp32 experts too."""
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_any_dtype.register_fake
def _(a, b, offs):
    if a.dim() == 2 and b.dim() == 2:  # groups along the reduced dimension: one (m, n) per group
        return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])
    return a.new_empty(a.shape[0], b.shape[-1])  # 2D x 3D: groups of rows


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs=offs): itself in bf16 (what torch.compile knows and can fuse),
    the custom op above in other dtypes (fp32 on CPU ranks, the fp32 tests)."""
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_any_dtype(a, b, offs)


def group_ends(counts: torch.Tensor) -> torch.Tensor:
    """(E,) int32 end row of each expert's group: the `offs` torch._grouped_mm takes. The groups sit
    back to back, unpadded: bf16 grouped GEMMs need 16-byte aligned strides, not aligned group
    offsets (only fp8 / mxfp8 scaling blocks want padded groups). On the device, no host sync."""
    return counts.cumsum(0).to(torch.int32)


def swiglu_forward(g: torch.Tensor, u: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    """silu(g) * u (* gate per row) in g's dtype: (M, H), (M, H), (M,) or None -> (M, H)."""
    a = F.silu(g) * u
    return a * gate[:, None].to(a.dtype) if gate is not None else a


def swiglu_backward(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor, gate: Optional[torch.Tensor],
                    need_gate: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of swiglu_forward: (dg, du) in g's dtype and dgate (M,) fp32 (or None). silu(g)
    is recomputed (one op) instead of saved; no fp32 temporaries (sums accumulate in fp32 inside)."""
    silu_g = F.silu(g)
    dgate = (da * silu_g * u).sum(-1, dtype=torch.float32) if gate is not None and need_gate else None
    if gate is not None:
        da = da * gate[:, None].to(da.dtype)
    dg = torch.ops.aten.silu_backward(da * u, g)  # da * u * silu'(g) in one op after the product
    return dg, da * silu_g, dgate


class SiluMul(torch.autograd.Function):
    """silu(g) * u (the dense and shared experts' SwiGLU) saving only g and u: autograd's own
    would keep silu(g) too, one more (rows, I) activation per FFN."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return swiglu_forward(g, u, None)

    @staticmethod
    def backward(ctx, da):
        g, u = ctx.saved_tensors
        dg, du, _ = swiglu_backward(da, g, u, None, False)
        return dg, du


class Rotary(torch.autograd.Function):
    """RoPE as rope.apply_rope computes it, in 5 ops each way instead of autograd's ~17.

    x (B, H, T, D); cos, sin (T, D) with equal halves (RotaryEmbedding's tables). Pairs are
    (x_i, x_{i+D/2}), or (x_2i, x_2i+1) when `interleaved` (DeepSeek's layout; the output then
    de-interleaved, evens then odds). y = [x1 c - x2 s, x2 c + x1 s]; backward rotates back."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved: bool):
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
        ctx.save_for_backward(c, s)
        ctx.interleaved = interleaved
        return torch.cat([torch.addcmul(x1 * c, x2, s, value=-1), torch.addcmul(x2 * c, x1, s)], dim=-1)

    @staticmethod
    def backward(ctx, dy):
        c, s = ctx.saved_tensors
        dy1, dy2 = dy.chunk(2, dim=-1)
        dx1, dx2 = torch.addcmul(dy1 * c, dy2, s), torch.addcmul(dy2 * c, dy1, s, value=-1)
        dx = torch.stack([dx1, dx2], dim=-1).flatten(-2) if ctx.interleaved else torch.cat([dx1, dx2], dim=-1)
        return dx, None, None, None


class GroupedExperts(torch.autograd.Function):
    """out = (silu(x W1g^T) * x W1u^T * gate) W2^T per expert group of rows, by torch._grouped_mm.

    x (M, d) sorted by expert, w1 (E, 2H, d), w2 (E, d, H), gate (M,) or None, counts (E,) int64 on
    x's device. Forward: 2 grouped GEMMs; backward: 4 (the input gradients and both weight
    gradients, the latter as grouped GEMMs with the groups along the reduced dimension). The groups
    are the rows as they come (no padded copy); the SwiGLU runs in the compute dtype, forward and
    backward. Saves x, the pre-activation h (M, 2H) and the activation a (M, H) that dW2 needs."""

    @staticmethod
    def forward(ctx, x, w1, w2, gate, counts):
        offs = group_ends(counts)
        h = grouped_mm(x, w1.transpose(1, 2), offs)  # (M, 2H)
        a = swiglu_forward(*h.chunk(2, dim=-1), gate)  # (M, H)
        ctx.save_for_backward(x, w1, w2, h, a, gate, offs)
        return grouped_mm(a, w2.transpose(1, 2), offs)  # (M, d)

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, h, a, gate, offs = ctx.saved_tensors
        need_x, need_w1, need_w2, need_gate = ctx.needs_input_grad[:4]
        da = grouped_mm(dy, w2, offs)  # (M, H)
        dg, du, dgate = swiglu_backward(da, *h.chunk(2, dim=-1), gate, need_gate)
        dh = torch.cat([dg, du], dim=-1)  # (M, 2H)
        dx = grouped_mm(dh, w1, offs) if need_x else None

        def weight_grads():  # (E, 2H, d), (E, d, H)
            return grouped_mm(dh.t(), x, offs), grouped_mm(dy.t(), a, offs)

        if need_w1 and need_w2 and wgrad.hold((w1, w2), weight_grads):
            dw1 = dw2 = None
        else:
            dw1 = grouped_mm(dh.t(), x, offs) if need_w1 else None
            dw2 = grouped_mm(dy.t(), a, offs) if need_w2 else None
        return dx, dw1, dw2, (dgate.to(gate.dtype) if dgate is not None else None), None


class AcceleratorBackend:
    """Device-generic kernels (see the module docstring)."""

    name = "accelerator"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """One fused op in x's dtype (fp32 accumulation inside; the gain applied before the one
        rounding, where Hugging Face rounds before the gain too: within bf16 tolerance of it)."""
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)

    @staticmethod
    def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return SiluMul.apply(g, u)

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        return Rotary.apply(x, cos, sin, interleaved)

    @staticmethod
    def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """(B, H, T, Dqk) x (B, Hkv, S, Dqk) x (B, Hkv, S, Dv) -> (B, H, T, Dv), causal. MLA's value
        head (Dv < Dqk) goes in as it is: SDPA then picks a kernel that takes two head sizes (cuDNN or
        memory-efficient attention on CUDA; flash attention wants one) instead of attending over
        zero-padded values (a pad, 1.5x the PV work and a slice copy each way), cuDNN's first on CUDA."""
        with sdpa_order(q, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=k.shape[1] != q.shape[1])

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention with a boolean mask (True: may attend), grouped-query heads as above."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])

    @staticmethod
    def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                 q_chunks: tuple[int, ...]) -> torch.Tensor:
        """(B, H, n*c, Dqk) queries at global chunk indices q_chunks x (B, Hkv, S, Dqk) x (B, Hkv, S, Dv)
        keys and values of the whole sequence in order -> (B, H, n*c, Dv), causal by global position."""
        return chunked_causal_attention(q, k, v, scale, q_chunks)

    @staticmethod
    def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_docs: torch.Tensor,
                           k_docs: torch.Tensor, q_chunks: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """Causal attention inside documents (kernels/document_attention.py): FlexAttention with a block
        mask from the document ids on CUDA, SDPA with a boolean mask elsewhere."""
        return document_attention(q, k, v, scale, q_docs, k_docs, q_chunks)

    @staticmethod
    def experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gate: Optional[torch.Tensor],
                counts: torch.Tensor) -> torch.Tensor:
        return GroupedExperts.apply(x.contiguous(), w1, w2, gate, counts)

    @staticmethod
    def sort_by_key(keys: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stable argsort of int64 keys in [0, n_keys) and their counts (n_keys,), on the device."""
        order = torch.argsort(keys, stable=True)
        return order, count_keys(keys, n_keys)

    @staticmethod
    def topk(scores: torch.Tensor, k: int) -> torch.Tensor:
        return scores.topk(k, dim=-1, sorted=False).indices


def count_keys(keys: torch.Tensor, n_keys: int) -> torch.Tensor:
    """(n_keys,) int64 occurrences of each key in [0, n_keys), without a host sync (bincount has one)."""
    return torch.zeros(n_keys, dtype=torch.int64, device=keys.device).scatter_add_(
        0, keys.reshape(-1), torch.ones(keys.numel(), dtype=torch.int64, device=keys.device))
