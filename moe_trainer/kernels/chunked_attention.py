"""Causal attention of query chunks over the whole sequence without a mask: context parallelism's kernel.

A context-parallel rank holds a few chunks of c queries each, at global chunk indices `q_chunks`
(chunks r and 2cp-1-r, parallel/context.py), and the whole sequence's keys and values in order.
Query chunk a attends keys [0, a*c) fully and keys [a*c, (a+1)*c) causally; later keys not at
all. So each query chunk makes two flash / memory-efficient SDPA calls, neither with a mask: one
with `is_causal=True` on its diagonal key chunk and one plain call on all the key chunks before
it (contiguous in global order, so one call serves every pair in the past), and the chunks after
it cost nothing. The two partial results are merged by their log-sum-exps (the online-softmax
merge, in fp32): out = sum_i exp(lse_i - lse) out_i with lse = log(sum_i exp(lse_i)).

Backward: each call's gradient is its kernel's backward fed the merged output and the merged
log-sum-exp (as ring attention does): the kernel recomputes its probabilities as
exp(scale q k^T - lse), which are then the full softmax's restricted to its keys, and
D = rowsum(dout * out) is the full softmax's too, so the partial gradients sum to the exact one.

torch returns the log-sum-exp only from its per-device kernels, so the kernel pair is chosen
per device type, dtype and head size (`block_kernels`, cached: once, on first use, since the
model is built on the meta device before its device and dtype are known): CPU flash attention; on CUDA flash
attention in fp16/bf16 (grouped-query K/V heads as they are) and the memory-efficient kernel in
fp32 (which needs one K/V head per query head: K/V are repeated there). No (T/cp, T) mask or
score tensor is made and no host sync; every tensor is on q's device.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F

aten = torch.ops.aten

# FlashAttention-2's limits on CUDA (flash_api.cpp): head size a multiple of 8, at most 256.
HEAD_ALIGN, FLASH_MAX_HEAD = 8, 256


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The CUDA kernels want stride 1 along the head dimension (a metadata check, no copy usually)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class FlashCPU:
    """torch's CPU flash attention: any float dtype, grouped-query K/V heads as they are."""

    gqa = True

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        """(B, H, Tq, D) x (B, Hkv, S, D) x2 -> out (B, H, Tq, D), lse (B, H, Tq) fp32, extras."""
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()

    @staticmethod
    def backward(dout, q, k, v, out, lse, extras, causal: bool, scale: float):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                         scale=scale)


class FlashCUDA:
    """FlashAttention-2 on CUDA (fp16 / bf16): grouped-query K/V heads as they are."""

    gqa = True

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    @staticmethod
    def backward(dout, q, k, v, out, lse, extras, causal: bool, scale: float):
        cum_q, cum_k, max_q, max_k, seed, offset = extras
        dout, q, k, v = (_last_dim_contiguous(t) for t in (dout, q, k, v))
        return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                                 0.0, causal, seed, offset, scale=scale)


class EfficientCUDA:
    """The memory-efficient kernel on CUDA (fp32, or heads too wide for flash): one K/V head per
    query head. Its log-sum-exp comes padded along the queries (to 32 rows); the merge uses the
    first Tq and the backward gets the merged one padded back to the forward's length."""

    gqa = False

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                              scale=scale)
        return out, lse[..., :q.shape[2]], (lse.shape[-1], seed, offset)

    @staticmethod
    def backward(dout, q, k, v, out, lse, extras, causal: bool, scale: float):
        lse_len, seed, offset = extras
        dout, q, k, v = (_last_dim_contiguous(t) for t in (dout, q, k, v))
        lse = F.pad(lse, (0, lse_len - lse.shape[-1])).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv


@functools.lru_cache(maxsize=None)
def block_kernels(device_type: str, dtype: torch.dtype, head_dim: int):
    """The kernel pair for inputs on `device_type` in `dtype` with (padded) head size `head_dim`."""
    if device_type == "cpu":
        return FlashCPU
    # FlashAttention-2 runs on sm80 and later (the memory-efficient kernel on older GPUs too)
    old_gpu = device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 8
    if dtype in (torch.float16, torch.bfloat16) and head_dim <= FLASH_MAX_HEAD and not old_gpu:
        return FlashCUDA
    return EfficientCUDA


