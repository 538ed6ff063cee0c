"""The module one rank holds, from its coordinates alone (no process group): the plain model on
the meta device, cut the way parallelize() and build_stage() cut it (TP shards, this EP rank's
experts, this pipeline stage). The planner test compares its parameter counts with
plan.rank_params; `materialize` (models/init.py) gives it the values the trainer's rank starts from.
"""
from __future__ import annotations

from torch import nn

from ..config import Config
from ..models.init import materialize
from ..models.registry import build_model
from ..moe.layer import MoE
from .expert import shard_experts
from .pipeline import build_stage
from .tensor import check_tensor_parallel, shard_weights


def rank_local_model(cfg: Config, pp: int = 0, ep: int = 0, tp: int = 0, materialized: bool = False) -> nn.Module:
    """The module of the rank at pipeline stage `pp`, expert-parallel index `ep`, tensor-parallel
    index `tp` of cfg.parallel's layout; on the meta device unless `materialized`."""
    p = cfg.parallel
    model = build_model(cfg.model, cfg.run.seed, materialized=False)
    if p.tp > 1:
        check_tensor_parallel(cfg.model, p.tp)
        shard_weights(model, cfg.model, p.tp, tp)
    if p.ep > 1:
        for layer in [m for m in model.modules() if isinstance(m, MoE)]:
            shard_experts(layer, ep, p.ep)
    if p.pp > 1:
        model = build_stage(model, cfg, pp, cfg.train.seq_len)
    return materialize(model, cfg.run.seed, cfg.model.initializer_range) if materialized else model
