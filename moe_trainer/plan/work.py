"""What one rank computes and sends per micro-batch: the step-time model's inputs, counted from the
planner's own parameter shapes (params.py), activation bytes (memory.py) and traffic (comm.py).

Pure numbers, no torch. A `Setup` is a model plus a layout, built from a validated `Config`
(`setup_from_config`) or from a published run's description (plan/published.py) whose architecture
the trainer does not build (grouped-query attention with MoE FFNs: Qwen3, Mixtral): its attention is
counted as Llama's and its FFN as DeepSeekMoE's (without shared experts).

Why analytic counts and not the kernel proxy's op-by-op count: the search times hundreds of layouts
of a 671B model, and a meta-device forward + backward of 61 DeepSeek-V3 layers at 4K tokens per
layout would take minutes. The analytic GEMM and attention FLOPs are held equal to the proxy's
count and to the trainer's own `metrics.train_flops_per_token` by tests/test_plan_time.py; the glue
bytes are the planner's stored-activation bytes times the proxy's measured ratio (gpus.Efficiency).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from ..config import Config, ModelConfig
from .comm import _kv_bytes_per_token, _passes, alltoall_bytes_expected, tensor_parallel_bytes, \
    tensor_parallel_extra_bytes, context_parallel_bytes
from .memory import FP32, TokenActs, _attention_acts, _ffn_acts, _head_acts, _rank_share, _stage_blocks
from .params import PlanError, is_moe_layer, layer_shapes, mtp_layers, numel
from .pipeline import stage_partition


@dataclass(frozen=True)
class Setup:
    """A model on a layout: everything the step-time model reads."""

    name: str
    attn: ModelConfig  # whose attention shapes count (llama3: GQA; deepseek_v3: MLA)
    ffn: ModelConfig  # whose FFN shapes count (deepseek_v3: DeepSeekMoE)
    gpus: int
    tp: int
    cp: int
    pp: int
    virtual_stages: int
    ep: int
    dp: int
    micro_batches: int  # per optimizer step on each data-parallel rank
    micro_batch_size: int
    seq_len: int
    recompute: str  # none | selective | full
    sequence_parallel: bool
    zero: int
    dedup_dispatch: bool
    gpus_per_node: int
    partition: tuple  # decoder layers per pipeline stage
    moe_order: bool  # tp-cp-dp-pp (MoE) rank order, else tp-cp-pp-dp (Llama 3's)
    act_bytes: int = 2  # bf16 activations
    grad_bytes: int = 4  # gradients reduced in fp32 (the trainer's BF16_Optimizer, Megatron's main grads)
    param_bytes: int = 2

    @property
    def edp(self) -> int:
        return max(1, self.dp * self.cp * self.tp // self.ep) if self.tp > 1 and self.ep > 1 else \
            max(1, self.dp * self.cp // self.ep)

    @property
    def tokens(self) -> float:
        """Tokens of one micro-batch on one rank (the TP group shares them)."""
        return self.micro_batch_size * self.seq_len / self.cp


def setup_from_config(cfg: Config, gpus: int, zero: int = 1, gpus_per_node: Optional[int] = None,
                      name: str = "", partition: Optional[tuple] = None) -> Setup:
    """The setup of a config on `gpus` GPUs (validated as the trainer validates it); `partition`:
    layers per pipeline rank, else the trainer's own split (stage_partition)."""
    from .layout import layout_on
    p, t, m = cfg.parallel, cfg.train, cfg.model
    layout = layout_on(cfg, gpus, gpus_per_node or cfg.parallel.gpus_per_node or 8)  # the planner's default node
    dtype_bytes = 4 if t.dtype == "fp32" else 2
    return Setup(name=name or m.arch, attn=m, ffn=m, gpus=gpus, tp=p.tp, cp=p.cp, pp=p.pp,
                 virtual_stages=p.virtual_stages, ep=p.ep, dp=layout.dp, micro_batches=layout.grad_accum,
                 micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, recompute=p.recompute,
                 sequence_parallel=p.sequence_parallel and p.tp > 1, zero=zero, dedup_dispatch=p.dedup_dispatch,
                 gpus_per_node=layout.node_size, partition=partition or tuple(stage_partition(cfg)),
                 moe_order=layout.order.index("dp") < layout.order.index("pp"), act_bytes=dtype_bytes,
                 grad_bytes=4, param_bytes=dtype_bytes)


# ----------------------------------------------------------------------------- per-layer work

@dataclass(frozen=True)
class Gemm:
    """`count` GEMMs of (rows x inner) @ (inner x cols), forward; the backward runs two of the same size."""

    rows: float
    cols: float
    inner: float
    count: int = 1
    grouped: bool = False  # a routed expert's GEMM (grouped, and scaled by the load imbalance)

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.cols * self.inner * self.count


