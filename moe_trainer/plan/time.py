"""Step time of a layout on a named GPU: compute, exposed communication, pipeline bubble and the
optimizer step, tokens/s, TFLOP/s and MFU per GPU. Pure numbers (work.py counts, gpus.py converts).

The model, per optimizer step, on the busiest pipeline stage (the one with the most compute):
- compute per micro-batch: every GEMM at the roofline of its shape (FLOPs at the efficiency of its
  kind and dtype, or its operand bytes at the HBM rate, whichever is slower; backward = 2 GEMMs of
  the forward's size each), the causal flash-attention core at its forward / backward efficiency,
  and the memory-bound glue (its bytes at the HBM rate); recomputation adds a forward (full) or the
  norms' and SwiGLU activations' forward glue (selective, parallel/recompute.py's). Routed experts'
  GEMMs scale with the load imbalance (the busiest EP rank's share over the mean). The fp32
  gradient accumulation's traffic per micro-batch, unless fused into the weight-gradient GEMM.
- communication per micro-batch: the planner's bytes (comm.py) over NCCL's achievable bus bandwidth:
  TP and CP rings inside a node at NVLink speed (across nodes: the network's), the expert
  all-to-all's NVLink and network parts at once (both scaled by the imbalance), pipeline sends over
  the network. Per step: the ZeRO-1 gradient reduction and parameter all-gather.
- exposed: what the framework does not hide (`Mechanisms`): our trainer today overlaps none of it;
  `--overlap` pairs a forward and a backward micro-batch, as DualPipe and Megatron's combined 1F1B
  do: each of a MoE block's four transfers hides only behind the partner's compute phase beside it
  (`_paired_a2a_exposed`), on the SMs communication leaves; with the weight gradients held back
  (`Mechanisms.wgrad_split`, this trainer's overlap) the backward dispatch hides behind its own
  experts' weight gradients too.
- host: the kernels a block launches (the kernel proxy's counts) at the host's cost per launch
  (eager, compiled, a fused framework, CUDA graphs), BF16_Optimizer's eager hooks; a micro-batch takes
  the longer of device and host time, per MoE block when a tokens-per-expert read drains the queue.
- schedule: m micro-batches of (compute + exposed) and the bubble (p-1)/v of them (1F1B, interleaved
  over v chunks: (p-1)/(v m + p-1) of the whole), or DualPipe's (p/2 - 1)(F&B + B - 3W).
- optimizer: Adam over the rank's ZeRO-1 shard, memory-bound (fp32 grad, master, m, v).
- re-placement (parallel.replace_every, redundant_slots), given a run's load replayed
  (plan/replacement.py): the moves shared over the steps between decisions and the copies' refresh
  and gradients each step, exposed (`replacement_seconds`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .gpus import Efficiency, Gpu
from .params import PlanError, is_moe_layer
from .work import (PARAM_TENSORS_PER_BLOCK, Gemm, Setup, block_kernels, block_work, dp_strides, ep_remote_share,
                   head_work, node_dedup_bytes, rank_bytes, rank_params, spans_nodes, stage_blocks,
                   uniform_imbalance)

SCHEDULES = ("1f1b", "dualpipe")
HOSTS = ("eager", "compiled", "fused", "megatron", "graphs", "inline")
HIDINGS = ("phases", "megatron")


@dataclass(frozen=True)
class Mechanisms:
    """What the framework running the layout overlaps and how it schedules. The defaults are this
    trainer without the all-to-all overlap (parallel.overlap: none), DeepSpeed ZeRO-1 without
    overlap_comm (parallel/zero.py: the reduction runs after the last backward), blocking pipeline
    sends, TP/CP collectives between the GEMMs, eager glue kernels."""

    a2a_overlap: bool = False  # the all-to-all hidden behind the other micro-batch's compute
    tp_overlap: bool = False  # TP collectives hidden behind the GEMMs (Megatron --tp-comm-overlap)
    dp_overlap: bool = False  # gradient reduce / parameter gather overlapped with the backward / forward
    p2p_overlap: bool = False  # pipeline sends in the background
    dp_reduce_scatter: bool = False  # ZeRO-1 reduce-scatters gradients (Megatron); DeepSpeed all-reduces them
    schedule: str = "1f1b"  # 1f1b (interleaved when virtual_stages > 1) | dualpipe
    comm_sm_share: float = 0.0  # share of the SMs communication kernels hold while overlapping
    fused_glue: bool = False  # a fused framework's glue (Megatron-TE, DeepSeek's kernels)
    gemm_dtype: str = "bf16"  # bf16 | fp8 (attention stays bf16)
    node_dedup: bool = False  # a token crosses to each other node once, then NVLink (DeepSeek's dispatch)
    fp8_dispatch: bool = False  # the dispatch carries FP8 activations (1 byte), the combine BF16
    # how the host launches a block's kernels: eager (this trainer's eager path, the kernel proxy's eager
    # count at Efficiency.host_eager_us each), compiled (train.compile: inductor's kernels at launch_us),
    # fused (another framework's fused kernels, inductor's count at launch_us), megatron (Megatron-Core's
    # eager modules over TE's fused kernels: inductor's count at host_megatron_us, and TE's grouped GEMM's
    # launch per further local expert at launch_us), graphs (CUDA graphs),
    # inline (a CPU rank: the thread that dispatches each eager kernel runs it, so host and device add)
    host: str = "eager"
    a2a_sync: bool = True  # at ep > 1 the host reads the tokens-per-expert counts once per MoE block
    grad_accum_fusion: bool = False  # fp32 gradients accumulated inside the weight-gradient GEMM (Megatron)
    # the routed experts' weight gradients held back until the backward dispatch's transfer is issued, so
    # it hides behind them too (this trainer's overlap: kernels/wgrad.py; DualPipe's W, Megatron's
    # --delay-wgrad-compute)
    wgrad_split: bool = False
    # a full recomputation's replay re-sends its MoE blocks' all-to-alls: the plain recomputation of a whole
    # layer (this trainer's parallel.recompute full, Megatron's); under the overlap Megatron replays each
    # layer right before its backward with those transfers exposed ("The A2A issued here is exposed (not
    # overlapped) by design", Megatron-LM PR #5869 / #6311); this trainer's overlapped executor
    # checkpoints the pieces between the all-to-alls (parallel/overlap_model.py), so its replay sends no rows
    replay_a2a: bool = True
    # how much of the paired transfers' hiding the overlap achieves: phases (each transfer hidden behind its
    # partner's compute phase as far as the phase lasts: this trainer, DualPipe, which "fully hides" the
    # all-to-all, arXiv:2412.19437 sec. 3.2.1) or megatron (Megatron's combined 1F1B as measured: that
    # ideal's Efficiency.megatron_a2a_hidden share)
    a2a_hiding: str = "phases"

    def describe(self) -> str:
        on = [n for n in ("a2a_overlap", "tp_overlap", "dp_overlap", "p2p_overlap", "dp_reduce_scatter",
                          "fused_glue", "node_dedup", "fp8_dispatch", "grad_accum_fusion", "wgrad_split")
              if getattr(self, n)]
        extra = f", {self.comm_sm_share:.0%} of SMs to communication" if self.comm_sm_share else ""
        if self.a2a_overlap and self.a2a_hiding == "megatron":
            extra += ", the all-to-all hidden as Megatron's overlap was measured to hide it"
        return (f"schedule {self.schedule}, GEMMs {self.gemm_dtype}, host {self.host}, "
                f"{', '.join(on) or 'nothing overlapped'}{extra}")


TRAINER_TODAY = Mechanisms()


def trainer_mechanisms(compile_setting, a2a_overlap: bool = False, gemm_dtype: str = "bf16") -> Mechanisms:
    """This trainer's mechanisms for a config: train.compile true, or auto without the overlap (on CUDA:
    on; train.resolve_device_settings leaves an overlapped run eager), compiles each decoder layer, head
    and loss (inductor's kernels and glue bytes), false runs them eager."""
    compiled = compile_setting is True or (compile_setting == "auto" and not a2a_overlap)
    return Mechanisms(a2a_overlap=a2a_overlap, gemm_dtype=gemm_dtype, host="compiled" if compiled else "eager",
                      fused_glue=compiled, wgrad_split=a2a_overlap, replay_a2a=not a2a_overlap)

# whether this trainer overlaps each communication today (the report's column)
TRAINER_OVERLAPS = {
    "tensor parallel": "no (collectives between the GEMMs)",
    "context parallel": "no (K/V all-gather before attention)",
    "expert all-to-all": "with parallel.overlap a2a (auto, the default: where it runs and the run is eager), at "
                         "pp 1 and under interleaved 1F1B at pp > 1 (--overlap models it), the experts' weight gradients held "
                         "back behind the backward dispatch; the split-size exchange stays blocking",
    "pipeline send/recv": "no (blocking sends between the schedule's steps)",
    "ZeRO-1 reductions": "no (DeepSpeed's overlap_comm is off: parallel/zero.py writes stage 1 only)",
    "expert re-placement": "no (parallel.replace_every: the moves at a step boundary; the redundant slots' refresh "
                           "after the optimizer step and their gradients before the reduction)",
}


@dataclass(frozen=True)
class Replacement:
    """Online re-placement's traffic (parallel.replace_every, parallel.redundant_slots: parallel/slots.py), per
    MoE layer of a rank, as a run's load replays it (plan/replacement.py)."""

    every: int  # steps between decisions
    moved: float  # experts the busiest EP rank sends per decision (it receives as many)
    changed: float  # share of the MoE layers a decision changes
    copies: float  # copies' rows the busiest EP rank sends or receives in each step's refresh (and hand-back)


def replacement_seconds(s: Setup, stage: int, gpu: Gpu, eff: Efficiency, rep: Replacement) -> dict[str, float]:
    """Per step on one rank of `stage`, seconds, none of it hidden (parallel/slots.py runs each at a step
    boundary, blocking):
    - moves: per decision and changed MoE layer, one all-to-all over the EP group of the moved experts'
      rows in fp32 (model weight, master weight, Adam's two moments: 16 bytes a parameter) and the
      layer's optimizer state reassembled whole over the expert-data-parallel group (DeepSpeed's
      safe_get_full_*: one all-reduce of the rank's S experts' fp32 master and moments, 12 bytes a
      parameter); shared over the `every` steps between decisions;
    - copies: every step and MoE layer, the copies' refresh after the optimizer step and their summed
      gradients back to the owners before the reduction, two all-to-alls of `copies` expert rows in the
      model's dtype (SlotExperts.refresh, copy_grads_to_owners)."""
    m = s.ffn
    n_moe = sum(is_moe_layer(m, i) for i in stage_blocks(s, stage))
    numel = 3 * m.hidden_size * m.moe_intermediate_size  # one expert's gate, up and down projections
    remote = ep_remote_share(s)
    lat = eff.a2a_latency_us * 1e-6

    def a2a(nbytes: float) -> float:  # one all-to-all: its NVLink and network parts at once
        return max(nbytes * (1 - remote) / (gpu.nvlink_gbs * eff.a2a * 1e9),
                   nbytes * remote / (gpu.net_gbs * eff.a2a * 1e9)) + lat
    _, expert_stride = dp_strides(s)
    gather = _ring_seconds(2 * (s.edp - 1) / s.edp * (m.n_routed_experts // s.ep) * numel * 12, s.edp, expert_stride,
                           s.gpus_per_node, gpu, eff)
    moves = n_moe * rep.changed * (a2a(rep.moved * numel * 16) + gather) / rep.every
    copies = n_moe * 2 * a2a(rep.copies * numel * s.param_bytes) if rep.copies else 0.0
    return {"moves": moves, "copies": copies}


@dataclass(frozen=True)
class StepTime:
    """One layout's step, seconds, on the busiest stage; per GPU rates."""

    compute: float  # m x compute per micro-batch
    exposed_comm: float  # TP + CP + all-to-all + pipeline sends not hidden, and the data-parallel step
    bubble: float
    optimizer: float
    step: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float  # model TFLOP/s over the BF16 dense peak (as the published MFUs are)
    imbalance: float
    stage: int  # the busiest stage
    split: dict  # per kind: seconds per step, exposed
    totals: dict  # per kind: seconds per step, before overlap
    flops_per_token: float  # model FLOPs (forward + backward, no recomputation, causal attention)
    micro_batch_compute: float
    host_wait: float = 0.0  # the device idle while the host launches (m x per micro-batch)


def _gemm_seconds(g: Gemm, gpu: Gpu, eff: Efficiency, mech: Mechanisms, act_bytes: int = 2) -> float:
    """One forward of `g`: FLOPs at the kind's rate, or operand bytes at HBM speed, the slower."""
    fp8 = mech.gemm_dtype == "fp8"
    peak = (gpu.fp8_tflops if fp8 else gpu.bf16_tflops) * 1e12
    if fp8:
        rate = peak * (eff.fp8_grouped if g.grouped else eff.fp8_gemm)
    else:
        rate = peak * eff.gemm * (eff.grouped if g.grouped else 1.0)
    elem = 1 if fp8 else act_bytes  # FP8 operands; the output stays in the activations' dtype
    moved = ((g.rows * g.inner + g.inner * g.cols) * elem + g.rows * g.cols * act_bytes) * g.count
    return max(g.flops / rate, moved / (gpu.hbm_tbs * 1e12 * eff.memory))


def _fp8_quant_bytes(g: Gemm, fwd_passes: float) -> float:
    """HBM bytes of the quantisation passes one FP8 GEMM needs per micro-batch, forward + backward, with
    DeepSeek-V3's fine-grained scaling (arXiv:2412.19437 sec. 3.5.2): every forward reads its BF16 input
    and writes it as FP8 1x128 tiles (3 bytes per element); the backward quantises the output gradient
    the same way, and the weight gradient reads the stored FP8 input and the FP8 output gradient back,
    transposes them and writes them again as 128x1 tiles (2 bytes per element each). The weights'
    128x128 blocks are quantised once per step (not counted)."""
    inp, out = g.rows * g.inner * g.count, g.rows * g.cols * g.count
    return 3 * fwd_passes * inp + 3 * out + 2 * (inp + out)


def _passes(recompute: str) -> float:
    return 2.0 if recompute == "full" else 1.0


def _block_seconds(s: Setup, layer: int, gpu: Gpu, eff: Efficiency, mech: Mechanisms,
                   imbalance: float) -> tuple[dict[str, float], float]:
    """One block, one micro-batch, forward + backward (+ recompute): seconds by kind, and the share of
    them on the attention side (its GEMMs, core and half the glue; the rest is the FFN side)."""
    glue = eff.glue_passes * (eff.fused_glue if mech.fused_glue else 1.0)
    hbm = gpu.hbm_tbs * 1e12 * eff.memory
    attn_peak = gpu.bf16_tflops * 1e12
    fwd_passes = _passes(s.recompute)
    out = {"gemm": 0.0, "expert_gemm": 0.0, "attention": 0.0, "glue": 0.0}
    w = block_work(s, layer, imbalance)
    attn_side = 0.0
    n_attn = len(_attention_weight_names(s, layer))  # block_work lists the attention's GEMMs first
    for i, g in enumerate(w.gemms):
        t = (fwd_passes + 2) * _gemm_seconds(g, gpu, eff, mech, s.act_bytes)
        out["expert_gemm" if g.grouped else "gemm"] += t
        attn_side += t if i < n_attn else 0.0
    attn_fwd = w.attn_flops / (attn_peak * eff.attn_fwd)
    extra = attn_fwd if s.recompute == "full" else 0.0
    out["attention"] = attn_fwd + extra + w.attn_bwd_flops / (attn_peak * eff.attn_bwd)
    # the glue's measured ratio covers forward + backward: a third of it is the forward's; selective
    # recomputation re-runs the norms' and SwiGLU activations' forward
    again = w.selective_bytes / 3 if s.recompute == "selective" else 0.0
    out["glue"] = glue / hbm * (w.glue_bytes * (1 + (fwd_passes - 1) / 3) + again)
    if mech.gemm_dtype == "fp8":
        out["glue"] += sum(_fp8_quant_bytes(g, fwd_passes) for g in w.gemms) / hbm
    attn_side += out["attention"] + out["glue"] / 2
    return out, attn_side / sum(out.values())


def moe_layer_seconds(s: Setup, gpu: Gpu, eff: Efficiency, mech: Mechanisms) -> dict[str, float]:
    """Layer 0 of `s`, a MoE layer, alone (no attention), one micro-batch, forward + backward, as the step's model costs
    it: the router's, shared and routed experts' GEMMs, the FFN side's glue and the layer's four
    all-to-all transfers (dispatch and combine, forward and backward), none overlapped: the quantity
    Megatron-LM's moe_perf benchmark times (published.MOE_LAYER_CHECKS)."""
    layer = 0
    if not is_moe_layer(s.ffn, layer):
        raise PlanError(f"layer 0 of {s.name} is not a MoE layer.")
    from .memory import _ffn_acts
    w = block_work(s, layer)
    ffn_gemms = w.gemms[len(_attention_weight_names(s, layer)):]
    gemm = sum((_passes(s.recompute) + 2) * _gemm_seconds(g, gpu, eff, mech, s.act_bytes) for g in ffn_gemms)
    glue = eff.glue_passes * (eff.fused_glue if mech.fused_glue else 1.0)
    acts = _ffn_acts(s.ffn, layer, s.tp, s.act_bytes).per_rank(s.tp, s.sequence_parallel) * s.tokens
    one_layer = dataclasses.replace(s, partition=(1,), pp=1, virtual_stages=1)
    a2a = comm_seconds(one_layer, 0, gpu, eff, 1.0, mech)["all_to_all"] if s.ep > 1 else 0.0
    return {"gemm": gemm, "glue": glue * acts / (gpu.hbm_tbs * 1e12 * eff.memory), "all_to_all": a2a}


def _attention_weight_names(s: Setup, layer: int) -> list[str]:
    from .params import layer_shapes
    return [n for n, sh in layer_shapes(s.attn, layer).items() if n.startswith("self_attn.") and len(sh) == 2]


def _stage_kinds(s: Setup, stage: int) -> dict:
    """(MoE, MTP) -> (a layer of that kind, how many) on `stage`: blocks of one kind cost the same."""
    kinds: dict = {}
    for layer in stage_blocks(s, stage):
        key = (is_moe_layer(s.ffn, layer), layer >= s.ffn.num_hidden_layers)
        kinds[key] = (kinds.get(key, (layer, 0))[0], kinds.get(key, (layer, 0))[1] + 1)
    return kinds


def stage_compute(s: Setup, stage: int, gpu: Gpu, eff: Efficiency, mech: Mechanisms,
                  imbalance: float) -> dict[str, float]:
    """Seconds of one micro-batch's forward + backward (+ recompute) on one rank of `stage`, by kind."""
    out = {"gemm": 0.0, "expert_gemm": 0.0, "attention": 0.0, "glue": 0.0, "grad_accum": 0.0}
    glue = eff.glue_passes * (eff.fused_glue if mech.fused_glue else 1.0)
    hbm = gpu.hbm_tbs * 1e12 * eff.memory
    for layer, n in _stage_kinds(s, stage).values():
        for k, v in _block_seconds(s, layer, gpu, eff, mech, imbalance)[0].items():
            out[k] += n * v
    if stage == s.pp - 1:  # the output heads stay in BF16 under FP8 GEMMs (DeepSeek-V3 report, 3.3.1)
        gemms, head_glue = head_work(s)
        head_mech = dataclasses.replace(mech, gemm_dtype="bf16")
        out["gemm"] += sum(3 * _gemm_seconds(g, gpu, eff, head_mech, s.act_bytes) for g in gemms)
        out["glue"] += glue * head_glue / hbm
    if _hook_accumulation(s, mech):
        # each micro-batch's gradients added into the fp32 accumulation by BF16_Optimizer's hook per
        # parameter: `hp.add_(lp.grad.to(fp32))`, a cast (read bf16, write fp32) and an add (read both fp32,
        # write one); a fused framework accumulates inside the weight-gradient GEMM
        out["grad_accum"] = sum(rank_params(s, stage)) * (s.param_bytes + 4 * s.grad_bytes) / hbm
    if mech.a2a_overlap and mech.comm_sm_share:
        out = {k: v / (1 - mech.comm_sm_share) for k, v in out.items()}
    return out


def _hook_accumulation(s: Setup, mech: Mechanisms) -> bool:
    return not mech.grad_accum_fusion and s.grad_bytes > s.param_bytes


def host_seconds(s: Setup, stage: int, eff: Efficiency, mech: Mechanisms) -> dict:
    """The host's time to launch one micro-batch of `stage`: per block kind (MoE or not) the seconds of
    one block, and the device-to-host reads (one per MoE block and forward pass at ep > 1: the
    tokens-per-expert counts the all-to-all's split sizes and the grouped GEMM need on the host)."""
    per = {"eager": eff.host_eager_us, "inline": eff.host_eager_us, "compiled": eff.launch_us,
           "fused": eff.launch_us, "megatron": eff.host_megatron_us, "graphs": 0.0}[mech.host] * 1e-6
    # TE's grouped GEMM ("multi-stream + cuBLAS") launches each GEMM per local expert: fc1 and fc2, forward,
    # input and weight gradients, for every local expert beyond the one the fused count holds
    per_expert = 6 * (max(s.ffn.n_routed_experts // s.ep, 1) - 1) * eff.launch_us * 1e-6 \
        if mech.host == "megatron" and s.ffn.n_routed_experts else 0.0
    # BF16_Optimizer's accumulation hooks run eager whatever the layers do: two kernels per parameter
    hooks = 2 * PARAM_TENSORS_PER_BLOCK * eff.host_eager_us * 1e-6 if _hook_accumulation(s, mech) else 0.0
    graphs = 2 * eff.graph_us * 1e-6 if mech.host == "compiled" else 0.0
    blocks = {key: (n, block_kernels(s, layer, mech.host not in ("eager", "inline")) * per + hooks + graphs
                    + (per_expert if key[0] else 0.0))
              for key, (layer, n) in _stage_kinds(s, stage).items()}
    moe = sum(n for (is_moe, _), (n, _t) in blocks.items() if is_moe)
    syncs = moe * _passes(s.recompute) if s.ep > 1 and mech.a2a_sync and mech.host != "graphs" else 0.0
    return {"blocks": blocks, "syncs": syncs * eff.sync_us * 1e-6, "drains": syncs > 0}


def _ring_seconds(nbytes: float, group: int, stride: int, node: int, gpu: Gpu, eff: Efficiency) -> float:
    """A ring collective: bytes sent per rank over the bus bandwidth of the links it crosses."""
    if group <= 1 or not nbytes:
        return 0.0
    across = spans_nodes(group, stride, node)
    return nbytes / ((gpu.net_gbs * eff.net if across else gpu.nvlink_gbs * eff.nvlink) * 1e9)


def comm_seconds(s: Setup, stage: int, gpu: Gpu, eff: Efficiency, imbalance: float,
                 mech: Mechanisms = TRAINER_TODAY) -> dict[str, float]:
    """Per micro-batch (tp, cp, a2a, p2p) and per step (dp) seconds of one rank of `stage`;
    `mech`: ZeRO-1 reduce-scatters (Megatron) or all-reduces (DeepSpeed) gradients; the all-to-all's
    node dedup and FP8 dispatch."""
    from .comm import zero_comm
    from .params import Precision
    rb = rank_bytes(s, stage)
    remote = ep_remote_share(s)
    # rank_bytes counts every pass of the MoE blocks (forward, backward, a full recomputation's replay); the
    # replay sends no rows where Mechanisms.replay_a2a is off
    sent = 1.0 if mech.replay_a2a else 1.0 - _replay_part(s)
    # the dispatch half of the bytes in FP8 when the mechanism says so
    a2a = rb.a2a_bytes * sent * imbalance * ((1 + 0.5) / 2 if mech.fp8_dispatch and s.act_bytes == 2 else 1.0)
    nvlink, net = a2a * (1 - remote), a2a * remote
    if mech.node_dedup and a2a:  # every copy still moves over NVLink once; the network carries one per node
        nvlink = a2a
        net = rb.a2a_layers * sent * imbalance * node_dedup_bytes(s, 1 if mech.fp8_dispatch else s.act_bytes)
    a2a_s = max(nvlink / (gpu.nvlink_gbs * eff.a2a * 1e9), net / (gpu.net_gbs * eff.a2a * 1e9)) if a2a else 0.0
    # the fixed time per call: each MoE block and pass sends two row transfers (dispatch, combine), and each
    # forward pass (recomputation's too) first exchanges the split sizes, a blocking all-to-all of a few bytes
    lat = eff.a2a_latency_us * 1e-6 if a2a else 0.0
    moe_blocks = sum(is_moe_layer(s.ffn, i) for i in stage_blocks(s, stage))
    a2a_s += 2 * rb.a2a_layers * sent * lat
    split_s = (rb.a2a_layers - moe_blocks) * lat
    node = s.gpus_per_node
    p2p_across = s.gpus > node
    p2p_s = rb.p2p_bytes / ((gpu.net_gbs * eff.net if p2p_across else gpu.nvlink_gbs * eff.nvlink) * 1e9)
    prec = Precision("time", s.param_bytes, s.grad_bytes, 12, s.act_bytes, "")
    dense_stride, expert_stride = dp_strides(s)
    group = s.dp * s.cp
    dense = zero_comm(rb.dense_params, group, s.zero, s.micro_batches, prec,
                      stage1_all_reduce=not mech.dp_reduce_scatter)
    expert = zero_comm(rb.expert_params, s.edp, s.zero, s.micro_batches, prec,
                       stage1_all_reduce=not mech.dp_reduce_scatter)
    dp_s = _ring_seconds(dense.total, group, dense_stride, node, gpu, eff) + \
        _ring_seconds(expert.total, s.edp, expert_stride, node, gpu, eff)
    return {"tensor": _ring_seconds(rb.tp_bytes, s.tp, 1, node, gpu, eff),
            "context": _ring_seconds(rb.cp_bytes, s.cp, s.tp, node, gpu, eff),
            "all_to_all": a2a_s, "a2a_split": split_s, "pipeline": p2p_s if s.pp > 1 else 0.0, "data_parallel": dp_s,
            "shard_params": (rb.dense_params / group + rb.expert_params / s.edp)}


def model_flops_per_token(s: Setup) -> float:
    """Model FLOPs per trained token, whole model: 3 x the forward's GEMMs (activated experts) and
    causal attention core, no recomputation: Megatron-LM's num_floating_point_operations (causal core
    attention) and this trainer's metrics.train_flops_per_token count the same."""
    one = dataclasses.replace(s, tp=1, cp=1, ep=1, pp=1, virtual_stages=1, recompute="none",
                              sequence_parallel=False, partition=(s.ffn.num_hidden_layers,))
    total = 0.0
    for layer in stage_blocks(one, 0):
        w = block_work(one, layer)
        total += sum(g.flops for g in w.gemms) + w.attn_flops
    total += sum(g.flops for g in head_work(one)[0])
    return 3 * total / one.tokens


def _paired_a2a_exposed(a2a: float, dev: float, attn_share: float, mech: Mechanisms, held: float = 0.0) -> float:
    """The all-to-all one MoE block leaves exposed when a forward and a backward micro-batch run paired
    (DualPipe, Megatron's combined 1F1B): each of its four transfers hides only behind the one compute
    phase of the other micro-batch that runs beside it, in the order the dependencies allow:
    (forward attention | backward combine), (backward MLP | forward dispatch), (forward MLP | backward
    dispatch), (backward attention | forward combine); the forward is a third of a phase's compute.
    `held`: the weight-gradient seconds the backward MLP phase runs after issuing its dispatch's
    transfer (Mechanisms.wgrad_split), which that transfer hides behind as well. Under FP8 dispatch
    the two transfers towards the experts carry FP8 (the forward dispatch, and the backward combine's
    gradients before the down-projection: arXiv:2412.19437 sec. 3.3.2), the two back carry BF16."""
    d = 0.5 if mech.fp8_dispatch else 1.0  # a transfer towards the experts' bytes against a BF16 one's
    unit = a2a / (2 + 2 * d)
    attn, mlp = dev * attn_share, dev * (1 - attn_share)
    slots = ((d * unit, attn / 3), (d * unit, 2 * mlp / 3), (unit, mlp / 3 + held), (unit, 2 * attn / 3))
    return sum(max(0.0, comm - comp) for comm, comp in slots)


def _replay_part(s: Setup) -> float:
    """Share of rank_bytes' row transfers that are a full recomputation's replay: one of the passes
    comm._passes counts (forward, backward, replay), a third; 0 without the replay."""
    from .comm import _passes as passes_of
    passes = passes_of(s.recompute)
    return (passes - 2) / passes


def replay_share(s: Setup, mech: Mechanisms) -> float:
    """Share of the row transfers a full recomputation's replay sends (`_replay_part`), where it sends
    them (Mechanisms.replay_a2a); else 0."""
    return _replay_part(s) if mech.replay_a2a else 0.0


def hiding_share(eff: Efficiency, mech: Mechanisms) -> float:
    """Share of the paired transfers' ideal hiding the framework's overlap achieves (Mechanisms.a2a_hiding)."""
    return eff.megatron_a2a_hidden if mech.a2a_hiding == "megatron" else 1.0


def a2a_exposure(a2a: float, split: float, moe_block: tuple, mech: Mechanisms, host_moe: float = 0.0,
                 replay: float = 0.0, hiding: float = 1.0) -> dict:
    """The expert all-to-all a rank waits for per micro-batch, term by term (seconds):
    - paired: the transfers of the paired micro-batches, each hidden only behind the partner's compute
      phase beside it (`_paired_a2a_exposed`, per MoE block), over the share of chunks that run paired;
      of what that would hide, the framework hides the share `hiding` (`hiding_share`);
    - replay: in the paired chunks, the transfers a full recomputation's replay sends (`replay`, their
      share of `a2a`: `replay_share`), issued right before the backward that needs them, so exposed;
    - unpaired: the schedule's warm-up forwards and cool-down backwards (`unpaired_share`), whose
      transfers nothing hides: their whole time;
    - split: the dispatcher's split-size exchange before each dispatch, blocking in both executors (the
      rows' sizes must be on the host before the dispatch is issued): its whole time, latency-bound.
    Without the overlap every transfer is exposed (paired 0, unpaired all of `a2a`). `a2a`: the row
    transfers' seconds per micro-batch, `split` the exchanges'; `moe_block`: (MoE blocks, device seconds
    of one, its attention side's share, the unpaired share, the device seconds of its weight gradients
    held back: `_moe_block`); `host_moe`: host seconds of one MoE block
    that the partner's transfers also hide behind (a CPU rank, host "inline": its thread runs the kernels
    it dispatches, so a phase lasts its host time and its arithmetic)."""
    n_moe, dev_moe, attn_share, unpaired, held = moe_block
    if not (mech.a2a_overlap and n_moe):
        return {"paired": 0.0, "replay": 0.0, "unpaired": a2a, "split": split, "exposed": a2a + split}
    # on a CPU rank the held-back weight gradients last their host time too, in the block's proportion
    held *= 1 + host_moe / dev_moe if dev_moe else 1.0
    rows = a2a * (1 - replay)  # the transfers the pairs may hide: all but the replay's
    pairable = (1 - unpaired) * rows
    ideal = (1 - unpaired) * n_moe * _paired_a2a_exposed(rows / n_moe, dev_moe + host_moe, attn_share, mech, held)
    paired = ideal + (1 - hiding) * (pairable - ideal)
    replayed = (1 - unpaired) * a2a * replay
    return {"paired": paired, "replay": replayed, "unpaired": unpaired * a2a, "split": split,
            "exposed": paired + replayed + unpaired * a2a + split}


def stage_a2a_exposure(s: Setup, stage: int, gpu: Gpu, eff: Efficiency, mech: Mechanisms,
                       imbalance: Optional[float] = None) -> dict:
    """Per step on one rank of `stage`: the all-to-alls' own time ("transfers": the row transfers,
    "split": the split-size exchanges) and what the rank waits for of them, term by term
    (`a2a_exposure`: "paired", "replay", "unpaired", "split", "exposed"), seconds."""
    f = uniform_imbalance(s) if imbalance is None else imbalance
    comm = comm_seconds(s, stage, gpu, eff, f, mech)
    terms = _stage_terms(s, comm, host_seconds(s, stage, eff, mech), _moe_block(s, stage, gpu, eff, mech, f), eff, mech)
    m = s.micro_batches
    return {"transfers": m * comm["all_to_all"], **{k: m * v for k, v in terms.items()}}


def _stage_terms(s: Setup, comm: dict, host: dict, moe_block: tuple, eff: Efficiency, mech: Mechanisms) -> dict:
    """`a2a_exposure`'s terms per micro-batch of one stage, from its `comm_seconds`, `host_seconds` and
    `_moe_block`."""
    return a2a_exposure(comm["all_to_all"], comm["a2a_split"], moe_block, mech,
                        _moe_launch(host) if mech.host == "inline" else 0.0, replay_share(s, mech), hiding_share(eff, mech))


def _moe_launch(host: dict) -> float:
    """Host seconds of one MoE block's launches (0 when the stage has none)."""
    moe = [(n, t) for (is_moe, _), (n, t) in host["blocks"].items() if is_moe]
    return sum(n * t for n, t in moe) / max(1, sum(n for n, _ in moe))


def _per_micro_batch(kinds: dict, comm: dict, mech: Mechanisms, host: dict, moe_block: tuple,
                     a2a: float) -> tuple[float, float, dict, float]:
    """(seconds per micro-batch, compute, exposed communication by kind, host wait) of one stage.
    `moe_block`: `_moe_block`'s tuple; `a2a`: the all-to-all the stage waits for (`_stage_terms`' exposed)."""
    c = sum(kinds.values())
    n_moe, dev_moe = moe_block[:2]
    exposed = {
        "tensor": max(0.0, comm["tensor"] - kinds["gemm"]) if mech.tp_overlap else comm["tensor"],
        "context": max(0.0, comm["context"] - kinds["attention"]) if mech.tp_overlap else comm["context"],
        "all_to_all": a2a,
        "pipeline": 0.0 if mech.p2p_overlap else comm["pipeline"],
    }
    device = c + sum(exposed.values())
    launch = sum(n * t for n, t in host["blocks"].values())
    if mech.host == "inline":  # no queue between host and device: every launch's host time is the rank's
        busy = device + launch + host["syncs"]
    elif host["drains"]:
        # the read drains the stream: the host cannot run ahead past a MoE block, so each one takes the
        # longer of its device time (compute and exposed all-to-all) and its launches; the rest of the
        # stage (dense blocks, head) overlaps as a whole
        moe_launch = _moe_launch(host)
        moe_dev = dev_moe + a2a / max(1, n_moe)
        rest_dev, rest_launch = device - n_moe * moe_dev, launch - n_moe * moe_launch
        busy = n_moe * max(moe_dev, moe_launch) + max(rest_dev, rest_launch) + host["syncs"]
    else:
        busy = max(device, launch)
    return busy, c, exposed, busy - device


def unpaired_share(s: Setup, stage: int, mech: Mechanisms) -> float:
    """Share of a rank's micro-batch chunks that run without a partner under the paired overlap: the
    schedule's warm-up forwards and as many cool-down backwards, whose all-to-alls nothing hides.
    - 1F1B (Megatron's combined 1F1B, NVIDIA/Megatron-LM pipeline_parallel/schedules.py: with
      overlap_moe_expert_parallel_comm one more warm-up forward than the schedule's own): interleaved
      over v chunks 2 (p - r - 1) + (v - 1) p + 1 warm-up forwards of v m (microbatch group p);
      v = 1: p - r, which at pp 1 is this trainer's overlap (parallel/overlap.py: micro-batch 0's
      forward and the last backward run alone).
    - DualPipe (deepseek-ai/DualPipe dualpipe.py): a rank r, h = min(r, p-1-r), runs 2 (p/2 - h - 1)
      + 2 (h + 1) + (p/2 - h - 1) = 3p/2 - h - 1 of its m forwards alone (steps 1-3), and as many
      backwards (steps 3 and 5-7)."""
    if not mech.a2a_overlap:
        return 0.0
    p, v, m = s.pp, s.virtual_stages, s.micro_batches
    if mech.schedule == "dualpipe":
        return min(1.0, (3 * p / 2 - min(stage, p - 1 - stage) - 1) / m)
    warm = 2 * (p - stage - 1) + (v - 1) * p + 1 if v > 1 else p - stage
    return min(1.0, warm / (v * m))


def _moe_block(s: Setup, stage: int, gpu: Gpu, eff: Efficiency, mech: Mechanisms, imbalance: float) -> tuple:
    """(MoE blocks on `stage`, device seconds of one decoder MoE block, its attention side's share, the
    share of micro-batches that run unpaired, the device seconds of its routed experts' weight gradients
    when they are held back (Mechanisms.wgrad_split; else 0): one of the grouped GEMMs' forward +
    recompute + 2 backward passes)."""
    kinds = _stage_kinds(s, stage)
    moe = [(layer, n) for (is_moe, mtp), (layer, n) in kinds.items() if is_moe and not mtp]
    if not moe:
        return 0, 0.0, 0.5, 0.0, 0.0
    secs, share = _block_seconds(s, moe[0][0], gpu, eff, mech, imbalance)
    slow = 1 - mech.comm_sm_share if mech.a2a_overlap else 1.0
    held = secs["expert_gemm"] / (_passes(s.recompute) + 2) / slow if mech.wgrad_split else 0.0
    return (sum(n for (is_moe, _), (_, n) in kinds.items() if is_moe), sum(secs.values()) / slow, share,
            unpaired_share(s, stage, mech), held)


def _dualpipe_rank(a: tuple, b: tuple) -> tuple:
    """A DualPipe rank's row from its two stages' rows (per micro-batch seconds, compute, exposed,
    host wait, compute kinds, communication): per micro-batch times are the mean, the once-per-step
    data-parallel reduction and the optimizer's shard cover both stages' parameters."""
    def mean(x: dict, y: dict) -> dict:
        return {k: (x[k] + y[k]) / 2 for k in x}
    comm = mean(a[5], b[5])
    comm["data_parallel"] = a[5]["data_parallel"] + b[5]["data_parallel"]
    comm["shard_params"] = a[5]["shard_params"] + b[5]["shard_params"]
    return ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2, mean(a[2], b[2]), (a[3] + b[3]) / 2, mean(a[4], b[4]), comm)


def step_time(s: Setup, gpu: Gpu, eff: Efficiency, mech: Mechanisms = TRAINER_TODAY,
              imbalance: Optional[float] = None, replacement: Optional[Replacement] = None) -> StepTime:
    """The step of `s` on `gpu`; `imbalance`: the busiest EP rank's load over the mean (None: uniform
    routing's statistical maximum, `uniform_imbalance`); `replacement`: the online re-placement's traffic
    that leaves that imbalance (replacement_seconds), exposed."""
    if mech.schedule not in SCHEDULES:
        raise PlanError(f"schedule must be one of {', '.join(SCHEDULES)}, got {mech.schedule!r}.")
    if mech.host not in HOSTS:
        raise PlanError(f"host must be one of {', '.join(HOSTS)}, got {mech.host!r}.")
    if mech.a2a_hiding not in HIDINGS:
        raise PlanError(f"a2a_hiding must be one of {', '.join(HIDINGS)}, got {mech.a2a_hiding!r}.")
    if mech.gemm_dtype == "fp8" and not gpu.fp8_tflops:
        raise PlanError(f"--gemm-dtype fp8 needs FP8 tensor cores; the {gpu.name} has none.")
    f = uniform_imbalance(s) if imbalance is None else imbalance
    if f < 1:
        raise PlanError(f"the load imbalance (busiest EP rank over the mean) must be at least 1, got {f:g}.")
    rows = []
    for st in range(s.pp):
        kinds, comm = stage_compute(s, st, gpu, eff, mech, f), comm_seconds(s, st, gpu, eff, f, mech)
        host, block = host_seconds(s, st, eff, mech), _moe_block(s, st, gpu, eff, mech, f)
        a2a = _stage_terms(s, comm, host, block, eff, mech)["exposed"]
        rows.append((*_per_micro_batch(kinds, comm, mech, host, block, a2a), kinds, comm))
    if mech.schedule == "dualpipe":
        # DualPipe feeds micro-batches from both ends: rank r holds stage r and stage p-1-r (two copies of
        # the parameters, arXiv:2412.19437 sec. 3.2.1) and runs half the micro-batches through each, so
        # its time per micro-batch is the two stages' mean and it reduces and steps both stages' weights
        rows = [_dualpipe_rank(rows[r], rows[s.pp - 1 - r]) for r in range(s.pp)]
    # the pipeline runs at its slowest rank's pace: compute plus what it cannot hide, per micro-batch
    stage = max(range(s.pp), key=lambda st: rows[st][0])
    per_mb, c, exposed, host_wait, kinds, comm = rows[stage]
    m, p, v = s.micro_batches, s.pp, s.virtual_stages
    if mech.schedule == "dualpipe":
        fwd = c / 3
        bubble = max(0.0, p / 2 - 1) * (fwd + 0.5 * (c - fwd))
    else:
        bubble = (p - 1) / v * per_mb
    dp = comm["data_parallel"]
    dp_exposed = max(0.0, dp - per_mb) if mech.dp_overlap else dp
    hbm = gpu.hbm_tbs * 1e12 * eff.memory
    optimizer = comm["shard_params"] * (4 + 12 * 2 + s.param_bytes) / hbm
    # a DualPipe rank holds two stages' layers
    held = {stage, s.pp - 1 - stage} if mech.schedule == "dualpipe" else {stage}
    replace = {k: sum(replacement_seconds(s, st, gpu, eff, replacement)[k] for st in held)
               for k in ("moves", "copies")} if replacement else {"moves": 0.0, "copies": 0.0}
    total = m * per_mb + bubble + dp_exposed + optimizer + sum(replace.values())
    tokens = m * s.micro_batch_size * s.seq_len * s.dp / s.gpus  # per GPU per step
    flops = model_flops_per_token(s)
    tflops = flops * tokens / total / 1e12
    split = {**{k: m * v_ for k, v_ in exposed.items()}, "data_parallel": dp_exposed,
             "replacement": sum(replace.values())}
    totals = {**{k: m * comm[k] for k in ("tensor", "context", "pipeline")},
              "all_to_all": m * (comm["all_to_all"] + comm["a2a_split"]), "data_parallel": dp,
              "replacement": sum(replace.values()), **{f"replacement.{k}": v_ for k, v_ in replace.items()},
              **{f"compute.{k}": m * v_ for k, v_ in kinds.items()}}
    return StepTime(compute=m * c, exposed_comm=sum(split.values()), bubble=bubble, optimizer=optimizer,
                    step=total, tokens_per_s_per_gpu=tokens / total, model_tflops_per_gpu=tflops,
                    mfu=tflops / gpu.bf16_tflops, imbalance=f, stage=stage, split=split, totals=totals,
                    flops_per_token=flops, micro_batch_compute=c, host_wait=m * host_wait)


def step_time_to_dict(r: StepTime) -> dict:
    return dataclasses.asdict(r)
