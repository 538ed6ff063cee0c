"""The plan of one config on N GPUs: memory and traffic of every pipeline stage (`make_plan`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..config import Config, ConfigError, Layout, validate_layout
from .comm import (AllToAllBytes, ZeroComm, _kv_bytes_per_token, _passes, alltoall_bytes_expected, context_parallel_bytes,
                   pipeline_bytes, tensor_parallel_bytes, tensor_parallel_extra_bytes, zero_comm)
from .nodes import Links, stage_node_traffic
from .memory import (CopyBytes, ModelStateBytes, RankParams, StageActivations, _stage_blocks, copy_bytes,
                     grad_reduce_bytes, micro_batch_grad_bytes, model_state_bytes, rank_params,
                     stage_activation_bytes)
from .params import (GB, PRECISIONS, ParamCount, ParamReport, PlanError, Precision, count_parameters, is_moe_layer,
                     mtp_layers, precision_for)
from .pipeline import bubble_fraction, stage_partition
from ..parallel.order import group_ranks


# ----------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class StageComm:
    """Bytes one rank of a stage sends per optimizer step, by kind (received: the same)."""

    dense_dp: ZeroComm  # dense parameters over the dp * cp ranks that replicate them
    expert_dp: ZeroComm  # expert parameters over the expert-data-parallel group
    all_to_all: float  # MoE dispatch + combine, forward and backward (+ recomputation)
    pipeline: float
    tensor: float
    context: float
    total: float


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage, seen from one of its ranks."""

    stage: int
    layers: int  # decoder layers
    moe_blocks: int  # MoE layers, the last stage's MTP blocks included
    mtp_blocks: int  # multi-token-prediction modules (the last stage's; 0 elsewhere)
    params: RankParams
    states: ModelStateBytes  # under the plan's ZeRO stage and precision
    activations: StageActivations
    activation_bytes: float  # under the config's parallel.recompute
    total: float  # states + copies.cache + max(activation_bytes, copies.after_backward, grad_reduce)
    comm: StageComm
    nodes: dict = dataclasses.field(default_factory=dict)  # kind -> NodeTraffic (inside / across nodes, time)
    comm_seconds: float = 0.0  # the kinds' times added up (no overlap with compute or each other assumed)
    grad_reduce: float = 0.0  # the step boundary's gradient buckets (memory.grad_reduce_bytes)
    copies: CopyBytes = CopyBytes()  # parallel.redundant_slots (memory.copy_bytes; in activation_bytes but the cache)


@dataclass(frozen=True)
class Plan:
    """Memory per rank and traffic per step of one config on `gpus` GPUs."""

    arch: str
    gpus: int
    pp: int
    dp: int
    tp: int
    cp: int
    ep: int
    edp: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    global_batch_size: int
    zero: int
    precision: Precision
    recompute: str
    sequence_parallel: bool
    dedup_dispatch: bool
    dense_group: int  # ranks that replicate (and ZeRO-shard) the dense parameters: dp * cp
    gpu_memory_gb: float
    params: ParamReport
    partition: list
    stages: list  # StagePlan per stage
    state_table: dict  # precision name -> [ModelStateBytes for ZeRO 0..3] on `heaviest_stage`
    heaviest_stage: int  # the stage with the most model-state bytes
    alltoall_per_layer: AllToAllBytes  # one MoE layer, one micro-batch, forward
    bubble: float
    peak_stage: int
    peak_bytes: float
    fits: bool
    virtual_stages: int = 1  # chunks per pipeline rank (interleaved 1F1B when > 1)
    sp_regather: bool = False  # planned with Megatron's sharded sequence-parallel inputs (not this trainer's)
    gpus_per_node: int = 8
    links: Links = Links()
    rank_order: str = ""


def _tokens_per_rank(cfg: Config) -> float:
    """Tokens of one micro-batch on one rank: micro_batch_size * seq_len / cp."""
    return cfg.train.micro_batch_size * cfg.train.seq_len / cfg.parallel.cp


@dataclass(frozen=True)
class _Setting:
    """What every stage of a plan shares."""

    precision: Precision
    zero: int
    micro_batches: int
    dense_group: int  # dp * cp
    edp: int
    alltoall: AllToAllBytes  # one MoE layer, one micro-batch, forward
    sp_regather: bool = False  # sequence-parallel region inputs kept as shards (memory.gathered_input_bytes)


