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
    """Decay matrices only; norms, biases and 1-D gains are not decayed. Expert-parallel parameters
    (a module DeepSpeed sees as MoE) go last, one group per expert group, 'moe' as DeepSpeed's own split
    marks it but never cut in pieces (DeepSpeed cuts at 179M elements, a count that differs between
    pipeline stages, and ZeRO-1 makes one norm all-reduce over the stages per group: same_norm_collectives)."""
    marker = getattr(model, "deepspeed_moe_marker", None)
    decay, no_decay, experts = [], [], {}
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if marker is not None and getattr(p, "allreduce", True) is False:
            experts.setdefault(p.group_name, []).append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    for name, params in experts.items():
        if any(p.dim() < 2 for p in params):
            raise ValueError(f"expert-parallel parameters are matrices (decayed); {name} holds a 1-D one")
        groups.append({"params": params, "weight_decay": weight_decay, "name": name, "moe": True})
    return groups


def model_expert_groups(module: torch.nn.Module) -> list[str]:
    """The expert group names of the whole model (DeepSpeed's MoE groups), also on a pipeline stage
    that holds none of its experts (the stage keeps the full model as `_model`)."""
    full = getattr(module, "_model", (module,))[0]
    marker = getattr(full, "deepspeed_moe_marker", None)
    return [marker.expert_group_name] if marker is not None else []


def build_engine(model: torch.nn.Module, cfg: Config, layout: Layout, mpu=None):
    import deepspeed
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.WARNING)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, cfg.train.weight_decay),
                                           config=deepspeed_config(cfg, layout), mpu=mpu)
    same_norm_collectives(engine.optimizer, model_expert_groups(model), uses_bf16_optimizer(engine))
    return engine


def same_norm_collectives(opt, expert_groups: list[str], bf16: bool) -> None:
    """Make the optimizer's gradient-norm collectives the model's, not this pipeline stage's.

    The global norm is summed over the pipeline stages (DeepSpeed's model-parallel and pipeline groups),
    and DeepSpeed makes those all-reduces per group this rank holds: BF16_Optimizer one per expert group
    with gradients here (get_norm_with_moe_layers, only when the engine found MoE layers on this stage),
    ZeRO-1 one per optimizer param group (get_grad_norm_direct). A stage without experts (dense layers
    first, as DeepSeek-V3's first_k_dense_replace) would skip calls that the other stages make, and the
    next all-reduce on the group (the step's losses) would meet them: a hang, or a loss added to a squared
    norm. Here every stage takes the norm of every expert group of the model, a zero where it holds none,
    in the same order (experts after the dense groups, param_groups), so the calls are the same on every
    stage by construction. Nothing changes where the model has no expert-parallel layers."""
    if not expert_groups:
        return
    if bf16:
        _bf16_every_expert_group(opt, expert_groups)
    else:
        _zero_every_expert_group(opt, expert_groups)


def _bf16_every_expert_group(opt, expert_groups: list[str]) -> None:
    # step() reduces the expert norms only where has_moe_layers; the engine sets it from the stage's own
    # modules (a stage without experts cannot be MoE to DeepSpeed: it would need an expert param group)
    opt.has_moe_layers = True
    if not hasattr(opt, "expert_gradients"):
        opt.expert_gradients = {}  # get_grads_for_reduction's expert part: nothing to reduce on this stage
    inner = opt.get_grads_for_norm
    device = opt.fp32_groups_flat_partition[0].device

    def every_expert_group(for_clipping=False):
        out = inner(for_clipping=for_clipping)
        if for_clipping:
            return out
        dense, experts = out
        return dense, {name: experts.get(name) or [torch.zeros(1, device=device)] for name in expert_groups}
    opt.get_grads_for_norm = every_expert_group


def _zero_every_expert_group(opt, expert_groups: list[str]) -> None:
    # the groups param_groups makes on a stage holding every kind of parameter, in its order; DeepSpeed
    # drops empty ones, so a stage holds a prefix of them (every layer has norms: no_decay is never empty)
    expected = ["decay", "no_decay", *expert_groups]
    names = [g["name"] for g in opt.optimizer.param_groups]
    if names != expected[:len(names)]:
        raise ValueError(f"the optimizer's param groups {names} are not a prefix of {expected} (param_groups)")
    missing = expected[len(names):]
    if not missing:
        return
    from deepspeed.runtime.utils import combine_grad_norm_groups
    inner = opt.scaled_global_norm

    def with_every_expert_group(norm_type=2):
        norm = inner(norm_type)
        # each absent group's norm through the same dp and model-parallel all-reduces as the other stages':
        # 0 from this stage, the other stages' experts summed in (the class's method: noise_scale records
        # the instance's, this rank's groups only)
        experts = [type(opt).get_grad_norm_direct(opt, [], [], norm_type) for _ in missing]
        return combine_grad_norm_groups([norm, *experts], norm_type=norm_type)
    opt.scaled_global_norm = with_every_expert_group


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
