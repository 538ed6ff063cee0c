"""Context parallelism as Llama 3 did it: all-gather K and V, keep Q local.

The sequence is cut into 2*cp equal chunks and cp rank i holds chunks i and
2cp-1-i, so every rank gets the same amount of causal-attention work (an early
chunk with few keys paired with a late chunk with many). In each attention
layer the ranks all-gather K and V (before GQA's head repetition, so only Hkv
heads travel; backward reduce-scatters their grads), put them in global order
and attend their local queries causally by global position without a mask:
per query chunk, one causal SDPA call on its own key chunk and one unmasked call
on the key chunks before it, merged on their log-sum-exps
(kernels/chunked_attention.py). `MaskedContextParallelAttention`, the same with
a (T/cp, T) boolean mask, is the reference the tests hold it against.

What the trainer does with cp > 1 (cp_shard_indices / shard_sequence are pure):
- inputs: `shard_sequence(x, cp, rank)` for input_ids, labels and the
  positions `torch.arange(T)` (B-free, dim=0; (B, T) ones restarting at each
  document, data.position_reset, along dim 1), then
  `model(ids, labels, positions=positions)` (RoPE uses global positions);
- document ids (data.document_mask): every rank keeps the whole window's
  (B, T) int32, computed from the window before it is sharded (no collective);
  `with_documents` attends its queries' ids (the rows of its two chunks)
  against the gathered keys' (all of them, in global order);
- loss: each rank's loss is the mean over its T/cp tokens; the shards are
  equal-sized, so the full-sequence mean is the cp-average of the local means
  (`cp_mean_loss` for logging). Gradients need nothing extra: averaging the
  local-mean gradients over the dp x cp group (the mesh's "dpcp" group, which
  the data-parallel reduction already uses for dense parameters) gives exactly
  the full-sequence gradient. With IGNORE_INDEX labels the token counts of
  the shards differ and the plain average is no longer exact.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import kernels
from .comm import CommCounter, all_gather_along_dim, all_reduce_tensor
from .mesh import Mesh


def cp_shard_indices(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Pure: the global positions (T/cp,) that cp rank `rank` holds: chunks rank and 2cp-1-rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"the sequence length ({seq_len}) must be divisible by 2 * cp ({2 * cp}).")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Pure: this cp rank's part of `tensor` along its sequence dimension `dim`."""
    index = cp_shard_indices(tensor.shape[dim], cp, rank, tensor.device)
    return tensor.index_select(dim, index)


def cp_causal_mask(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Pure: (T/cp, T) bool, True where a local query may attend a gathered key.
    Gathered keys are in cp-rank order, each rank's two chunks in turn."""
    q_pos = cp_shard_indices(seq_len, cp, rank)
    k_pos = torch.cat([cp_shard_indices(seq_len, cp, r) for r in range(cp)])
    return q_pos[:, None] >= k_pos[None, :]


def cp_gather_order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Pure: (T,) where each global position sits among the all-gathered keys (cp-rank order,
    each rank's two chunks in turn): gathered.index_select(dim, order) is in global order."""
    return torch.cat([cp_shard_indices(seq_len, cp, r, device) for r in range(cp)]).argsort()


class ContextParallelAttention:
    """Drop-in for llama3's causal attention: (B, Hq, T/cp, D) x (B, Hkv, T/cp, D) x (B, Hkv, T/cp, Dv)
    -> (B, Hq, T/cp, Dv), attending over the whole sequence's keys. The gathered keys' reorder index
    is built once per sequence length and device, on that device (every layer and step reuses it)."""

    def __init__(self, group, cp: int, rank: int, counter: Optional[CommCounter] = None):
        self.group, self.cp, self.rank, self.counter = group, cp, rank, counter
        self.kernels = kernels.backend()
        self.q_chunks = (rank, 2 * cp - 1 - rank)  # the global chunk indices of the local queries
        self._orders: dict = {}

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, T/cp, D) -> (B, Hkv, T, D), all cp ranks' shards in cp-rank order."""
        return all_gather_along_dim(x, 2, self.group, self.counter, "cp")

    def order(self, seq_len: int, device: torch.device) -> torch.Tensor:
        key = (seq_len, device)
        if key not in self._orders:
            self._orders[key] = cp_gather_order(seq_len, self.cp, device)
        return self._orders[key]

    def gather_in_order(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Hkv, T/cp, D) shards -> the whole sequence's (B, Hkv, T, D) in global order."""
        k, v = self.gather(k), self.gather(v)
        order = self.order(k.shape[2], k.device)
        return k.index_select(2, order), v.index_select(2, order)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k, v = self.gather_in_order(k, v)
        return self.kernels.chunked_causal_attention(q, k, v, scale, self.q_chunks)

    def with_documents(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       documents: torch.Tensor) -> torch.Tensor:
        """The same kept inside documents: documents (B, T) int32, the whole window's ids in global order."""
        k, v = self.gather_in_order(k, v)
        q_docs = documents.index_select(1, self.shard(documents.shape[1], documents.device))  # (B, T/cp)
        return self.kernels.document_attention(q, k, v, scale, q_docs, documents, self.q_chunks)

    def shard(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(T/cp,) global positions of the local queries, built once per sequence length and device."""
        key = ("shard", seq_len, device)
        if key not in self._orders:
            self._orders[key] = cp_shard_indices(seq_len, self.cp, self.rank, device)
        return self._orders[key]


class MaskedContextParallelAttention(ContextParallelAttention):
    """The reference: the gathered keys as they come, under the (T/cp, T) boolean causal mask of
    global positions (built once per sequence length and device). A mask rules out flash attention;
    on CUDA, with grouped-query heads, SDPA falls back to its math kernel and materialises the
    (B, H, T/cp, T) scores."""

    def __init__(self, group, cp: int, rank: int, counter: Optional[CommCounter] = None):
        super().__init__(group, cp, rank, counter)
        self._masks: dict = {}

    def mask(self, seq_len: int, device: torch.device) -> torch.Tensor:
        key = (seq_len, device)
        if key not in self._masks:
            self._masks[key] = cp_causal_mask(seq_len, self.cp, self.rank).to(device)
        return self._masks[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k, v = self.gather(k), self.gather(v)  # (B, Hkv, T, D) in cp-rank order
        return self.kernels.attention(q, k, v, self.mask(k.shape[2], q.device), scale)


def apply_context_parallel(model: nn.Module, mesh: Mesh, counter: Optional[CommCounter] = None) -> nn.Module:
    """Swap every attention of a llama3 model for the context-parallel one, in place.
    Parameters are untouched: they are replicated over cp like over dp."""
    cp = mesh.size("cp")
    if cp == 1:
        return model
    if model.cfg.arch != "llama3":
        raise ValueError(f"context parallelism is implemented for model.arch llama3, got {model.cfg.arch}.")
    attention = ContextParallelAttention(mesh.group("cp"), cp, mesh.index("cp"), counter)
    for layer in model.layers.values():
        layer.self_attn.attention = attention
        layer.self_attn.document_attention = attention.with_documents
    return model


def cp_mean_loss(local_mean: torch.Tensor, mesh: Mesh, counter: Optional[CommCounter] = None) -> torch.Tensor:
    """The full-sequence mean loss (detached) from each cp rank's mean over its equal-sized shard."""
    if mesh.size("cp") == 1:
        return local_mean.detach()
    return all_reduce_tensor(local_mean, mesh.group("cp"), counter, "cp_loss_all_reduce") / mesh.size("cp")
