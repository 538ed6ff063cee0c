"""Causal attention that stays inside each document of a packed window (data.document_mask).

Every token carries the id of its document (data/documents.py): query i may attend key j when j is
not after i and both lie in the same document. Two ways to compute it behind one function:

- `mask`: a boolean (B, 1, Tq, S) mask from the ids, given to SDPA (or the reference's explicit
  scores). What CPU ranks run: there SDPA's kernels take a mask at no loss.
- `flex`: FlexAttention with a block-sparse mask made from the ids without any (Tq, S) tensor: per
  tile of BLOCK rows and BLOCK keys, the smallest and largest document id and position decide
  whether the tile is empty (skipped), full (no mask evaluated) or partial (the mask_mod below
  decides per element). O((T / BLOCK)^2) booleans per sequence, on the ids' device, no host sync.
  What CUDA runs, through torch.compile (eager FlexAttention would make the full scores); on a CPU
  torch runs it only without gradients, which is how the tests hold it against the mask path.

Context parallelism: the local queries are chunks `q_chunks` of c tokens (parallel/context.py),
the keys the whole sequence in global order; positions decide causality, so one code path serves
both (q_chunks None: queries and keys are the same T tokens).

Either mask is built once per micro-batch, not in every layer: the first layer's call keeps it on the
micro-batch's ids tensor, which every layer is handed unchanged (`built_once`).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

# FlexAttention's tile on CUDA: the block mask's granularity
BLOCK = 128


def query_positions(t: int, q_chunks: Optional[Sequence[int]], device) -> torch.Tensor:
    """(Tq,) global positions of the local queries: 0..t-1, or the chunks' under context parallelism."""
    if q_chunks is None:
        return torch.arange(t, device=device)
    c = t // len(q_chunks)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device) for a in q_chunks])


def document_mask(q_docs: torch.Tensor, k_docs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
                  ) -> torch.Tensor:
    """(B, 1, Tq, S) bool, True where a query may attend a key: not later, same document."""
    causal = q_pos[:, None] >= k_pos[None, :]  # (Tq, S)
    return (causal[None] & (q_docs[:, :, None] == k_docs[:, None, :]))[:, None]


def _tile_ranges(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., T) -> per tile of `block` along the last dim its (min, max), (..., ceil(T / block)); a
    last partial tile repeats its final element (which leaves min and max unchanged)."""
    t = x.shape[-1]
    n = -(-t // block)
    index = torch.arange(n * block, device=x.device).clamp_(max=t - 1)
    tiles = x.index_select(-1, index).unflatten(-1, (n, block))
    return tiles.amin(-1), tiles.amax(-1)


def tile_kinds(q_docs: torch.Tensor, k_docs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
               block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query tile, key tile) pairs hold allowed pairs: (partial, full), each (B, nq, nk) bool.

    Pure in its inputs. A tile pair can hold an allowed (query, key) only if some key is not after
    some query and the two tiles' document ranges overlap (a superset of the true tiles: the
    mask_mod settles the rest); every pair is allowed when all keys precede all queries and both
    tiles lie in one and the same document. Tiles that run past the sequence are never full."""
    qd_lo, qd_hi = _tile_ranges(q_docs, block)  # (B, nq)
    kd_lo, kd_hi = _tile_ranges(k_docs, block)  # (B, nk)
    qp_lo, qp_hi = _tile_ranges(q_pos, block)  # (nq,)
    kp_lo, kp_hi = _tile_ranges(k_pos, block)  # (nk,)
    some = (kp_lo[None, :] <= qp_hi[:, None])[None] & \
        (kd_hi[:, None, :] >= qd_lo[:, :, None]) & (kd_lo[:, None, :] <= qd_hi[:, :, None])
    one_doc = (qd_lo == qd_hi)[:, :, None] & (kd_lo == kd_hi)[:, None, :] & (qd_lo[:, :, None] == kd_lo[:, None, :])
    whole_q = torch.arange(qp_lo.numel(), device=q_pos.device) < q_pos.numel() // block
    whole_k = torch.arange(kp_lo.numel(), device=k_pos.device) < k_pos.numel() // block
    full = one_doc & (kp_hi[None, :] <= qp_lo[:, None])[None] & (whole_q[:, None] & whole_k[None, :])[None]
    return some & ~full, full


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, nq, nk) bool -> FlexAttention's (B, 1, nq) counts and (B, 1, nq, nk) key-tile indices,
    the marked tiles first (int32)."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