def _stage_comm(cfg: Config, st: _Setting, stage: int, blocks: list[int], params: RankParams) -> StageComm:
    """Traffic of one rank of `stage` per optimizer step."""
    m, p = cfg.model, cfg.parallel
    b, tokens, mb = st.precision.act_bytes, _tokens_per_rank(cfg), st.micro_batches
    sp = p.sequence_parallel and p.tp > 1
    moe = sum(is_moe_layer(m, i) for i in blocks)
    a2a = moe * mb * _passes(p.recompute) * st.alltoall.sent
    dense = zero_comm(params.dense, st.dense_group, st.zero, mb, st.precision, stage1_all_reduce=True)
    expert = zero_comm(params.expert, st.edp, st.zero, mb, st.precision, stage1_all_reduce=True)
    width = m.hidden_size * (2 if mtp_layers(m) else 1)  # MTP: the token embeddings travel with h
    pipe = pipeline_bytes(stage, p.pp, mb, tokens * width * b / (p.tp if sp else 1))
    tensor = tensor_parallel_bytes(len(blocks), mb, p.tp, tokens * m.hidden_size * b, p.recompute) + \
        tensor_parallel_extra_bytes(m, stage, p.pp, len(blocks), mb, p.tp, tokens, b, st.precision.grad_bytes, sp)
    context = context_parallel_bytes(len(blocks), mb, p.cp, tokens * _kv_bytes_per_token(m, p.tp, b), p.recompute)
    total = dense.total + expert.total + a2a + pipe + tensor + context
    return StageComm(dense, expert, a2a, pipe, tensor, context, total)


def _stage_plan(cfg: Config, st: _Setting, partition: list[int], stage: int, params: RankParams) -> StagePlan:
    """Memory and traffic of one rank of `stage`."""
    states = model_state_bytes(params, st.precision, st.zero, st.dense_group, st.edp)
    acts = stage_activation_bytes(cfg, partition, stage, st.micro_batches, st.precision, st.sp_regather)
    act = acts.full_recompute if cfg.parallel.recompute == "full" else acts.no_recompute
    act += micro_batch_grad_bytes(params, st.precision, st.zero)
    blocks = _stage_blocks(cfg.model, partition, stage)
    comm = _stage_comm(cfg, st, stage, blocks, params)
    moe = sum(is_moe_layer(cfg.model, i) for i in blocks)
    copies = copy_bytes(cfg, moe, st.precision)
    act += copies.activations
    mtp = mtp_layers(cfg.model) if stage == len(partition) - 1 else 0
    reduce = grad_reduce_bytes(params, st.precision) if st.zero < 2 else 0.0
    return StagePlan(stage, partition[stage], moe, mtp, params, states, acts, act,
                     states.total + copies.cache + max(act, copies.after_backward, reduce), comm, grad_reduce=reduce,
                     copies=copies)


def layout_on(cfg: Config, gpus: int, gpus_per_node: Optional[int] = None) -> Layout:
    """The layout of `cfg` on `gpus` GPUs, or a PlanError: one sentence naming --gpus, what it must
    factor into, and (for pp x tp x cp) the nearest counts that would."""
    p = cfg.parallel
    model_par = p.pp * p.tp * p.cp
    if gpus % model_par:
        below, above = gpus // model_par * model_par, (gpus // model_par + 1) * model_par
        nearest = f"{below} or {above}" if below else f"{above}"
        raise PlanError(f"--gpus {gpus} does not factor into the layout: it must be a multiple of parallel.pp x "
                        f"parallel.tp x parallel.cp = {p.pp} x {p.tp} x {p.cp} = {model_par} (e.g. --gpus {nearest}).")
    try:
        return validate_layout(cfg, gpus, gpus_per_node)
    except ConfigError as e:  # the config's own sentence, with the data-parallel size --gpus gives
        raise PlanError(f"--gpus {gpus} does not factor into the layout (data parallel {gpus // model_par}): "
                        f"{e}") from None


