"""model.arch -> model class. The trainer builds models only through here."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .deepseek_v3 import DeepseekV3
from .lm import CausalLM
from .llama3 import Llama3

ARCHS = {"deepseek_v3": DeepseekV3, "llama3": Llama3}


def build_model(cfg: ModelConfig, seed: int = 1234) -> CausalLM:
    """Same seed -> same weights, whatever the layout (parallelism slices afterwards)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ARCHS[cfg.arch](cfg)


def moe_layers(model: torch.nn.Module) -> list:
    """(name, MoE module) pairs in a fixed order: main layers, then MTP blocks."""
    from ..moe.layer import MoE
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
