"""Activation recomputation (parallel.recompute), applied to a plain model.

full:      every decoder layer (and MTP block) keeps only its input; the whole
           layer runs again in backward. Least memory, about one extra forward.
selective: only the cheap, activation-heavy pieces are recomputed: every
           RMSNorm and the SwiGLU activations (dense FFN and shared experts).
           The routed experts' kernel is left alone: it keeps its input,
           pre-activation and SwiGLU output (full recomputation drops them).
Recomputing an MoE layer must not count its tokens twice: the counters are
saved before the re-run and put back after it.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models.layers import RMSNorm, SwiGLU
from ..moe.layer import MoE


class _KeepCounters(contextlib.ContextDecorator):
    """During a recomputation, leave the MoE counters as the real forward left them."""

    def __init__(self, module: nn.Module):
        self.moe = [m for m in module.modules() if isinstance(m, MoE)]

    def __enter__(self):
        self.saved = [(m.tokens_per_expert.clone(), m.stats.clone()) for m in self.moe]

    def __exit__(self, *exc):
        with torch.no_grad():
            for m, (tokens, stats) in zip(self.moe, self.saved):
                m.tokens_per_expert.copy_(tokens)
                m.stats.copy_(stats)
        return False


def _checkpointed(fn, owner: nn.Module):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            # inside a compiled region (train.compile) the recomputation is the partitioner's: it
            # re-runs the forward's ops in the backward graph, while the counters' updates (buffer
            # mutations) stay in the forward graph, once
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), _KeepCounters(owner)), **kwargs)
    return run


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = list(model.layers.values())
    for mtp in getattr(model, "mtp", {}).values() if hasattr(model, "mtp") else []:
        layers.append(mtp.block)
    return layers


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Swap forwards for checkpointed ones in place (parameter names unchanged)."""
    if mode == "full":
        for layer in decoder_layers(model):
            layer.forward = _checkpointed(layer.forward, layer)
    elif mode == "selective":
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.forward = _checkpointed(m.forward, m)
            elif isinstance(m, SwiGLU):
                m.act = _checkpointed(m.act, m)
    return model
