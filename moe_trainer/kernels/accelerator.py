"""The device-generic path: what CUDA runs, and what `MOE_TRAINER_KERNELS=accelerator` runs on CPU.

- Routed experts: one `torch._grouped_mm` per expert GEMM over all local experts, the weight
  gradients included (6 grouped GEMMs per layer, forward and backward, whatever the number of
  experts). Each expert's rows start at a multiple of ALIGN_ROWS in a padded copy whose size is
  fixed by the input (M + E * (ALIGN_ROWS - 1) rows), so the per-expert counts never leave the
  device: no host sync.
- Attention: `F.scaled_dot_product_attention` (flash / memory-efficient kernels on GPUs);
  grouped-query attention through `enable_gqa`; MLA's value head, narrower than its query/key
  head, is zero-padded to the query/key size (flash attention needs equal head sizes) and the
  output cut back. Context parallelism's attention of query chunks over the whole sequence runs
  without a mask, by chunk pairs merged on their log-sum-exps (kernels/chunked_attention.py).
- RMSNorm: torch's fused `F.rms_norm` in fp32, cast back before the gain (Hugging Face's order).
- Sorting tokens by expert: `torch.argsort(stable=True)` and counts by `scatter_add_`
  (`torch.bincount` reads its maximum on the host).
Nothing here branches on the device type, and every tensor it makes is on its inputs' device.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .chunked_attention import chunked_causal_attention
from .document_attention import document_attention

# Rows of each expert's group start at a multiple of this in the padded layout: the alignment
# the sm90 grouped-GEMM kernels want for bf16 group offsets (16 rows also covers fp8's 16 bytes).
ALIGN_ROWS = 16


def padded_layout(counts: torch.Tensor, rows: int, align: int = ALIGN_ROWS
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each expert-sorted row goes when every expert's group is rounded up to `align` rows.

    counts (E,) int64 rows per expert (on the device), rows = counts.sum() as a host int (the
    caller knows it from its own tensor's shape). Returns (dest (rows,) int64: the padded row of
    each row, offs (E,) int32: each group's end in the padded layout, the padded size M +
    E * (align - 1), a bound independent of the counts). No host sync."""
    e = counts.numel()
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)  # padded start - unpadded start, per expert
    expert_of = torch.repeat_interleave(torch.arange(e, device=counts.device), counts, output_size=rows)
    dest = torch.arange(rows, device=counts.device) + shift[expert_of]
    return dest, ends.to(torch.int32), rows + e * (align - 1)


def _swiglu(h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u * gate[:, None].to(h.dtype)


class GroupedExperts(torch.autograd.Function):
    """out = (silu(x W1g^T) * x W1u^T * gate) W2^T per expert group of rows, by torch._grouped_mm.

    x (M, d) sorted by expert, w1 (E, 2H, d), w2 (E, d, H), gate (M,) or None, counts (E,) int64 on
    x's device. Forward: 2 grouped GEMMs; backward: 4 (the input gradients and both weight
    gradients, the latter as grouped GEMMs with the groups along the reduced dimension). Saves the
    padded x, the pre-activation and the SwiGLU output. Pad rows are zero in x and in the gate, so
    they add nothing to any weight gradient."""

    @staticmethod
    def forward(ctx, x, w1, w2, gate, counts):
        m = x.shape[0]
        dest, offs, mp = padded_layout(counts, m)
        xp = x.new_zeros(mp, x.shape[1]).index_copy_(0, dest, x)
        gp = torch.zeros(mp, dtype=torch.float32, device=x.device)
        gp.index_copy_(0, dest, gate.float() if gate is not None else torch.ones(m, device=x.device))
        h = torch._grouped_mm(xp, w1.transpose(1, 2), offs=offs)  # (Mp, 2H)
        a = _swiglu(h, gp)  # (Mp, H), zero on pad rows
        yp = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)  # (Mp, d)
        ctx.save_for_backward(xp, w1, w2, h, a, gp, dest, offs)
        ctx.has_gate, ctx.gate_dtype = gate is not None, gate.dtype if gate is not None else None
        return yp.index_select(0, dest)

    @staticmethod
    def backward(ctx, dy):
        xp, w1, w2, h, a, gp, dest, offs = ctx.saved_tensors
        need_x, need_w1, need_w2, need_gate = ctx.needs_input_grad[:4]
        dyp = dy.new_zeros(xp.shape[0], dy.shape[1]).index_copy_(0, dest, dy)
        dw2 = torch._grouped_mm(dyp.t(), a, offs=offs) if need_w2 else None  # (E, d, H)
        da = torch._grouped_mm(dyp, w2, offs=offs)  # (Mp, H)
        g, u = h.chunk(2, dim=-1)
        sig = torch.sigmoid(g.float())
        silu = g.float() * sig
        dgate = None
        if ctx.has_gate and need_gate:
            dgate = (da.float() * silu * u.float()).sum(-1).index_select(0, dest).to(ctx.gate_dtype)
        dag = da.float() * gp[:, None]
        dh = torch.cat([dag * u.float() * sig * (1 + g.float() * (1 - sig)), dag * silu], dim=-1).to(h.dtype)
        dw1 = torch._grouped_mm(dh.t(), xp, offs=offs) if need_w1 else None  # (E, 2H, d)
        dx = torch._grouped_mm(dh, w1, offs=offs).index_select(0, dest) if need_x else None
        return dx, dw1, dw2, dgate, None


class AcceleratorBackend:
    """Device-generic kernels (see the module docstring)."""

    name = "accelerator"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    @staticmethod
    def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @staticmethod
    def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """(B, H, T, Dqk) x (B, Hkv, S, Dqk) x (B, Hkv, S, Dv) -> (B, H, T, Dv), causal."""
        dv = v.shape[-1]
        if dv < q.shape[-1]:  # MLA: flash attention wants one head size for q, k and v
            v = F.pad(v, (0, q.shape[-1] - dv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out[..., :dv] if out.shape[-1] != dv else out

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
