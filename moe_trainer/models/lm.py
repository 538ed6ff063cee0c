"""The causal-LM skeleton both architectures share.

embed_tokens -> layers (ModuleDict keyed by global layer id, so pipeline stages
can drop modules while names stay checkpoint-stable) -> norm -> lm_head.
Every decoder layer maps (h, cos, sin, documents) -> (h, aux) where aux is the layer's
weighted auxiliary loss or None; aux losses ride along with the activations so
a pipeline stage can carry them to the last stage as a tensor. `documents` (B, T) int32, the
tokens' document ids in a packed window (data.document_mask), keeps attention inside documents;
None is plain causal attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .init import init_in_place
from ..rope import RotaryEmbedding
from .layers import Linear, RMSNorm


@dataclass
class LMOutput:
    logits: torch.Tensor  # (B, T, V)
    loss: Optional[torch.Tensor] = None  # total training loss (lm + mtp + aux)
    losses: dict = field(default_factory=dict)  # detached components for metrics


def add_aux(total: Optional[torch.Tensor], aux: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if aux is None:
        return total
    return aux if total is None else total + aux


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; logits (B, T, V), labels (B, T)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


class CausalLM(nn.Module):
    """Subclasses build `self.layers` and may add `self.mtp`."""

    def __init__(self, cfg: ModelConfig, rope_dim: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.device("cpu"):  # the rope tables are computed even when the model is built on the meta device
            self.rotary = RotaryEmbedding(rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # (logits, labels) -> mean loss; tensor parallelism swaps in a vocabulary-parallel one
        self.loss_fn = lm_loss

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self, seed: Optional[int] = None) -> None:
        """Normal(0, initializer_range) for every matrix, ones for norms, zero biases (Hugging
        Face's initialisation), each value a function of (seed, global name, expert index) only
        (models/init.py). Without a seed one is drawn from torch's global generator, so
        `torch.manual_seed(s); Model(cfg)` stays reproducible. Nothing to do on the meta device:
        `materialize` fills what a rank keeps."""
        if next(self.parameters()).device.type == "meta":
            return
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, ()))
        init_in_place(self, seed, self.cfg.initializer_range)

    def rope(self, seq_len: int, device, dtype, positions: Optional[torch.Tensor] = None):
        """cos, sin (T, D) for positions (T,) (default 0..T-1), or (B, 1, T, D) for per-row positions
        (B, T) (data.position_reset: each document starts at 0)."""
        if positions is None:
            positions = torch.arange(seq_len, device=device)
        cos, sin = self.rotary(positions, dtype)
        if positions.dim() == 2:  # one row of positions per sequence: broadcast over the heads
            cos, sin = cos[:, None], sin[:, None]
        return cos, sin

    def run_layers(self, h: torch.Tensor, cos, sin, documents: Optional[torch.Tensor] = None):
        aux = None
        for layer in self.layers.values():
            h, layer_aux = layer(h, cos, sin, documents)
            aux = add_aux(aux, layer_aux)
        return h, aux

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, documents: Optional[torch.Tensor] = None) -> LMOutput:
        h = emb = self.embed_tokens(input_ids)  # (B, T, d)
        cos, sin = self.rope(input_ids.shape[1], h.device, h.dtype, positions)
        h, aux = self.run_layers(h, cos, sin, documents)
        logits = self.lm_head(self.norm(h))
        if labels is None:
            return LMOutput(logits)
        return self.loss(logits, labels, h, emb, aux, documents, positions)

    def loss(self, logits, labels, hidden, emb, aux, documents=None, positions=None) -> LMOutput:
        """hidden: last layer's output before the final norm; emb: the token
        embeddings of the inputs (multi-token prediction reuses them, with the
        batch's document ids and positions when it has them)."""
        main = self.loss_fn(logits, labels)
        losses = {"lm": main.detach()}
        total = main
        mtp = self.mtp_loss(hidden, emb, labels, documents, positions) if hasattr(self, "mtp") and len(self.mtp) \
            else None
        if mtp is not None:
            mtp_loss, mtp_aux = mtp
            total = total + self.cfg.mtp_loss_weight * mtp_loss
            losses["mtp"] = mtp_loss.detach()
            aux = add_aux(aux, mtp_aux)
        if aux is not None:
            total = total + aux
            losses["aux"] = aux.detach()
        return LMOutput(logits, total, losses)
