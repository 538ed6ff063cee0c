"""Llama 3: grouped-query attention, RoPE with Llama 3's frequency scaling, SwiGLU.

Parameter names follow Hugging Face's LlamaForCausalLM minus the `model.` prefix.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig
from .. import kernels
from .layers import DocumentAttention, Linear, RMSNorm, SwiGLU
from .lm import CausalLM


class GQA(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = cfg.head_dim or d // cfg.num_attention_heads
        self.q_proj = Linear(d, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = Linear(d, self.n_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, d, bias=cfg.attention_bias)
        # causal attention, each k/v head serving Hq/Hkv query heads:
        # (B, Hq, T, D) x (B, Hkv, T, D) x (B, Hkv, T, D) -> (B, Hq, T, D); context parallelism swaps its own in
        self.attention = kernels.backend().causal_attention
        # the same kept inside documents when the batch carries document ids (data.document_mask)
        self.document_attention = DocumentAttention(kernels.backend())
        self.rope = kernels.backend().rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, cos, sin, False), self.rope(k, cos, sin, False)
        scale = self.head_dim ** -0.5
        if documents is None:
            out = self.attention(q, k, v, scale)  # (B, Hq, T, D)
        else:
            out = self.document_attention(q, k, v, scale, documents)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GQA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, cos, sin, documents=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, documents)
        return h + self.mlp(self.post_attention_layernorm(h)), None


class Llama3(CausalLM):
    def __init__(self, cfg: ModelConfig):
        head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        super().__init__(cfg, rope_dim=head_dim)
        for i in range(cfg.num_hidden_layers):
            self.layers[str(i)] = LlamaLayer(cfg, i)
        self.init_weights()
        self.tie_weights()
