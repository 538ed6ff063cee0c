"""model.arch -> model class. The trainer builds models only through here."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .deepseek_v3 import DeepseekV3
from .init import materialize
from .lm import CausalLM
from .llama3 import Llama3

ARCHS = {"deepseek_v3": DeepseekV3, "llama3": Llama3}


def build_model(cfg: ModelConfig, seed: int = 1234, materialized: bool = True) -> CausalLM:
    """Same seed -> same weights, whatever the layout. The model is built on the meta device;
    `materialized=False` returns it so (parallelism slices it, then `materialize` fills only what
    a rank keeps: models/init.py), else every parameter is given its initial values here."""
    with torch.device("meta"):
        model = ARCHS[cfg.arch](cfg)
    return materialize(model, seed, cfg.initializer_range) if materialized else model


def moe_layers(model: torch.nn.Module) -> list:
    """(name, MoE module) pairs in a fixed order: main layers, then MTP blocks."""
    from ..moe.layer import MoE
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