@dataclass(frozen=True)
class BlockWork:
    """One decoder block on one rank, one micro-batch, forward."""

    gemms: tuple  # Gemm, ...
    attn_flops: float  # the attention core (scores and values), causal
    attn_bwd_flops: float
    glue_bytes: float  # stored activation bytes (the glue's traffic is a multiple of them)
    moe: bool
    selective_bytes: float = 0.0  # what selective recomputation rebuilds: the norms' and SwiGLU's activations


def _attn_dims(m: ModelConfig) -> tuple[int, int]:
    if m.arch == "llama3":
        d = m.head_dim or m.hidden_size // m.num_attention_heads
        return d, d
    return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim


def attention_core_flops(m: ModelConfig, s: Setup) -> tuple[float, float]:
    """(forward, backward) FLOPs of the causal attention core on one rank per micro-batch: the rank's
    heads (a / tp) and queries (seq / cp) against half the sequence on average (load-balanced CP);
    the backward recomputes the scores (flash attention): (3 d_qk + 2 d_v) / (d_qk + d_v) x forward."""
    dqk, dv = _attn_dims(m)
    heads = m.num_attention_heads / s.tp
    fwd = 2.0 * heads * s.tokens * (0.5 * s.seq_len) * (dqk + dv)  # tokens = mbs x seq / cp queries
    return fwd, fwd * (3 * dqk + 2 * dv) / (dqk + dv)


def _weights(m: ModelConfig, layer: int, prefix: str) -> dict[str, tuple]:
    return {n: sh for n, sh in layer_shapes(m, layer).items() if n.startswith(prefix) and len(sh) == 2}


def block_work(s: Setup, layer: int, imbalance: float = 1.0) -> BlockWork:
    """Forward work of decoder block `layer` (an MTP block when layer >= num_hidden_layers)."""
    t = s.tokens
    gemms = []
    weights = {**_weights(s.attn, layer, "self_attn."), **_weights(s.ffn, layer, "mlp.")}
    if layer >= s.ffn.num_hidden_layers:
        weights["eh_proj.weight"] = (s.ffn.hidden_size, 2 * s.ffn.hidden_size)
    for name, (out, inp) in weights.items():
        share = _rank_share(name, s.tp, s.ep)
        gemms.append(Gemm(t, out * share, inp))
    moe = is_moe_layer(s.ffn, layer)
    if moe:
        gemms += _expert_gemms(s, imbalance)
    fwd, bwd = attention_core_flops(s.attn, s)
    attn_acts, ffn_acts = _attention_acts(s.attn, s.tp, s.act_bytes), _ffn_acts(s.ffn, layer, s.tp, s.act_bytes)
    acts = attn_acts + ffn_acts
    # parallel/recompute.py's selective mode re-runs every RMSNorm and SwiGLU's activation
    norms = (attn_acts.norm_region + ffn_acts.norm_region) / (s.tp if s.sequence_parallel else 1)
    return BlockWork(tuple(gemms), fwd, bwd, acts.per_rank(s.tp, s.sequence_parallel) * t, moe,
                     (norms + ffn_acts.tp_split) * t)


def _expert_gemms(s: Setup, imbalance: float) -> list[Gemm]:
    """The routed experts' grouped GEMMs on the busiest rank: its copies (tokens x top-k, times the
    imbalance) spread over its local experts. Expert parallelism borrows the data-parallel ranks, so
    a rank's experts see as many copies as its own tokens send out (under balance). With tp > 1 and
    ep > 1 (Megatron's MoE parallel folding, expert TP 1) each TP rank dispatches its sequence shard;
    with tp > 1 and ep = 1 (this trainer) the experts' intermediate dimension is split by TP."""
    m = s.ffn
    k, mi, h = m.num_experts_per_tok, m.moe_intermediate_size, m.hidden_size
    if s.tp > 1 and s.ep == 1:
        copies, local, inter = s.tokens * k, m.n_routed_experts, mi / s.tp
    else:
        copies, local, inter = s.tokens * k / s.tp, m.n_routed_experts // s.ep, mi
    rows = copies * imbalance / local
    return [Gemm(rows, 2 * inter, h, local, True), Gemm(rows, h, inter, local, True)]


def head_work(s: Setup) -> tuple[list[Gemm], float]:
    """The last stage's output head(s) (main + MTP) and their glue bytes (fp32 logits)."""
    m = s.ffn
    heads = 1 + mtp_layers(m)
    gemm = Gemm(s.tokens, m.vocab_size / s.tp, m.hidden_size, heads)
    acts = _head_acts(m, s.tp, s.act_bytes)
    return [gemm], acts.per_rank(s.tp, s.sequence_parallel) * s.tokens * heads


