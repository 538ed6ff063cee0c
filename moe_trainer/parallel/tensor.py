"""Tensor parallelism (Megatron) for Llama 3, with optional sequence parallelism.

Per decoder layer, on tp ranks:
    attention: q/k/v column-parallel (Hq/tp query heads per rank; Hkv/tp kv heads
               when tp divides Hkv, else the one kv head this rank's q heads use),
               o_proj row-parallel;
    SwiGLU:    gate/up column-parallel (intermediate/tp), down row-parallel;
    embedding and lm_head: vocabulary-parallel (vocab/tp rows each), with a
               vocabulary-parallel cross-entropy, so no rank ever holds [B, T, V].
Each region enters with copy_to_region (backward all-reduce) and leaves with an
all-reduce. Under sequence parallelism the norms and residual adds run on
T/tp tokens instead, and the region is entered with an all-gather along the
sequence and left with a reduce-scatter: all-reduce = reduce-scatter +
all-gather, the same bytes, but the activations between regions are 1/tp.

Gradients are complete when backward returns; the trainer calls nothing:
- sharded parameters: the grad of a shard is the shard of the full grad;
- replicated parameters whose grad is partial per rank (RMSNorm weights under
  sequence parallelism; k/v projections replicated because Hkv < tp) carry a
  tensor hook that sums their grad over the ranks sharing them during backward,
  before it is accumulated into .grad (so before DeepSpeed's own hooks).

`p.tensor_model_parallel` (with `p.partition_dim`) marks sharded parameters.
DeepSpeed's gradient norm counts a parameter on every rank when it is marked
True and only on model-parallel rank 0 otherwise. A k/v projection replicated
over tp/Hkv ranks is marked True on the first rank sharing it and False on
the others, so every distinct tensor is counted exactly once.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..models.init import global_view, mark_shard
from .comm import (CommCounter, all_gather_along_dim, all_reduce_tensor, copy_to_region, reduce_from_region,
                   reduce_scatter_along_dim)
from .mesh import Mesh

IGNORE_INDEX = -100  # F.cross_entropy's default, which lm_loss uses


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError when the llama3 model cannot be split over tp ranks."""
    kv = cfg.num_key_value_heads or cfg.num_attention_heads
    if cfg.arch != "llama3":
        raise ValueError(f"tensor parallelism is implemented for model.arch llama3, got {cfg.arch}.")
    if cfg.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) must be divisible by tp ({tp}).")
    if kv % tp and tp % kv:
        raise ValueError(f"num_key_value_heads ({kv}) must be divisible by tp ({tp}) or divide it.")
    if cfg.intermediate_size % tp:
        raise ValueError(f"intermediate_size ({cfg.intermediate_size}) must be divisible by tp ({tp}).")
    if cfg.vocab_size % tp:
        raise ValueError(f"vocab_size ({cfg.vocab_size}) must be divisible by tp ({tp}).")
    if cfg.attention_bias and tp > 1:
        raise ValueError("attention_bias with tp > 1 is not supported (o_proj's bias would be added tp times).")


# ----------------------------------------------------------------------------- pure slicing

