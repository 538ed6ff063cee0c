"""Memory per rank: parameters per rank of each stage, model states under ZeRO 0-3,
activations per micro-batch with and without recomputation, and the ZeRO paper's table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..config import Config, ModelConfig, ParallelConfig
from .params import PlanError, Precision, is_moe_layer, mtp_layers, numel, param_shapes
from .pipeline import _layer_stages, _stages_of, in_flight


# ----------------------------------------------------------------------------- parameters per rank

@dataclass(frozen=True)
class RankParams:
    """Parameters one rank of a stage holds (before ZeRO).

    dense: replicated over the dense data-parallel group (after the TP split);
    expert: routed-expert parameters (after the EP split), replicated over the expert-data-parallel group.
    """

    dense: float
    expert: float


_TP_REPLICATED = ("norm.weight", ".mlp.gate.weight", "q_a_proj.", "kv_a_proj_with_mqa.")


def _rank_share(name: str, tp: int, ep: int) -> float:
    """Fraction of a parameter one rank holds: experts split by EP (and TP), the rest by TP except the
    norms, the router and MLA's down-projections (replicated under TP, as Megatron does)."""
    if ".mlp.experts." in name:
        return 1 / (ep * tp)
    return 1.0 if any(key in name for key in _TP_REPLICATED) else 1 / tp


def rank_params(m: ModelConfig, par: ParallelConfig, partition: Sequence[int]) -> list[RankParams]:
    """Parameters per rank of each pipeline stage."""
    layer_stage = _layer_stages(partition)
    dense, expert = [0.0] * len(partition), [0.0] * len(partition)
    for name, shape in param_shapes(m).items():
        share = numel(shape) * _rank_share(name, par.tp, par.ep)
        for stage in _stages_of(name, m, layer_stage):
            (expert if ".mlp.experts." in name else dense)[stage] += share
    return [RankParams(d, e) for d, e in zip(dense, expert)]


# ----------------------------------------------------------------------------- model-state memory

@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state on one rank."""

    params: float
    grads: float
    optimizer: float
    total: float

    @classmethod
    def of(cls, params: float, grads: float, optimizer: float) -> "ModelStateBytes":
        return cls(params, grads, optimizer, params + grads + optimizer)


def model_state_bytes(p: RankParams, prec: Precision, zero: int, dense_group: int,
                      expert_group: int) -> ModelStateBytes:
    """ZeRO stage `zero` shards optimizer state (>= 1), gradients (>= 2) and parameters (3): dense
    parameters over `dense_group` ranks, expert parameters over `expert_group` (expert-data-parallel)."""
    def per_rank(sharded: bool) -> float:
        return p.dense / dense_group + p.expert / expert_group if sharded else p.dense + p.expert

    return ModelStateBytes.of(prec.param_bytes * per_rank(zero >= 3), prec.grad_bytes * per_rank(zero >= 2),
                              prec.optim_bytes * per_rank(zero >= 1))


DS_ALLREDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's engine all-reduces gradients in buckets this large


def grad_reduce_bytes(p: RankParams, prec: Precision) -> float:
    """The step boundary's temporaries (DeepSpeed's engine, ZeRO 0-1): after the last backward it
    flattens the gradients into buckets of up to DS_ALLREDUCE_BUCKET elements and all-reduces them;
    the dry run sees two gradient-sized copies live at once. The activations are gone by then, so a
    stage needs states + max(activations, this)."""
    return 2 * prec.grad_bytes * min(p.dense + p.expert, DS_ALLREDUCE_BUCKET)


def micro_batch_grad_bytes(p: RankParams, prec: Precision, zero: int) -> float:
    """The micro-batch's own gradients, in the weights' dtype, when they are accumulated elsewhere
    (`mixed_fp32_grads`: DeepSpeed's BF16_Optimizer folds each backward's bf16 param.grad into its
    fp32 buffer after that backward, so at its end every bf16 gradient is live beside the
    activations still in flight; 7.4 + 1.9 GB at DeepSeek-V3's stage 0 in the dry run). Recipes
    that accumulate in param.grad itself count it in the model states; ZeRO 2-3 reduce it in
    buckets during the backward."""
    if prec.grad_bytes == prec.param_bytes or zero >= 2:
        return 0.0
    return prec.param_bytes * (p.dense + p.expert)


@dataclass(frozen=True)
class CopyBytes:
    """Redundant slots (parallel.redundant_slots r with slot-owned experts, parallel/slots.py) on one rank of
    a stage, every MoE layer holding its r copies (the most the re-placement may place):

    cache: the copies' weights, r expert rows a MoE layer in the model dtype, kept from one refresh to
        the next (the dispatcher's `cache`, in slot order). The expert kernels take the owned slots' rows
        with the parameters and the copies' rows with the cache as they are (MoE._run_experts: two calls),
        so a micro-batch in flight saves no weights of its own for its backward;
    grad_sums: the copies' gradients summed over the step's micro-batches, r rows a MoE layer in the
        gradient accumulation dtype, from a layer's first backward until the step's hand-back;
    hand_back: after the last backward, one layer's gradients for its owned rows (E / ep of them, model
        dtype) made from the received sums, and autograd's accumulation of them (SlotExperts.hand_back:
        one layer at a time, before the gradient reduction).
    """

    cache: float = 0.0
    grad_sums: float = 0.0
    hand_back: float = 0.0

    @property
    def activations(self) -> float:
        """What lives beside the activations (the rest, the cache, is there all the time)."""
        return self.grad_sums

    @property
    def after_backward(self) -> float:
        """What lives after the activations are gone and before the gradient reduction: the sums and one
        layer's hand-back."""
        return self.grad_sums + self.hand_back if self.grad_sums else 0.0


