"""The one ordered application of parallelism to a plain model:
TP -> EP -> CP -> activation recomputation; the pipeline split (pipeline.build_stage)
and data parallelism (the ZeRO-1 engine) follow in the trainer.

Each step is a small standalone function; data parallelism (ZeRO-1) is the
DeepSpeed engine built afterwards in zero.py. An expert placement plan
(parallel.expert_placement, replicas.py) is read and checked here, on the whole
model, so each pipeline stage later keeps the rows of its own MoE layers.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import Config, ConfigError
from .comm import CommCounter
from .context import apply_context_parallel
from .expert import apply_expert_parallel
from .replicas import load_placement
from .tensor import apply_tensor_parallel
from .mesh import Mesh
from .recompute import apply_recompute


def parallelize(model: torch.nn.Module, cfg: Config, mesh: Mesh, counter: Optional[CommCounter] = None
                ) -> torch.nn.Module:
    p = cfg.parallel
    try:
        model = apply_tensor_parallel(model, mesh, p.sequence_parallel, counter)
        # slot-owned experts (replace_every, slots.py) start at home and place themselves
        placement = None if p.replace_every else load_placement(cfg, mesh.layout.ep, mesh.index("ep"),
                                                                 log=mesh.rank == 0)
        model = apply_expert_parallel(model, mesh, counter, dedup=p.dedup_dispatch, placement=placement,
                                      cpu_alltoall=p.cpu_alltoall, timeout_s=p.timeout_s)
        model = apply_context_parallel(model, mesh, counter)
        model = apply_recompute(model, p.recompute)
    except ValueError as e:  # a degree that does not fit this model, or a bad placement plan
        raise ConfigError(str(e)) from None
    return model
