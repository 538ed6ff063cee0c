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
        **precision_config(t),
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


def precision_config(t) -> dict:
    """The DeepSpeed keys of the training dtype.

    bf16 with fp32 accumulation (the default): DeepSpeed's BF16_Optimizer sums every micro-batch's
    bf16 gradient into an fp32 buffer of the whole model (4 bytes/param, kept on every data-parallel
    rank) and all-reduces that buffer in fp32, as Megatron's main gradients; the engine's
    communication dtype would otherwise be bf16 and round the sum on the wire.
    `immediate_grad_update`: each parameter's bf16 gradient is added to the fp32 buffer by a hook as
    soon as autograd has accumulated it, and freed, so no bf16 gradient outlives its backward. It is
    also what makes the sum right here: without it BF16_Optimizer adds the whole bf16 .grad after each
    backward and relies on the engine zeroing .grad first, which the engine does from a hook on the
    forward's output tensors, and our models return an LMOutput it does not look into (the
    micro-batches' gradients would be summed 4, 3, 2, 1 times).
    train.grad_accum_dtype=bf16: ZeRO-1 (DeepSpeedZeroOptimizer) sums the micro-batches in the bf16
    param.grad and reduces them in bf16. fp32 runs need none of this."""
    if t.dtype != "bf16":
        return {"bf16": {"enabled": False}}
    if t.grad_accum_dtype == "bf16":
        return {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}
    return {"bf16": {"enabled": True, "immediate_grad_update": True}, "data_types": {"grad_accum_dtype": "fp32"},
            "communication_data_type": "fp32"}


def uses_bf16_optimizer(engine) -> bool:
    """Is the engine's optimizer DeepSpeed's BF16_Optimizer (bf16 weights, fp32 gradient accumulation)
    rather than its ZeRO-1 DeepSpeedZeroOptimizer? Their flat partitions are named differently."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    return isinstance(engine.optimizer, BF16_Optimizer)


def fp32_partitions(engine) -> list[torch.Tensor]:
    """This rank's flat fp32 master-weight partition of every optimizer param group (the tensors the
    torch optimizer steps and keys its state by)."""
    opt = engine.optimizer
    return opt.fp32_groups_flat_partition if uses_bf16_optimizer(engine) else opt.single_partition_of_fp32_groups


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