def copy_bytes(cfg: Config, moe_blocks: int, prec: Precision) -> CopyBytes:
    """The redundant slots' bytes on one rank of a stage with `moe_blocks` MoE layers (see CopyBytes)."""
    m, p = cfg.model, cfg.parallel
    r = p.redundant_slots
    if not r or not moe_blocks:
        return CopyBytes()
    row = 3 * m.hidden_size * m.moe_intermediate_size / p.tp  # one expert's elements
    return CopyBytes(cache=moe_blocks * r * row * prec.param_bytes, grad_sums=moe_blocks * r * row * prec.grad_bytes,
                     hand_back=2 * m.n_routed_experts // p.ep * row * prec.param_bytes)


# ----------------------------------------------------------------------------- activation memory

@dataclass(frozen=True)
class TokenActs:
    """Activation bytes a layer stores per token on one rank (without recomputation).

    norm_region: tensors around the norms and residuals, split over TP only with sequence parallelism;
    tp_split: tensors inside the TP region, already divided by tp.
    """

    norm_region: float
    tp_split: float

    def per_rank(self, tp: int, sp: bool) -> float:
        return self.norm_region / (tp if sp else 1) + self.tp_split

    def __add__(self, other: "TokenActs") -> "TokenActs":
        return TokenActs(self.norm_region + other.norm_region, self.tp_split + other.tp_split)


FP32 = 4  # bytes: router scores, attention log-sum-exp and logits are kept in fp32


ATTENTION_OUTPUT_COPIES = 1  # o_proj's input copied from attention's by-head output (cuDNN, _attention_acts)


def _attention_acts(m: ModelConfig, tp: int, b: int) -> TokenActs:
    """Korthikanti et al. 2022's accounting with flash attention (no s^2 terms): the norm's input and
    output, Q, K, V, the attention output and its fp32 log-sum-exp. MLA: its real shapes, K expanded
    to every head, plus the q/kv latents around their norms (replicated under TP): q_a_proj's output
    and its norm's, kv_a_proj_with_mqa's (the latent and the RoPE key) and its norm's. V is a view
    of kv_b_proj's output, so attention's saved V keeps the whole of it, K's no-RoPE half too (seen
    on an H200). There cuDNN's attention (torch 2.11's pick for MLA's 192/128 heads and for GQA)
    returns (B, H, T, Dv) laid out by head, so o_proj's (B, T, H Dv) input is a copy it keeps
    beside the output attention keeps: one more Dv per head (ATTENTION_OUTPUT_COPIES)."""
    h, a = m.hidden_size, m.num_attention_heads
    heads = a / tp
    if m.arch == "deepseek_v3":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        latents = 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_rope_head_dim
        kv_b = m.qk_nope_head_dim + m.v_head_dim
        out = (1 + ATTENTION_OUTPUT_COPIES) * m.v_head_dim
        return TokenActs((2 * h + latents) * b, heads * (2 * qk + kv_b + out) * b + heads * FP32)
    d, kv = m.head_dim or h // a, m.num_key_value_heads or a
    kv_per_rank = max(kv / tp, 1)  # GQA heads are replicated when tp > kv heads
    return TokenActs(2 * h * b, ((2 + ATTENTION_OUTPUT_COPIES) * heads + 2 * kv_per_rank) * d * b + heads * FP32)


def _ffn_acts(m: ModelConfig, layer: int, tp: int, b: int) -> TokenActs:
    """Post-attention norm input and output, then SwiGLU's gate, up and product per FFN. MoE: fp32
    router scores, and per routed copy (top-k of them) the expert's input and output (h each, needed
    by the combine's backward) plus its gate, up and product."""
    h = m.hidden_size
    if not is_moe_layer(m, layer):
        return TokenActs(2 * h * b, 3 * m.intermediate_size / tp * b)
    k, mi = m.num_experts_per_tok, m.moe_intermediate_size
    norm = 2 * h * b + m.n_routed_experts * FP32 + k * 2 * h * b
    return TokenActs(norm, (k + m.n_shared_experts) * 3 * mi / tp * b)


def layer_acts(m: ModelConfig, layer: int, tp: int, b: int) -> TokenActs:
    """Bytes per token one decoder layer stores for its backward, no recomputation."""
    return _attention_acts(m, tp, b) + _ffn_acts(m, layer, tp, b)


def _head_acts(m: ModelConfig, tp: int, b: int) -> TokenActs:
    """Final norm input and output, and fp32 logits for the cross-entropy (Korthikanti: 4sbv)."""
    return TokenActs(2 * m.hidden_size * b, m.vocab_size / tp * FP32)


LOSS_BACKWARD_FP32 = 2  # vocabulary-wide fp32 tensors per token the loss's backward adds at its peak


def loss_backward_bytes(m: ModelConfig, tp: int) -> float:
    """Bytes per token the cross-entropy's backward holds beside its saved fp32 log-probabilities, at
    the last stage's peak: the log-probabilities' gradient (from the NLL) and the logits' fp32
    gradient (log-softmax backward), each V / tp wide: measured on an H200 (torch 2.11), where the
    backward peaks at three (B T, V) fp32 tensors, the saved log-probabilities included (the dry run
    counts one more: docs/DRY_RUN.md). One head at a time: the MTP heads' backward runs after the
    main one's."""
    return LOSS_BACKWARD_FP32 * m.vocab_size / tp * FP32


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes on one rank of a stage (the last stage's loss and MTP modules included)."""

    per_micro_batch: float  # no recomputation
    per_micro_batch_recompute: float  # full recomputation: each layer's input (the loss is kept)
    working_set: float  # full recomputation: one layer's activations rebuilt during its backward
    in_flight: float  # micro-batches' worth (fractional with parallel.virtual_stages > 1)
    no_recompute: float  # in_flight * per_micro_batch + backward_peak (+ overlap_extra)
    full_recompute: float  # in_flight * per_micro_batch_recompute + working_set + backward_peak (+ records)
    # what a backward holds beside the saved activations at the stage's peak: the gradients inside
    # its heaviest layer (about that layer's activations again), or on the last stage the loss's
    # backward (loss_backward_bytes), whichever is more
    backward_peak: float = 0.0
    # parallel.overlap=a2a: what an overlapped pair holds beyond the schedule's in-flight micro-batches
    # (without recomputation; with full recomputation the records only)
    overlap_extra: float = 0.0


def _stage_blocks(m: ModelConfig, partition: Sequence[int], stage: int) -> list[int]:
    """Decoder layer ids of a stage, the MTP blocks (ids >= num_hidden_layers) on the last one."""
    first = sum(partition[:stage])
    blocks = list(range(first, first + partition[stage]))
    if stage == len(partition) - 1:
        blocks += list(range(m.num_hidden_layers, m.num_hidden_layers + mtp_layers(m)))
    return blocks


def _loss_acts(m: ModelConfig, tp: int, b: int) -> TokenActs:
    """The last stage's head for the main model and each MTP module, plus what an MTP module keeps
    around its block: enorm and hnorm inputs and eh_proj's [2h] input (4h per token)."""
    n, head = mtp_layers(m), _head_acts(m, tp, b)
    return TokenActs(head.norm_region * (1 + n) + 4 * m.hidden_size * b * n, head.tp_split * (1 + n))


def gathered_input_bytes(m: ModelConfig, tp: int, sp: bool, sp_regather: bool, b: int) -> float:
    """Bytes per token a tensor-parallel region's input costs beyond its 1/tp shard under sequence
    parallelism: this trainer's region all-gathers the normed sequence and its first projections
    keep the gathered (T, h) input for their weight gradients, where the planner's norm region
    holds h / tp. Megatron (and Meta's Llama 3 training) keeps only the shard and all-gathers it
    again in the backward (Korthikanti et al. 2022, section 4.2.2): `sp_regather` plans that."""
    return 0.0 if not sp or sp_regather else m.hidden_size * b * (1 - 1 / tp)


def overlapped(cfg: Config, micro_batches: int) -> bool:
    """Whether overlapped pairs run on CUDA ranks (resolve.overlap_runs: parallel.overlap a2a, or auto where
    the run stays eager): the gradient-accumulation micro-batches at pp 1, interleaved 1F1B's steady
    (backward, forward) pairs at pp > 1."""
    from ..resolve import overlap_runs
    p = cfg.parallel
    return overlap_runs(cfg) and micro_batches > 1 and (p.pp == 1 or p.virtual_stages > 1)


def stage_activation_bytes(cfg: Config, partition: Sequence[int], stage: int, micro_batches: int,
                           prec: Precision, sp_regather: bool = False) -> StageActivations:
    """Activation memory of one stage.

    Tokens per rank and micro-batch: micro_batch_size * seq_len / cp. Full recomputation keeps each
    block's input and, during the backward, one block's full activations (Korthikanti et al. 2022).
    Selective recomputation of the attention core saves nothing more here: flash attention already
    stores no s^2 term. MoE: under uniform routing a rank processes as many routed copies as its own
    tokens send out (tokens * top-k). The last stage has one micro-batch in flight (1F1B).
    """
    m, p, b = cfg.model, cfg.parallel, prec.act_bytes
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len / p.cp
    sp = p.sequence_parallel and p.tp > 1
    blocks = _stage_blocks(m, partition, stage)
    gathered = gathered_input_bytes(m, p.tp, sp, sp_regather, b)  # per region: attention, FFN, the head
    full = [(layer_acts(m, i, p.tp, b).per_rank(p.tp, sp) + 2 * gathered) * tokens for i in blocks]
    loss = (_loss_acts(m, p.tp, b).per_rank(p.tp, sp) + gathered * (1 + mtp_layers(m))) * tokens \
        if stage == len(partition) - 1 else 0.0
    kept = len(blocks) * m.hidden_size * b / (p.tp if sp else 1) * tokens + loss
    flight = in_flight(stage, p.pp, micro_batches, p.virtual_stages)
    extra = extra_recompute = 0.0
    if overlapped(cfg, micro_batches):
        # parallel.overlap=a2a (parallel/overlap.py): a pair runs one micro-batch's forward interleaved with
        # another's backward, stage by stage. Each MoE layer is cut into three stages whose inputs the
        # executor keeps for the stage-wise backward: h (counted above); h1, flat and the k received rows per
        # token (uniform routing); the shared experts' output and the k combined rows. With full
        # recomputation each stage's checkpoint keeps them, for every micro-batch in flight.
        moe = sum(1 for i in blocks if i < m.num_hidden_layers and is_moe_layer(m, i))
        moe_records = moe * (3 + 2 * m.num_experts_per_tok) * m.hidden_size * b * tokens
        kept += moe_records
        # What the pair adds at its peak: at pp 1 the forward fills memory as the backward (the previous
        # micro-batch's, in reverse layer order) frees it, so no micro-batch more is alive, only the
        # records of the one in the pair; at pp > 1 the pair's forward (a chunk, 1/v of the stage) comes on
        # top of the schedule's in-flight chunks, with its records. Against the dry run's peaks
        # (docs/DRY_RUN.md): moe_1b_8gpu 1.00x of the heaviest rank, moe_1b_16gpu with v 2 0.99x (rank 0)
        # and 0.84x (rank 8); one more whole micro-batch read 0.81x and 1.04x / 0.89x.
        chunk = 1.0 if p.pp == 1 else 1.0 / p.virtual_stages
        records = moe_records + len(blocks) * m.hidden_size * b / (p.tp if sp else 1) * tokens
        extra = chunk * (records + (sum(full) + loss if p.pp > 1 else 0.0))
        extra_recompute = chunk * (kept if p.pp > 1 else records)
    working = max(full, default=0.0)
    last = stage == len(partition) - 1
    backward = max(working, loss_backward_bytes(m, p.tp) * tokens if last else 0.0)
    return StageActivations(per_micro_batch=sum(full) + loss, per_micro_batch_recompute=kept,
                            working_set=working, in_flight=flight,
                            no_recompute=flight * (sum(full) + loss) + backward + extra,
                            full_recompute=flight * kept + working + backward + extra_recompute,
                            backward_peak=backward, overlap_extra=extra)


# ----------------------------------------------------------------------------- the ZeRO paper's table

@dataclass(frozen=True)
class ZeroRow:
    """One row of the ZeRO paper's Table 1 / Figure 1: memory per rank and traffic per step."""

    stage: int
    params: float  # bytes per rank
    grads: float
    optimizer: float
    total: float
    comm_multiple: float  # elements sent per rank per step, in multiples of the parameter count


def zero_table(n_params: float, dp: int, k: int = 12) -> list[ZeroRow]:
    """Rajbhandari et al. 2019: mixed precision Adam keeps 2 + 2 + K bytes per parameter; stage 1
    shards the K bytes of optimizer state over dp ranks, stage 2 the gradients too, stage 3 the
    parameters too. Traffic: all-reduce = reduce-scatter + all-gather = 2x the parameters (stages
    0-2); stage 3 all-gathers twice (forward, backward) and reduce-scatters: 3x. As in the paper the
    (dp - 1) / dp factor is taken as 1."""
    if n_params <= 0 or dp < 1 or k < 0:
        raise PlanError(f"--params must be positive, --dp at least 1 and --k non-negative; got {n_params}, {dp}, {k}.")
    rows = []
    for stage in range(4):
        states = model_state_bytes(RankParams(n_params, 0.0), Precision("zero", 2, 2, k, 2, ""), stage, dp, 1)
        rows.append(ZeroRow(stage, states.params, states.grads, states.optimizer, states.total,
                            3.0 if stage == 3 else 2.0))
    return rows
