"""The one ordered application of parallelism to a plain model:
TP -> EP -> CP -> activation recomputation -> (pipeline split) -> data parallel.

Each step is a small standalone function; data parallelism (ZeRO-1) is the
DeepSpeed engine built afterwards in zero.py.
"""
from __future__ import annotations

import torch

from ..config import Config
from .mesh import Mesh


def parallelize(model: torch.nn.Module, cfg: Config, mesh: Mesh) -> torch.nn.Module:
    p = cfg.parallel
    unsupported = {"parallel.tp": p.tp, "parallel.cp": p.cp, "parallel.pp": p.pp, "parallel.ep": p.ep}
    for key, value in unsupported.items():
        if value > 1:
            raise NotImplementedError(f"{key} > 1 is not implemented yet in this version of moe_trainer.")
    if p.recompute != "none":
        raise NotImplementedError("parallel.recompute is not implemented yet in this version of moe_trainer.")
    return model