def document_block_mask(q_docs: torch.Tensor, k_docs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                        block: int = BLOCK):
    """FlexAttention's BlockMask of `document_mask` (tiles from `tile_kinds`, the exact rule as its
    mask_mod), made without a (Tq, S) tensor."""
    from torch.nn.attention.flex_attention import BlockMask

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_pos[q_idx] >= k_pos[kv_idx]) & (q_docs[b, q_idx] == k_docs[b, kv_idx])

    partial, full = tile_kinds(q_docs, k_docs, q_pos, k_pos, block)
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(q_pos.numel(), k_pos.numel()))


def built_once(q_docs: torch.Tensor, k_docs: torch.Tensor, key: tuple, build):
    """build()'s mask for these ids, made once for the micro-batch: kept on its ids tensor (k_docs,
    which the model hands every layer unchanged: one mask per micro-batch, shared by the layers and by
    autograd's saved tensors) under `key`, and made again if the ids change in place. Built every time
    when the queries' ids are another tensor (context parallelism's shard, made per layer), and inside
    a compiled graph, where it is part of the graph."""
    if q_docs is not k_docs or torch.compiler.is_compiling():
        return build()
    version, masks = getattr(k_docs, "_document_masks", (None, None))
    if version != k_docs._version:
        version, masks = k_docs._version, {}
        k_docs._document_masks = (version, masks)
    if key not in masks:
        masks[key] = build()
    return masks[key]


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(q, k, v, scale: float, q_docs, k_docs, q_pos, k_pos, compiled: bool = True,
                            block: int = BLOCK) -> torch.Tensor:
    """(B, H, Tq, D) x (B, Hkv, S, D) x (B, Hkv, S, Dv) -> (B, H, Tq, Dv) by FlexAttention."""
    from torch.nn.attention.flex_attention import flex_attention
    attend = _compiled_flex() if compiled else flex_attention
    mask = built_once(q_docs, k_docs, ("flex", block, q_pos.numel(), k_pos.numel()),
                      lambda: document_block_mask(q_docs, k_docs, q_pos, k_pos, block))
    return attend(q, k, v, block_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def kernel_for(device_type: str) -> str:
    """The way a device computes it: FlexAttention on CUDA, the mask elsewhere."""
    return "flex" if device_type == "cuda" else "mask"


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_docs: torch.Tensor,
                       k_docs: torch.Tensor, q_chunks: Optional[Sequence[int]] = None,
                       kernel: Optional[str] = None) -> torch.Tensor:
    """(B, H, Tq, Dqk) x (B, Hkv, S, Dqk) x (B, Hkv, S, Dv) -> (B, H, Tq, Dv), causal by global
    position and inside documents; q_docs (B, Tq) and k_docs (B, S) the tokens' document ids.
    `kernel` forces "mask", "flex" (compiled) or "flex-eager" (tests); None: `kernel_for` the device."""
    kernel = kernel or kernel_for(q.device.type)
    q_pos = query_positions(q.shape[2], q_chunks, q.device)
    k_pos = torch.arange(k.shape[2], device=q.device)
    if kernel == "mask":
        dv = v.shape[-1]
        if dv < q.shape[-1]:  # MLA: with one head size SDPA takes its fused kernel (the math one: ~2x slower)
            v = F.pad(v, (0, q.shape[-1] - dv))
        mask = built_once(q_docs, k_docs, ("mask", q_pos.numel(), k_pos.numel()),
                          lambda: document_mask(q_docs, k_docs, q_pos, k_pos))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out[..., :dv] if out.shape[-1] != dv else out
    return flex_document_attention(q, k, v, scale, q_docs, k_docs, q_pos, k_pos, compiled=kernel == "flex")
