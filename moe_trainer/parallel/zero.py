"""DeepSpeed ZeRO-1: the DeepSpeed config generated from ours, and the engine.

The DeepSpeed JSON is derived here and nowhere else (STYLE: one config tree).
"""
from __future__ import annotations

import logging

import torch

from ..config import Config, Layout


def deepspeed_config(cfg: Config, layout: Layout, comms_logger: bool = False) -> dict:
    """comms_logger: turn on DeepSpeed's comms logger for every op (deepspeed.comm.comms_logger.comms_dict
    then holds {op: {message bytes: [count, latencies, algbw, busbw]}}; tests and bench_layouts read it)."""
    t = cfg.train
    out = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": layout.grad_accum,
        # DeepSpeed counts the ranks it reduces over (dp x cp) as data parallel
        "train_batch_size": t.micro_batch_size * layout.grad_accum * layout.dp * layout.cp,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": t.dtype == "bf16"},
        # torch's AdamW, fused: one pass over the flat fp32 partition (CPU and CUDA kernels in
        # torch), no JIT-built DeepSpeed op; the unfused loop took 4x longer on a CPU rank
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.adam_eps,
                                                  "weight_decay": t.weight_decay, "torch_adam": True, "fused": True}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "seed": cfg.run.seed,
    }
    if comms_logger:
        out["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": True}
    return out


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; norms, biases and 1-D gains are not decayed."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return groups


def build_engine(model: torch.nn.Module, cfg: Config, layout: Layout, mpu=None):
    import deepspeed
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.WARNING)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, cfg.train.weight_decay),
                                           config=deepspeed_config(cfg, layout), mpu=mpu)
    return engine


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