def chunk_pairs(q_chunks: Sequence[int], chunk: int) -> list[list[tuple[int, int, bool]]]:
    """Pure: for each local query chunk (global index a), the key ranges it attends and whether
    causally: [(a*c, (a+1)*c, True), (0, a*c, False)], the second left out for chunk 0."""
    return [[(a * chunk, (a + 1) * chunk, True)] + ([(0, a * chunk, False)] if a else []) for a in q_chunks]


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge in fp32: outs (B, H, c, D) attended over disjoint key sets with
    log-sum-exps lses (B, H, c) -> the attention over their union (fp32) and its lse (B, H, c)."""
    lse = torch.stack([x.float() for x in lses]).logsumexp(0)
    out = sum((x.float() - lse).exp()[..., None] * o.float() for o, x in zip(outs, lses))
    return out, lse


class _ChunkedCausalAttention(torch.autograd.Function):
    """q (B, H, n*c, D) of n query chunks, k, v (B, Hk, S, D) in global order -> (B, H, n*c, D);
    Hk = H or (kernels with gqa) a divisor of H. Saves q, k, v, the merged output and lse."""

    @staticmethod
    def forward(ctx, q, k, v, scale, q_chunks, kernels):
        c = q.shape[2] // len(q_chunks)
        outs, lses, extras = [], [], []
        for j, pairs in enumerate(chunk_pairs(q_chunks, c)):
            qj = q[:, :, j * c:(j + 1) * c]  # (B, H, c, D)
            parts = [kernels.forward(qj, k[:, :, lo:hi], v[:, :, lo:hi], causal, scale) for lo, hi, causal in pairs]
            out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
            outs.append(out.to(q.dtype))
            lses.append(lse)
            extras.append([p[2] for p in parts])
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)  # (B, H, n*c, D), (B, H, n*c) fp32
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.q_chunks, ctx.kernels, ctx.extras = scale, q_chunks, kernels, extras
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        c = q.shape[2] // len(ctx.q_chunks)
        # fp32 sums: a key chunk gets gradient from both local query chunks, a query from two calls
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        for j, pairs in enumerate(chunk_pairs(ctx.q_chunks, c)):
            rows = slice(j * c, (j + 1) * c)
            # the kernels recompute the probabilities from this lse, so it must be contiguous
            lse_j = lse[:, :, rows].contiguous()
            for (lo, hi, causal), extra in zip(pairs, ctx.extras[j]):
                gq, gk, gv = ctx.kernels.backward(dout[:, :, rows], q[:, :, rows], k[:, :, lo:hi], v[:, :, lo:hi],
                                                  out[:, :, rows], lse_j, extra, causal, ctx.scale)
                dq[:, :, rows] += gq
                dk[:, :, lo:hi] += gk
                dv[:, :, lo:hi] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             q_chunks: Sequence[int]) -> torch.Tensor:
    """(B, H, n*c, Dqk) queries at global chunks q_chunks x (B, Hkv, S, Dqk) x (B, Hkv, S, Dv), the
    keys and values of the sequence in order (S >= (max(q_chunks) + 1) * c) -> (B, H, n*c, Dv).

    Head sizes are zero-padded to one multiple of 8 (the flash kernels' rule; MLA's value head is
    narrower than its query/key head): zeros add nothing to q k^T and the output is cut back."""
    dv = v.shape[-1]
    d = -(-max(q.shape[-1], dv) // HEAD_ALIGN) * HEAD_ALIGN
    q, k, v = (t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1])) for t in (q, k, v))
    kernels = block_kernels(q.device.type, q.dtype, d)
    if not kernels.gqa and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = _ChunkedCausalAttention.apply(q, k, v, scale, tuple(q_chunks), kernels)
    return out if d == dv else out[..., :dv]
