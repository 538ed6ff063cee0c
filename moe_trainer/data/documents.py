"""Documents inside a packed window (data.document_mask, data.position_reset).

Documents are stored one after another, each ended by the end-of-text id (prepare.py), so a window
of tokens cuts through several. A token belongs to the document its EOS ends: the EOS itself is the
last token of its document, the token after it starts the next one. Pure tensor functions, run on
the window's device (no host sync); the trainer calls them on the full window before context
parallelism shards it, so every shard carries the ids and positions of its own tokens.
"""
from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) token ids -> (B, T) int32 document index of each token within its row (0, 1, ...):
    the number of EOS tokens before it."""
    ends = (tokens == eos_id).to(torch.int32)
    return ends.cumsum(-1, dtype=torch.int32) - ends


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids (non-decreasing along T) -> (B, T) int64 position of each token inside
    its document: 0 at every document's first token (RoPE restarts there)."""
    t = doc_ids.shape[-1]
    index = torch.arange(t, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values  # the document's first index
    return index - first