# Kernels one decoder block launches per micro-batch, forward + backward, as bench.kernel_proxy counts
# them (docs/bench/kernel_proxy_compiled.json, kernel_proxy_after.json): a MoE block of moe_1b_gpu
# eager 131 ops outside the GEMMs + 33 GEMMs + 2 attention calls; compiled 94 generated kernels + 10
# aten fallbacks + 35 extern calls. The rest of the `model` case (563 kernels: 1 dense block, 3 MoE
# blocks of 158, embedding, head and loss) is 89: counted for each dense block, compiled at the MoE
# block's ratio. A fused framework (Megatron-TE, DeepSeek's kernels) launches about what inductor does.
# Parameter tensors per block as the trainer holds them (experts stacked): configs/moe_1b_gpu.yaml has
# 240 over 16 blocks (embedding, head and final norm included), configs/moe_bench.yaml 60 over 4.
PARAM_TENSORS_PER_BLOCK = 15
KERNELS = {("moe", "eager"): 166, ("moe", "compiled"): 139, ("dense", "eager"): 89, ("dense", "compiled"): 75}


def block_kernels(s: Setup, layer: int, compiled: bool) -> float:
    """Kernels block `layer` launches per micro-batch, forward + backward (+ a forward's third again
    under full recomputation)."""
    kind = "moe" if is_moe_layer(s.ffn, layer) else "dense"
    extra = 1 / 3 if s.recompute == "full" else 0.0
    return KERNELS[(kind, "compiled" if compiled else "eager")] * (1 + extra)


def stage_blocks(s: Setup, stage: int) -> list[int]:
    return _stage_blocks(s.ffn, list(s.partition), stage)


def _block_kinds(s: Setup, stage: int) -> list[tuple[int, int]]:
    """(a layer of each kind, how many) on `stage`: dense, MoE and MTP blocks each cost alike."""
    kinds: dict = {}
    for layer in stage_blocks(s, stage):
        key = (is_moe_layer(s.ffn, layer), layer >= s.ffn.num_hidden_layers)
        first, n = kinds.get(key, (layer, 0))
        kinds[key] = (first, n + 1)
    return list(kinds.values())


# ----------------------------------------------------------------------------- parameters and bytes

@dataclass(frozen=True)
class RankBytes:
    """One rank of a stage: parameters it holds, and what it sends per micro-batch / per step."""

    dense_params: float
    expert_params: float
    tp_bytes: float  # per micro-batch, forward + backward (+ recompute)
    cp_bytes: float
    a2a_bytes: float  # sent = received, per micro-batch, all MoE blocks, all passes
    a2a_layers: float  # MoE blocks x passes (forward, backward, recompute) behind a2a_bytes
    p2p_bytes: float  # pipeline sends per micro-batch (activations forward, gradients backward)


