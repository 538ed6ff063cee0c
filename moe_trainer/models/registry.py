"""model.arch -> model class. The trainer builds models only through here."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ..config import ModelConfig
from .deepseek_v3 import DeepseekV3
from .init import materialize
from .lm import CausalLM
from .llama3 import Llama3

ARCHS = {"deepseek_v3": DeepseekV3, "llama3": Llama3}


# The random fills that modules' constructors run (nn.init and Tensor methods). On the meta device they have no
# values to give, and torch decomposes them there through code that imports torch._dynamo: 2 s of one core at
# every start, on every rank and in every tool that counts a model.
_RANDOM_FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_",
                           "xavier_normal_", "xavier_uniform_", "orthogonal_", "sparse_", "random_",
                           "exponential_", "bernoulli_", "cauchy_", "geometric_", "log_normal_"})


class _SkipMetaFills(TorchFunctionMode):
    """Random fills of meta tensors return the tensor untouched; everything else runs as called."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _RANDOM_FILLS:
            target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def meta_model(cfg: ModelConfig) -> CausalLM:
    """The whole model on the meta device: shapes and names, no memory, no initial values."""
    with torch.device("meta"), _SkipMetaFills():
        return ARCHS[cfg.arch](cfg)


def build_model(cfg: ModelConfig, seed: int = 1234, materialized: bool = True) -> CausalLM:
    """Same seed -> same weights, whatever the layout. The model is built on the meta device;
    `materialized=False` returns it so (parallelism slices it, then `materialize` fills only what
    a rank keeps: models/init.py), else every parameter is given its initial values here."""
    model = meta_model(cfg)
    return materialize(model, seed, cfg.initializer_range) if materialized else model


def moe_layers(model: torch.nn.Module) -> list:
    """(name, MoE module) pairs in a fixed order: main layers, then MTP blocks."""
    from ..moe.layer import MoE
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