def kv_heads_of_rank(cfg: ModelConfig, tp: int, index: int) -> tuple[int, int]:
    """(first kv head, number of kv heads) that tp rank `index` holds."""
    hq, kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    if kv % tp == 0:
        return index * (kv // tp), kv // tp
    first_q = index * (hq // tp)
    return first_q // (hq // kv), 1  # replicated: the kv head of this rank's query heads


def shard_range(name: str, cfg: ModelConfig, tp: int, index: int) -> Optional[tuple[int, int, int]]:
    """Pure: (dim, start, length) of the part of parameter `name` that tp rank `index` holds, or
    None when every tp rank holds all of it (norms)."""
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    if name in ("embed_tokens.weight", "lm_head.weight"):
        v = cfg.vocab_size // tp
        return 0, index * v, v
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        n = cfg.num_attention_heads // tp * head_dim
        return 0, index * n, n
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                      "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
        first, n = kv_heads_of_rank(cfg, tp, index)
        return 0, first * head_dim, n * head_dim
    if name.endswith("self_attn.o_proj.weight"):
        n = cfg.num_attention_heads // tp * head_dim
        return 1, index * n, n
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        n = cfg.intermediate_size // tp
        return 0, index * n, n
    if name.endswith("mlp.down_proj.weight"):
        n = cfg.intermediate_size // tp
        return 1, index * n, n
    return None


def shard_param(name: str, full: torch.Tensor, cfg: ModelConfig, tp: int, index: int
                ) -> tuple[torch.Tensor, Optional[int]]:
    """Pure: (the part of parameter `name` that tp rank `index` holds, the dim it is split along or None).

    Works for weights and for their gradients alike (the grad of a shard is the
    shard of the grad), so tests and checkpoint conversion reuse it.
    """
    r = shard_range(name, cfg, tp, index)
    if r is None:
        return full, None  # norms: replicated
    dim, start, n = r
    return full.narrow(dim, start, n), dim


# ----------------------------------------------------------------------------- modules

class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + V/tp) of the table. Ids outside give
    zeros; summing over tp (all-reduce, or reduce-scatter along the sequence
    under sequence parallelism) completes every row.
    (B, T) ids -> (B, T, d), or (B, T/tp, d) under sequence parallelism."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group, sequence_parallel: bool,
                 counter: Optional[CommCounter]):
        super().__init__()
        self.weight = weight  # the same Parameter object: ties with lm_head survive
        self.vocab_start, self.group, self.sequence_parallel, self.counter = (
            vocab_start, group, sequence_parallel, counter)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        h = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1)
        if self.sequence_parallel:
            return reduce_scatter_along_dim(h, 1, self.group, self.counter)
        return reduce_from_region(h, self.group, self.counter)


class VocabParallelCrossEntropy:
    """Mean cross-entropy from vocabulary-sharded logits (B, T, V/tp) and global
    labels (B, T); equals F.cross_entropy of the gathered logits (labels of
    IGNORE_INDEX are skipped). The max and the sum of exponentials are reduced
    over tp, and the target logit is picked on the rank that owns it, so only
    (B, T)-sized tensors travel. Every tp rank returns the same loss."""

    def __init__(self, vocab_start: int, group, counter: Optional[CommCounter] = None):
        self.vocab_start, self.group, self.counter = vocab_start, group, counter

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        v_local = logits.shape[-1]
        # the max only stabilises exp(); it cancels in the loss, so no grad flows through it
        m = all_reduce_tensor(logits.detach().amax(-1, keepdim=True), self.group, self.counter,
                              "tp_loss_all_reduce", op=dist.ReduceOp.MAX)
        shifted = logits - m
        sum_exp = reduce_from_region(shifted.exp().sum(-1), self.group, self.counter, "tp_loss")  # (B, T)
        local = labels - self.vocab_start
        mine = (local >= 0) & (local < v_local)
        picked = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
        target = reduce_from_region(torch.where(mine, picked, 0.0), self.group, self.counter, "tp_loss")
        valid = labels != IGNORE_INDEX
        per_token = torch.where(valid, sum_exp.log() - target, 0.0)
        return per_token.sum() / valid.sum()