def make_plan(cfg: Config, gpus: int, gpu_memory_gb: float = 80.0, zero: int = 1,
              precision: Optional[str] = None, gpus_per_node: int = 8, links: Links = Links(),
              sp_regather: bool = False) -> Plan:
    """Plan a validated config on `gpus` GPUs (dp = gpus / (pp * tp * cp)) with ZeRO stage `zero` and a
    precision recipe of `PRECISIONS` (default from train.dtype). Raises ConfigError for a layout that
    does not divide and PlanError for other bad numbers."""
    if gpus < 1:
        raise PlanError(f"--gpus must be a positive integer, got {gpus}.")
    if zero not in (0, 1, 2, 3):
        raise PlanError(f"--zero must be 0, 1, 2 or 3, got {zero}.")
    if gpu_memory_gb <= 0:
        raise PlanError(f"--gpu-memory-gb must be positive, got {gpu_memory_gb}.")
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if gpus_per_node < 1:
        raise PlanError(f"--gpus-per-node must be a positive integer, got {gpus_per_node}.")
    if links.nvlink_gbps <= 0 or links.ib_gbps <= 0:
        raise PlanError(f"--nvlink-gbps and --ib-gbps must be positive, got {links.nvlink_gbps:g} and "
                        f"{links.ib_gbps:g}.")
    layout = layout_on(cfg, gpus, gpus_per_node)  # parallel.gpus_per_node, when set, wins
    prec = precision_for(precision, t.dtype, t.grad_accum_dtype)
    partition = stage_partition(cfg)
    alltoall = alltoall_bytes_expected(_tokens_per_rank(cfg), m.num_experts_per_tok, m.hidden_size, p.ep,
                                       prec.act_bytes, m.n_routed_experts, p.dedup_dispatch, m.n_group,
                                       m.topk_group)
    st = _Setting(prec, zero, layout.grad_accum, layout.dp * layout.cp, layout.edp, alltoall, sp_regather)
    per_rank = rank_params(m, p, partition)
    groups = group_ranks(layout)
    stages = [_with_nodes(_stage_plan(cfg, st, partition, s, per_rank[s]), layout, links, groups) for s in range(p.pp)]
    heaviest = max(stages, key=lambda s: s.states.total).stage
    table = {name: [model_state_bytes(per_rank[heaviest], pr, z, layout.dp * layout.cp, layout.edp)
                    for z in range(4)] for name, pr in PRECISIONS.items()}
    peak = max(stages, key=lambda s: s.total)
    return Plan(
        arch=m.arch, gpus=gpus, pp=p.pp, dp=layout.dp, tp=p.tp, cp=p.cp, ep=p.ep, edp=layout.edp,
        micro_batches=layout.grad_accum, micro_batch_size=t.micro_batch_size, seq_len=t.seq_len,
        global_batch_size=t.global_batch_size, zero=zero, precision=prec, recompute=p.recompute,
        sequence_parallel=p.sequence_parallel and p.tp > 1, dedup_dispatch=p.dedup_dispatch,
        dense_group=layout.dp * layout.cp, gpu_memory_gb=gpu_memory_gb, params=count_parameters(m),
        partition=partition, stages=stages, state_table=table, heaviest_stage=heaviest, alltoall_per_layer=alltoall,
        bubble=bubble_fraction(p.pp, layout.grad_accum, p.virtual_stages), peak_stage=peak.stage,
        peak_bytes=peak.total, fits=peak.total <= gpu_memory_gb * GB, virtual_stages=p.virtual_stages,
        gpus_per_node=layout.node_size, links=links, rank_order=layout.order, sp_regather=sp_regather)


def _with_nodes(stage: StagePlan, layout: Layout, links: Links, groups: dict) -> StagePlan:
    nodes = stage_node_traffic(layout, stage.stage, stage.comm, links, groups)
    return dataclasses.replace(stage, nodes=nodes, comm_seconds=sum(n.seconds for n in nodes.values()))


def _param_count_dict(pc: ParamCount) -> dict:
    return {**dataclasses.asdict(pc), "total": pc.total, "main": pc.main}


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain JSON-ready data (bytes and parameter counts as numbers)."""
    data = dataclasses.asdict(plan)
    pr = plan.params
    data["params"] = {"total": _param_count_dict(pr.total), "activated": _param_count_dict(pr.activated),
                      "mtp_parts": _param_count_dict(pr.mtp_parts),
                      "shared_embedding_head": pr.shared_embedding_head,
                      "hf_checkpoint_total": pr.hf_checkpoint_total}
    return data