def rank_params(s: Setup, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters one rank of `stage` holds: TP splits what it splits (memory's rule),
    experts over EP (and TP with ep = 1), the embedding on the first stage, head and norm on the last."""
    dense = expert = 0.0
    for layer, n in _block_kinds(s, stage):
        shapes = {**{n: sh for n, sh in layer_shapes(s.attn, layer).items() if n.startswith("self_attn.")},
                  **{n: sh for n, sh in layer_shapes(s.ffn, layer).items() if not n.startswith("self_attn.")}}
        for name, shape in shapes.items():
            if ".experts." in f".{name}":
                expert += n * numel(shape) / (s.ep * (s.tp if s.ep == 1 else 1))
            else:
                dense += n * numel(shape) * _rank_share(name, s.tp, s.ep)
    table = s.ffn.vocab_size * s.ffn.hidden_size / s.tp
    dense += table * ((stage == 0) + (stage == s.pp - 1))
    return dense, expert


def rank_bytes(s: Setup, stage: int) -> RankBytes:
    """The planner's traffic (comm.py) for one rank of `stage`, per micro-batch."""
    blocks = stage_blocks(s, stage)
    m, b, t = s.ffn, s.act_bytes, s.tokens
    dense, expert = rank_params(s, stage)
    tp = tensor_parallel_bytes(len(blocks), 1, s.tp, t * m.hidden_size * b, s.recompute) + \
        tensor_parallel_extra_bytes(s.attn, stage, s.pp, len(blocks), 1, s.tp, t, b, s.grad_bytes,
                                    s.sequence_parallel)
    cp = context_parallel_bytes(len(blocks), 1, s.cp, t * _kv_bytes_per_token(s.attn, s.tp, b), s.recompute)
    moe = sum(is_moe_layer(m, i) for i in blocks)
    a2a, layers = 0.0, moe * _passes(s.recompute)
    if moe and s.ep > 1:
        dispatched = t / s.tp  # each TP rank dispatches its sequence shard
        one = alltoall_bytes_expected(dispatched, m.num_experts_per_tok, m.hidden_size, s.ep, b, m.n_routed_experts,
                                      s.dedup_dispatch, m.n_group, m.topk_group)
        a2a = layers * one.sent
    width = m.hidden_size * (2 if mtp_layers(m) else 1)
    sends = (stage < s.pp - 1) + (stage > 0)
    p2p = sends * t * width * b / (s.tp if s.sequence_parallel else 1) * s.virtual_stages
    return RankBytes(dense, expert, tp, cp, a2a, layers, p2p)


def ep_remote_share(s: Setup) -> float:
    """Share of a rank's EP peers on other nodes. EP groups are consecutive ranks of the (cp, dp)
    dimension at stride tp (this trainer), or of (tp, cp, dp) at stride 1 with MoE parallel folding."""
    if s.ep == 1:
        return 0.0
    stride = 1 if s.tp > 1 and s.ep > 1 else s.tp
    local = max(1, min(s.ep, s.gpus_per_node // stride))
    return (s.ep - local) / (s.ep - 1)


def node_dedup_bytes(s: Setup, dispatch_bytes: float) -> float:
    """Network bytes one rank sends per MoE layer and pass when a token crosses to each other node
    once (DeepSeek-V3's dispatch: over InfiniBand to the same-index GPU of each target node, then
    NVLink inside it; its combine comes back the same way): the expected other nodes a token's experts
    sit on, under the group-limited routing (a node holds whole expert groups when they align), times
    its hidden state in the dispatch's and the combine's precision."""
    from .comm import expected_remote_ranks
    stride = 1 if s.tp > 1 and s.ep > 1 else s.tp
    nodes = max(1, s.ep * stride // s.gpus_per_node)
    if nodes == 1:
        return 0.0
    m = s.ffn
    groups_ok = m.n_group % nodes == 0
    remote = expected_remote_ranks(m.n_routed_experts, m.num_experts_per_tok, nodes,
                                   m.n_group if groups_ok else 1, m.topk_group if groups_ok else 1)
    return s.tokens / s.tp * remote * m.hidden_size * (dispatch_bytes + s.act_bytes)


def spans_nodes(group: int, stride: int, node: int) -> bool:
    """Whether a group of `group` ranks at `stride` crosses a node boundary."""
    return group > 1 and group * stride > node


def dp_strides(s: Setup) -> tuple[int, int]:
    """(stride of the dense data-parallel group, of the expert-data-parallel group) in the rank order."""
    dense = s.tp * s.cp if s.moe_order else s.tp * s.cp * s.pp
    expert = dense * s.ep if s.tp == 1 or s.ep == 1 else s.ep
    return dense, expert


def uniform_imbalance(s: Setup) -> float:
    """The busiest EP rank's load over the mean when every copy picks a rank uniformly at random: a
    rank receives Binomial(ep * n, 1/ep) of the group's copies (n = its tokens x top-k); the maximum
    of ep of them sits about sqrt(2 ln ep) standard deviations above the mean. A lower bound on a real
    run's imbalance (experts specialise); --load measures a run's."""
    if s.ep == 1 or not any(is_moe_layer(s.ffn, i) for i in range(s.ffn.num_hidden_layers)):
        return 1.0
    n = s.tokens / s.tp * s.ffn.num_experts_per_tok
    return 1.0 + math.sqrt(2 * math.log(s.ep)) * math.sqrt((1 - 1 / s.ep) / n)


def with_layout(s: Setup, **changes) -> Setup:
    """The same model on other degrees (the search's candidates); pp changes the partition too."""
    from .pipeline import balanced_partition
    s2 = dataclasses.replace(s, **changes)
    if "pp" in changes or "virtual_stages" in changes:
        chunks = balanced_partition(s.ffn.num_hidden_layers, s2.pp * s2.virtual_stages)
        per_rank = [sum(chunks[c] for c in range(r, len(chunks), s2.pp)) for r in range(s2.pp)]
        s2 = dataclasses.replace(s2, partition=tuple(per_rank))
    if s2.gpus % (s2.tp * s2.cp * s2.pp):
        raise PlanError(f"{s2.gpus} GPUs do not factor into tp {s2.tp} x cp {s2.cp} x pp {s2.pp}.")
    return s2


__all__ = ["Setup", "setup_from_config", "Gemm", "BlockWork", "block_work", "head_work", "stage_blocks",
           "attention_core_flops", "rank_params", "rank_bytes", "RankBytes", "ep_remote_share", "spans_nodes",
           "node_dedup_bytes", "KERNELS", "PARAM_TENSORS_PER_BLOCK", "block_kernels",
           "dp_strides", "uniform_imbalance", "with_layout", "FP32", "TokenActs"]
