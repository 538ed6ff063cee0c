"""DeepSeek-V3: multi-head latent attention, DeepSeekMoE blocks, multi-token prediction.

Parameter names follow Hugging Face's DeepseekV3ForCausalLM (minus the
`model.` prefix), so conversion is a rename (see hf/names.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig
from ..moe.layer import MoE
from .. import kernels
from ..rope import yarn_softmax_scale
from .layers import Linear, RMSNorm, SwiGLU
from .lm import CausalLM, add_aux, lm_loss


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3).

    Queries go through an optional low-rank bottleneck (q_lora_rank); keys and
    values share one compressed latent (kv_lora_rank) plus a single decoupled
    RoPE key (qk_rope_head_dim) broadcast to every head.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads = h
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.interleaved = cfg.rope_interleave
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, h * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)  # eps 1e-6 whatever rms_norm_eps, as DeepSeek/HF
            self.q_b_proj = Linear(cfg.q_lora_rank, h * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)  # eps 1e-6, as DeepSeek/HF
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(h * cfg.v_head_dim, d, bias=cfg.attention_bias)
        self.softmax_scale = yarn_softmax_scale(self.qk_head_dim, cfg.rope_scaling)
        self.kernels = kernels.backend()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """documents (B, T) int32: the tokens' document ids, which attention stays inside (None: causal)."""
        b, t, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, self.n_heads, self.qk_head_dim).transpose(1, 2)  # (B, H, T, Dqk)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent))
        kv = kv.view(b, t, self.n_heads, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q_rope = self.kernels.rope(q_rope, cos, sin, self.interleaved)
        k_rope = self.kernels.rope(k_rope.view(b, 1, t, self.qk_rope_head_dim), cos, sin, self.interleaved)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, self.n_heads, t, self.qk_rope_head_dim)], dim=-1)
        if documents is None:
            out = self.kernels.causal_attention(q, k, v, self.softmax_scale)  # (B, H, T, Dv)
        else:
            out = self.kernels.document_attention(q, k, v, self.softmax_scale, documents, documents)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.v_head_dim))


def build_moe(cfg: ModelConfig) -> MoE:
    return MoE(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
               cfg.n_shared_experts, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor,
               cfg.scoring_func, cfg.seq_aux_loss_alpha, cfg.router_z_loss_coef, cfg.capacity_factor,
               cfg.moe_impl)


class DecoderLayer(nn.Module):
    """Pre-norm block: h + MLA(norm(h)), then h + FFN(norm(h)); FFN is dense or MoE."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = layer_id >= cfg.first_k_dense_replace
        self.mlp = build_moe(cfg) if self.is_moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, cos, sin, documents=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        h, x = self.attention_block(h, cos, sin, documents)
        if self.is_moe:
            out, aux = self.mlp(x)
            return h + out, aux
        return h + self.mlp(x), None

    def attention_block(self, h, cos, sin, documents=None) -> tuple[torch.Tensor, torch.Tensor]:
        """h + MLA(norm(h)) and its post-attention norm (the FFN's input): a compiled region of its own
        when the overlapped executor runs an MoE layer's stages (compile.py)."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, documents)
        return h, self.post_attention_layernorm(h)


class MTPModule(nn.Module):
    """One multi-token-prediction depth: h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})]),
    then one MoE decoder block; embedding and output head are the main model's."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderLayer(cfg, layer_id)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h_prev, emb, cos, sin, documents=None):
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h_prev)], dim=-1))
        return self.block(h, cos, sin, documents)


class DeepseekV3(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, rope_dim=cfg.qk_rope_head_dim)
        for i in range(cfg.num_hidden_layers):
            self.layers[str(i)] = DecoderLayer(cfg, i)
        # MTP depths take layer ids after the main layers, as DeepSeek's checkpoints do
        self.mtp = nn.ModuleDict({str(k): MTPModule(cfg, cfg.num_hidden_layers + k)
                                  for k in range(cfg.num_nextn_predict_layers)})
        self.init_weights()
        self.tie_weights()

    def mtp_loss(self, hidden: torch.Tensor, emb: torch.Tensor, labels: torch.Tensor,
                 documents: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None):
        """Mean over depths k = 1..D of the CE of predicting t_{i+k+1} at position i.

        hidden (B, T, d): main model's last hidden states (before the final norm);
        emb (B, T, d): the embeddings of the input tokens (a pipeline carries
        them from the first stage, so the embedding is never duplicated).
        Depth k sees T - k positions: embeddings emb[:, k:], labels labels[:, k:]. With document
        ids (B, T) position i keeps its own document's id and position (positions (T,) or (B, T)):
        where t_{i+k} lies in i's document the depth sees what it would see in that document alone.
        """
        t = emb.shape[1]
        h, total, aux = hidden, 0.0, None
        for k, module in enumerate(self.mtp.values(), start=1):
            n = t - k
            if documents is None:
                cos, sin = self.rope(n, h.device, h.dtype)
                h, block_aux = module(h[:, :n], emb[:, k:], cos, sin)
            else:
                cos, sin = self.rope(n, h.device, h.dtype, None if positions is None else positions[..., :n])
                h, block_aux = module(h[:, :n], emb[:, k:], cos, sin, documents[:, :n])
            logits = self.lm_head(module.norm(h))
            total = total + lm_loss(logits, labels[:, k:])
            aux = add_aux(aux, block_aux)
        return total / len(self.mtp), aux
