"""The one ordered application of parallelism to a plain model:
TP -> EP -> CP -> activation recomputation; the pipeline split (pipeline.build_stage)
and data parallelism (the ZeRO-1 engine) follow in the trainer.

Each step is a small standalone function; data parallelism (ZeRO-1) is the
DeepSpeed engine built afterwards in zero.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import Config, ConfigError
from .comm import CommCounter
from .context import apply_context_parallel
from .expert import apply_expert_parallel
from .tensor import apply_tensor_parallel
from .mesh import Mesh
from .recompute import apply_recompute


def parallelize(model: torch.nn.Module, cfg: Config, mesh: Mesh, counter: Optional[CommCounter] = None
                ) -> torch.nn.Module:
    p = cfg.parallel
    try:
        model = apply_tensor_parallel(model, mesh, p.sequence_parallel, counter)
        model = apply_expert_parallel(model, mesh, counter, dedup=p.dedup_dispatch)
        model = apply_context_parallel(model, mesh, counter)
        model = apply_recompute(model, p.recompute)
    except ValueError as e:  # a degree that does not fit this model
        raise ConfigError(str(e)) from None
    return model
