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
from .expert import apply_expert_parallel
from .mesh import Mesh


def parallelize(model: torch.nn.Module, cfg: Config, mesh: Mesh, counter: Optional[CommCounter] = None
                ) -> torch.nn.Module:
    p = cfg.parallel
    unsupported = {"parallel.tp": p.tp, "parallel.cp": p.cp}
    for key, value in unsupported.items():
        if value > 1:
            raise ConfigError(f"{key} > 1 is not implemented yet in this version of moe_trainer; set it to 1.")
    if p.recompute != "none":
        raise ConfigError("parallel.recompute is not implemented yet in this version of moe_trainer; set it to none.")
    return apply_expert_parallel(model, mesh, counter, dedup=p.dedup_dispatch)