@torch.no_grad()
def gather_logits(logits: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Full (B, T, V) logits from the vocabulary shards; for tests and evaluation
    only: training never materialises them."""
    if mesh.size("tp") == 1:
        return logits
    return all_gather_along_dim(logits, -1, mesh.group("tp"))


# ----------------------------------------------------------------------------- applying it

def _enter_region(module: nn.Module, group, sequence_parallel: bool, counter) -> None:
    """The module's first input becomes the full sequence, replicated over tp."""
    def hook(_module, args):
        x = args[0]
        x = (all_gather_along_dim(x, 1, group, counter) if sequence_parallel
             else copy_to_region(x, group, counter))
        return (x,) + tuple(args[1:])
    module.register_forward_pre_hook(hook)


def _leave_region(module: nn.Module, group, sequence_parallel: bool, counter) -> None:
    """The module's partial output (B, T, d) is summed over tp (scattered along T under SP)."""
    def hook(_module, _args, out):
        return (reduce_scatter_along_dim(out, 1, group, counter) if sequence_parallel
                else reduce_from_region(out, group, counter))
    module.register_forward_hook(hook)


def _sum_grad_over_tp(p: nn.Parameter, group, counter) -> None:
    """Replicated on every tp rank, partial grad on each: sum it during backward."""
    p.register_hook(lambda g: all_reduce_tensor(g, group, counter, "tp_grad_all_reduce"))


def _sum_grad_over_sharers(p: nn.Parameter, slot: int, n_slots: int, group, counter) -> None:
    """Held by the tp ranks whose query heads use kv head `slot`: sum their grads.
    Each rank writes its grad into its slot of a zero (n_slots, ...) buffer; an
    all-reduce over tp then adds up exactly the ranks sharing each slot."""
    def hook(g):
        buf = g.new_zeros((n_slots,) + tuple(g.shape))
        buf[slot] = g
        return all_reduce_tensor(buf, group, counter, "tp_grad_all_reduce")[slot]
    p.register_hook(hook)


def shard_weights(model: nn.Module, cfg: ModelConfig, tp: int, index: int) -> None:
    """Slice every parameter in place (same Parameter objects, so ties survive; real or on the
    meta device), set the tensor_model_parallel / partition_dim marks, and record each shard's
    place in the global tensor (models/init.py's shard_of)."""
    replicated_kv = (cfg.num_key_value_heads or cfg.num_attention_heads) < tp
    for name, p in model.named_parameters():
        parent = global_view(p)
        part, dim = shard_param(name, p.data, cfg, tp, index)
        p.data = part.clone()
        p.tensor_model_parallel = dim is not None
        if dim is not None:
            p.partition_dim = dim
            offsets = [0] * p.dim()
            offsets[dim] = shard_range(name, cfg, tp, index)[1]
            mark_shard(p, parent, offsets)
        if replicated_kv and name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            sharers = tp // (cfg.num_key_value_heads or cfg.num_attention_heads)
            p.tensor_model_parallel = index % sharers == 0  # count each distinct head once (module docstring)
    for module in model.modules():  # keep the modules' shape attributes truthful
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape


def apply_tensor_parallel(model: nn.Module, mesh: Mesh, sequence_parallel: bool,
                          counter: Optional[CommCounter] = None) -> nn.Module:
    """Shard a plain, fully initialised Llama3 over the mesh's tp group, in place.

    Afterwards `model(input_ids, labels)` takes the full (B, T) ids on every tp
    rank; `.logits` is this rank's vocabulary shard (B, T, V/tp) (`gather_logits`
    for the full ones) and `.loss` the full mean loss, identical on every tp rank.
    """
    tp = mesh.size("tp")
    if tp == 1:
        return model
    cfg = model.cfg
    check_tensor_parallel(cfg, tp)
    group, index = mesh.group("tp"), mesh.index("tp")
    n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
    shard_weights(model, cfg, tp, index)
    vocab_start = index * (cfg.vocab_size // tp)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, vocab_start, group,
                                                sequence_parallel, counter)
    for layer in model.layers.values():
        attn = layer.self_attn
        attn.n_heads //= tp
        attn.n_kv_heads = kv_heads_of_rank(cfg, tp, index)[1]
        for region in (attn, layer.mlp):
            _enter_region(region, group, sequence_parallel, counter)
            _leave_region(region, group, sequence_parallel, counter)
        if n_kv < tp:  # replicated kv heads: each grad is partial to the ranks sharing it
            slot = kv_heads_of_rank(cfg, tp, index)[0]
            for proj in (attn.k_proj, attn.v_proj):
                for p in proj.parameters():
                    _sum_grad_over_sharers(p, slot, n_kv, group, counter)
        if sequence_parallel:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                _sum_grad_over_tp(norm.weight, group, counter)
    _enter_region(model.lm_head, group, sequence_parallel, counter)
    if sequence_parallel:
        _sum_grad_over_tp(model.norm.weight, group, counter)
    model.loss_fn = VocabParallelCrossEntropy(vocab_start, group, counter)
    return model
