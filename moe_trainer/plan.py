"""Memory and communication planner: numbers in, numbers out.

Pure functions over a `Config` or plain numbers, no torch and no process groups
(`tools/plan.py` is the command line). What it answers before GPU time is bought:

- parameters by part, total and activated per token (`count_parameters`), and
  every parameter's Hugging Face name and shape (`param_shapes`), so the trainer
  can compare with `sum(p.numel())` of the real model;
- model-state memory per rank under ZeRO 0-3 for three precision recipes
  (`model_state_bytes`), activation memory per micro-batch with and without
  recomputation (`stage_activation_bytes`), the 1F1B in-flight micro-batch count
  (`in_flight`) and whether the heaviest stage fits in the GPU;
- the bytes each collective moves per optimizer step (data parallel / ZeRO,
  expert all-to-all, pipeline send/recv, tensor and context parallel), the
  pipeline bubble, and the exact all-to-all bytes of a concrete routing
  (`alltoall_bytes_exact`) next to its expected value (`alltoall_bytes_expected`);
- the ZeRO paper's memory table (`zero_table`).

Units: parameter counts are plain numbers; memory and traffic are bytes (the
reports print GB = 1e9 bytes, as the ZeRO paper does). Traffic is what ONE rank
sends per optimizer step with ring collectives; what it receives is the same
(exactly for the ring collectives, in expectation for the all-to-all). For a
collective over g ranks on a tensor of N bytes (the full, unsharded size):
all-reduce sends 2(g-1)/g * N, reduce-scatter and all-gather (g-1)/g * N each.
The estimates ignore communication buffers, allocator fragmentation and CUDA
workspaces: leave headroom.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from moe_trainer.config import Config, ModelConfig, ParallelConfig, validate_layout

GB = 1e9  # bytes; the ZeRO paper's unit


class PlanError(ValueError):
    """Bad planner input: the message is one user-facing sentence."""


# ----------------------------------------------------------------------------- precision recipes

@dataclass(frozen=True)
class Precision:
    """Bytes per parameter kept by one training recipe with Adam."""

    name: str
    param_bytes: int  # the weights the forward reads
    grad_bytes: int
    optim_bytes: int  # optimizer state, including any fp32 master copy
    act_bytes: int  # bytes per stored activation element
    description: str


PRECISIONS = {
    "mixed": Precision("mixed", 2, 2, 12, 2, "bf16 params 2 + bf16 grads 2 + fp32 master, Adam m, v 12 "
                                              "(ZeRO paper, K=12)"),
    "fp32": Precision("fp32", 4, 4, 8, 4, "fp32 params 4 + fp32 grads 4 + fp32 Adam m, v 8"),
    # what this trainer's DeepSpeed ZeRO-1 engine holds for train.dtype fp32: its optimizer clones the rank's
    # partition into an fp32 master copy even when the weights are fp32 (measured: tests/test_plan_honesty.py)
    "fp32_master": Precision("fp32_master", 4, 4, 12, 4, "fp32 params 4 + fp32 grads 4 + fp32 master copy, "
                                                         "Adam m, v 12 (DeepSpeed ZeRO 1-2 in fp32)"),
    "bf16": Precision("bf16", 2, 2, 4, 2, "bf16 params 2 + bf16 grads 2 + bf16 Adam m, v 4 (no master copy)"),
}


def precision_for(name: Optional[str], train_dtype: str) -> Precision:
    """The named recipe; by default what the trainer's DeepSpeed ZeRO-1 engine holds: `mixed` for
    train.dtype bf16 and `fp32_master` for fp32."""
    name = name or ("mixed" if train_dtype == "bf16" else "fp32_master")
    if name not in PRECISIONS:
        raise PlanError(f"--precision must be one of {', '.join(PRECISIONS)}, got {name!r}.")
    return PRECISIONS[name]


# ----------------------------------------------------------------------------- parameter shapes

def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    """SwiGLU MLP: gate/up [inter, hidden], down [hidden, inter]."""
    return {f"{prefix}gate_proj.weight": (inter, hidden), f"{prefix}up_proj.weight": (inter, hidden),
            f"{prefix}down_proj.weight": (hidden, inter)}


def _mla_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention in Hugging Face's DeepseekV3Attention layout."""
    h, a = m.hidden_size, m.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    s: dict[str, tuple[int, ...]] = {}
    if m.q_lora_rank is None:
        s["self_attn.q_proj.weight"] = (a * qk, h)
    else:
        s["self_attn.q_a_proj.weight"] = (m.q_lora_rank, h)
        s["self_attn.q_a_layernorm.weight"] = (m.q_lora_rank,)
        s["self_attn.q_b_proj.weight"] = (a * qk, m.q_lora_rank)
    s["self_attn.kv_a_proj_with_mqa.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, h)
    s["self_attn.kv_a_layernorm.weight"] = (m.kv_lora_rank,)
    s["self_attn.kv_b_proj.weight"] = (a * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    s["self_attn.o_proj.weight"] = (h, a * m.v_head_dim)
    if m.attention_bias:  # HF: q_a_proj, kv_a_proj_with_mqa and o_proj take attention_bias
        if m.q_lora_rank is not None:
            s["self_attn.q_a_proj.bias"] = (m.q_lora_rank,)
        s["self_attn.kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
        s["self_attn.o_proj.bias"] = (h,)
    return s


def _gqa_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Llama grouped-query attention: q/k/v/o projections (biases if attention_bias)."""
    h, a = m.hidden_size, m.num_attention_heads
    kv, d = m.num_key_value_heads or a, m.head_dim or h // a
    s = {"self_attn.q_proj.weight": (a * d, h), "self_attn.k_proj.weight": (kv * d, h),
         "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, a * d)}
    if m.attention_bias:
        s.update({"self_attn.q_proj.bias": (a * d,), "self_attn.k_proj.bias": (kv * d,),
                  "self_attn.v_proj.bias": (kv * d,), "self_attn.o_proj.bias": (h,)})
    return s


def _moe_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """DeepSeekMoE: router [E, hidden] (its e_score_correction_bias is a buffer), grouped experts, shared MLP."""
    h, e, mi = m.hidden_size, m.n_routed_experts, m.moe_intermediate_size
    s = {"mlp.gate.weight": (e, h), "mlp.experts.gate_up_proj": (e, 2 * mi, h), "mlp.experts.down_proj": (e, h, mi)}
    if m.n_shared_experts > 0:
        s.update(_mlp_shapes("mlp.shared_experts.", h, mi * m.n_shared_experts))
    return s


def is_moe_layer(m: ModelConfig, layer: int) -> bool:
    """Whether decoder layer `layer` has a MoE FFN (MTP blocks, ids >= num_hidden_layers, always do)."""
    return m.arch == "deepseek_v3" and layer >= m.first_k_dense_replace


def layer_shapes(m: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Parameters of one decoder block, names relative to `model.layers.{layer}.`."""
    h = m.hidden_size
    s = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    s.update(_mla_shapes(m) if m.arch == "deepseek_v3" else _gqa_shapes(m))
    s.update(_moe_shapes(m) if is_moe_layer(m, layer) else _mlp_shapes("mlp.", h, m.intermediate_size))
    return s


def _mtp_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """What an MTP module adds to its decoder block (embedding and head are the main model's)."""
    h = m.hidden_size
    return {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,)}


def mtp_layers(m: ModelConfig) -> int:
    """Number of MTP modules (DeepSeek-V3 only)."""
    return m.num_nextn_predict_layers if m.arch == "deepseek_v3" else 0


def param_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter by Hugging Face checkpoint name -> shape.

    Tied embeddings give no `lm_head.weight`. MTP module j is `model.layers.{num_hidden_layers + j}.`
    as in DeepSeek's checkpoint, without its shared `embed_tokens` / `shared_head.head`; so the sum of
    the numels is what `sum(p.numel() for p in model.parameters())` gives for our model.
    """
    h, n = m.hidden_size, m.num_hidden_layers
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab_size, h)}
    for i in range(n):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer_shapes(m, i).items()})
    shapes["model.norm.weight"] = (h,)
    if not m.tie_word_embeddings:
        shapes["lm_head.weight"] = (m.vocab_size, h)
    for i in range(n, n + mtp_layers(m)):
        block = {**layer_shapes(m, i), **_mtp_shapes(m)}
        shapes.update({f"model.layers.{i}.{k}": v for k, v in block.items()})
    return shapes


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


# ----------------------------------------------------------------------------- parameter counts

PARTS = ("embedding", "attention", "dense_ffn", "shared_experts", "routed_experts", "mtp", "norms_router")


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part (counts, not bytes).

    embedding: embed_tokens + lm_head (one table when tied); norms_router: every RMSNorm weight
    (input, post-attention, MLA's q_a/kv_a, final) and the router weights; mtp: the MTP modules'
    own parameters (their embedding and head are the main model's). Split by part inside an MTP
    module (`ParamReport.mtp_parts`), its eh_proj counts as attention.
    """

    embedding: float = 0
    attention: float = 0
    dense_ffn: float = 0
    shared_experts: float = 0
    routed_experts: float = 0
    mtp: float = 0
    norms_router: float = 0

    @property
    def total(self) -> float:
        return sum(getattr(self, p) for p in PARTS)

    @property
    def main(self) -> float:
        """Everything but the MTP modules: DeepSeek's "671B" / "37B" figures."""
        return self.total - self.mtp


def _layer_id(name: str) -> Optional[int]:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def base_part(name: str) -> str:
    """The part a parameter name belongs to, MTP modules not told apart."""
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embedding"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if name.endswith("norm.weight") or name.endswith(".mlp.gate.weight"):
        return "norms_router"
    return "dense_ffn" if ".mlp." in name else "attention"


def param_part(name: str, m: ModelConfig) -> str:
    """The part of `PARTS` a parameter name belongs to."""
    layer = _layer_id(name)
    return "mtp" if layer is not None and layer >= m.num_hidden_layers else base_part(name)


def _count(shapes: dict[str, tuple[int, ...]], part_of) -> ParamCount:
    totals = dict.fromkeys(PARTS, 0)
    for name, shape in shapes.items():
        totals[part_of(name)] += numel(shape)
    return ParamCount(**totals)


def routed_fraction(m: ModelConfig) -> float:
    """Share of the routed experts a token activates: top-k / E."""
    return m.num_experts_per_tok / m.n_routed_experts if m.arch == "deepseek_v3" else 1.0


@dataclass(frozen=True)
class ParamReport:
    """Total and per-token activated parameters.

    total: every unique parameter, MTP included: `total.total` is the model's sum(p.numel()).
    activated: what one token's forward multiplies: the top-k of the routed experts, the lm_head, and
    not the input embedding table (a lookup reads one row of it). `activated.main` is DeepSeek's
    "37B" (README_WEIGHTS: 36.7B); `activated.mtp` the MTP modules' own activated parameters.
    mtp_parts: the MTP modules alone, split by part.
    shared_embedding_head: what DeepSeek adds when it counts the MTP module with its embed/head
    (671B + 14B = 685B in the report).
    """

    total: ParamCount
    activated: ParamCount
    mtp_parts: ParamCount
    shared_embedding_head: float

    @property
    def hf_checkpoint_total(self) -> float:
        """The unique parameters plus the MTP module's copies of embed_tokens and lm_head."""
        return self.total.total + self.shared_embedding_head


def count_parameters(m: ModelConfig) -> ParamReport:
    """Parameter counts of a model config, by part; see `ParamReport`."""
    shapes = param_shapes(m)
    total = _count(shapes, lambda n: param_part(n, m))
    mtp_names = {n: s for n, s in shapes.items() if param_part(n, m) == "mtp"}
    mtp_parts = _count(mtp_names, base_part)
    frac = routed_fraction(m)
    table = m.vocab_size * m.hidden_size
    activated = dataclasses.replace(
        total, embedding=table, routed_experts=total.routed_experts * frac,
        mtp=mtp_parts.total - mtp_parts.routed_experts * (1 - frac))
    shared = mtp_layers(m) * table * (1 if m.tie_word_embeddings else 2)
    return ParamReport(total=total, activated=activated, mtp_parts=mtp_parts, shared_embedding_head=shared)


def expected_numel(m: ModelConfig) -> int:
    """What `sum(p.numel() for p in model.parameters())` must give for our model of this config."""
    return sum(numel(s) for s in param_shapes(m).values())


# ----------------------------------------------------------------------------- pipeline stages

def balanced_partition(n_layers: int, pp: int) -> list[int]:
    """Decoder layers per pipeline stage, as even as possible.

    The extra layers go to the middle stages first, so the first stage (embedding) and the last
    (final norm, head, loss, MTP) get the fewer: Llama 3 405B's 126 layers on 16 stages give
    7, 8 x 14, 7, the split Meta reports.
    """
    if not 1 <= pp <= n_layers:
        raise PlanError(f"pipeline stages ({pp}) must be between 1 and the number of layers ({n_layers}).")
    base, extra = divmod(n_layers, pp)
    order = list(range(1, pp - 1)) + [0, pp - 1][: min(pp, 2)]
    sizes = [base] * pp
    for stage in order[:extra]:
        sizes[stage] += 1
    return sizes


def stage_partition(cfg: Config) -> list[int]:
    """Layers per stage exactly as the trainer splits them: `parallel.pp_partition`
    if given, else balanced by estimated compute (parallel/pipeline.py). With
    parallel.virtual_stages > 1, the layers of each rank's chunks together (the
    memory figures treat them as one block)."""
    from .parallel.pipeline import rank_chunks, stage_layers
    virtual, pp = stage_layers(cfg, cfg.train.seq_len), cfg.parallel.pp
    return [sum(len(c) for c in rank_chunks(virtual, s, pp)) for s in range(pp)]


def in_flight(stage: int, pp: int, micro_batches: int, chunks: int = 1) -> float:
    """Micro-batches' worth of activations stage `stage` (0-based) holds at once under 1F1B:
    min(pp - stage, m); interleaved (chunks = v > 1): the warm-up's chunk forwards plus one,
    each 1/v of the stage's layers (stage 0: (v p + p - 1) / v, more than plain 1F1B's p)."""
    if chunks == 1:
        return min(pp - stage, micro_batches)
    from .parallel.pipeline import interleaved_warmup
    warmup = interleaved_warmup(stage, pp, micro_batches, chunks)
    return min(warmup + 1, chunks * micro_batches) / chunks


def bubble_fraction(pp: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share of a 1F1B / GPipe step: (p - 1) / (m + p - 1); interleaved over v chunks per
    rank: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (chunks * micro_batches + pp - 1)


def _layer_stages(partition: Sequence[int]) -> list[int]:
    """Stage of each decoder layer."""
    return [stage for stage, n in enumerate(partition) for _ in range(n)]


def _stages_of(name: str, m: ModelConfig, layer_stage: list[int]) -> tuple[int, ...]:
    """Stages that hold a parameter. No stage copies embed_tokens: MTP modules on the last stage read
    the token embeddings that the first stage sends along with the hidden states (the trainer's
    pipeline carries [h, emb]), and a head tied to the embedding is refused with pp > 1. Only a
    tied head (pp = 1 in the trainer) would need a copy."""
    last = max(layer_stage)
    layer = _layer_id(name)
    if layer is not None:
        return (layer_stage[layer] if layer < m.num_hidden_layers else last,)
    if "embed_tokens" in name:
        return (0, last) if last > 0 and m.tie_word_embeddings else (0,)
    return (last,)  # model.norm, lm_head


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


def _attention_acts(m: ModelConfig, tp: int, b: int) -> TokenActs:
    """Korthikanti et al. 2022's accounting with flash attention (no s^2 terms): the norm's input and
    output, Q, K, V, the attention output and its fp32 log-sum-exp. MLA: its real shapes, K expanded
    to every head, plus the q/kv latents around their norms (replicated under TP)."""
    h, a = m.hidden_size, m.num_attention_heads
    heads = a / tp
    if m.arch == "deepseek_v3":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        latents = 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank
        return TokenActs((2 * h + latents) * b, heads * (2 * qk + 2 * m.v_head_dim) * b + heads * FP32)
    d, kv = m.head_dim or h // a, m.num_key_value_heads or a
    kv_per_rank = max(kv / tp, 1)  # GQA heads are replicated when tp > kv heads
    return TokenActs(2 * h * b, (2 * heads + 2 * kv_per_rank) * d * b + heads * FP32)


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


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes on one rank of a stage (the last stage's loss and MTP modules included)."""

    per_micro_batch: float  # no recomputation
    per_micro_batch_recompute: float  # full recomputation: each layer's input (the loss is kept)
    working_set: float  # full recomputation: one layer's activations rebuilt during its backward
    in_flight: float  # micro-batches' worth (fractional with parallel.virtual_stages > 1)
    no_recompute: float  # in_flight * per_micro_batch
    full_recompute: float  # in_flight * per_micro_batch_recompute + working_set


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


def stage_activation_bytes(cfg: Config, partition: Sequence[int], stage: int, micro_batches: int,
                           prec: Precision) -> StageActivations:
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
    full = [layer_acts(m, i, p.tp, b).per_rank(p.tp, sp) * tokens for i in blocks]
    loss = _loss_acts(m, p.tp, b).per_rank(p.tp, sp) * tokens if stage == len(partition) - 1 else 0.0
    kept = len(blocks) * m.hidden_size * b / (p.tp if sp else 1) * tokens + loss
    flight = in_flight(stage, p.pp, micro_batches, p.virtual_stages)
    working = max(full, default=0.0)
    return StageActivations(per_micro_batch=sum(full) + loss, per_micro_batch_recompute=kept,
                            working_set=working, in_flight=flight, no_recompute=flight * (sum(full) + loss),
                            full_recompute=flight * kept + working)


# ----------------------------------------------------------------------------- expert all-to-all

@dataclass(frozen=True)
class AllToAllBytes:
    """Bytes one rank moves in one MoE layer's forward all-to-alls: dispatch, then combine.

    Only token copies that leave their rank count. The combine sends each expert output back to the
    token's rank, so combine_send = dispatch_recv and combine_recv = dispatch_send. The backward
    repeats both with the roles swapped (the same bytes again).
    """

    dispatch_send: float
    dispatch_recv: float
    combine_send: float
    combine_recv: float
    sent: float  # dispatch_send + combine_send
    received: float  # dispatch_recv + combine_recv
    total: float  # sent + received

    @classmethod
    def of(cls, dispatch_send: float, dispatch_recv: float) -> "AllToAllBytes":
        sent = received = dispatch_send + dispatch_recv
        return cls(dispatch_send, dispatch_recv, dispatch_recv, dispatch_send, sent, received, sent + received)


def _as_lists(x):
    """Nested lists from nested lists or tensors (`.tolist()`: a host sync for device tensors)."""
    return x.tolist() if hasattr(x, "tolist") else [_as_lists(v) if not isinstance(v, (int, float)) else v
                                                      for v in x]


def remote_copies(routing, n_experts: int, ep: int, dedup: bool = False) -> list[list[int]]:
    """copies[src][dst]: token copies EP rank src sends to EP rank dst in a dispatch (0 when src == dst).

    routing[r][t] lists the global expert ids chosen for token t of EP rank r, for every rank of the
    EP group; expert e lives on rank e // (n_experts / ep). With `dedup` a token goes to a rank once,
    however many of its experts live there.
    """
    routing = _as_lists(routing)
    if ep < 1 or n_experts % ep or len(routing) != ep:
        raise PlanError(f"routing must list the tokens of all {ep} EP ranks and n_experts ({n_experts}) must be "
                        f"divisible by ep ({ep}); got routing for {len(routing)} ranks.")
    per_rank = n_experts // ep
    copies = [[0] * ep for _ in range(ep)]
    for src, tokens in enumerate(routing):
        for experts in tokens:
            if any(not 0 <= int(e) < n_experts for e in experts):
                raise PlanError(f"expert ids must lie in [0, {n_experts}), got {experts} on EP rank {src}.")
            dests = [int(e) // per_rank for e in experts]
            for dst in (set(dests) if dedup else dests):
                copies[src][dst] += dst != src
    return copies


def alltoall_bytes_exact(routing, n_experts: int, ep: int, rank: int, hidden: int, bytes_per_elem: int,
                         dedup: bool = False) -> AllToAllBytes:
    """Exact bytes EP rank `rank` sends and receives in one layer's dispatch and combine for a concrete
    routing (see `remote_copies` for its layout): each copy that leaves a rank carries hidden *
    bytes_per_elem bytes. The expert-parallel dispatcher must move exactly this."""
    copies = remote_copies(routing, n_experts, ep, dedup)
    row = hidden * bytes_per_elem
    sent = sum(copies[rank]) * row
    received = sum(copies[src][rank] for src in range(ep)) * row
    return AllToAllBytes.of(sent, received)


def _rank_hit_probability(rank: int, n_experts: int, topk: int, ep: int, n_group: int, topk_group: int) -> float:
    """P(EP rank `rank` holds at least one of a token's experts) when the token picks topk_group of
    n_group groups uniformly, then top-k experts uniformly among those groups' experts (what iid
    scores give under DeepSeek's group-limited routing; n_group = topk_group = 1 is plain top-k)."""
    per_rank, per_group = n_experts // ep, n_experts // n_group
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    overlaps = [min(hi, (g + 1) * per_group) - max(lo, g * per_group) for g in range(n_group)]
    overlaps = [o for o in overlaps if o > 0]
    pool = topk_group * per_group
    ways = {(0, 0): 1}  # (groups of this rank chosen, its experts in the pool) -> number of subsets
    for o in overlaps:
        grown = dict(ways)
        for (c, x), w in ways.items():
            grown[(c + 1, x + o)] = grown.get((c + 1, x + o), 0) + w
        ways = grown
    others = n_group - len(overlaps)
    miss = sum(w * math.comb(others, topk_group - c) * math.comb(pool - x, topk)
               for (c, x), w in ways.items() if c <= topk_group)
    return 1 - miss / (math.comb(n_group, topk_group) * math.comb(pool, topk))


def expected_remote_ranks(n_experts: int, topk: int, ep: int, n_group: int = 1, topk_group: int = 1) -> float:
    """Expected number of OTHER EP ranks a token is sent to with dedup, under uniform routing:
    (ep - 1) / ep * sum over ranks of P(rank hit), averaging over the token's own rank. With
    node-limited routing and whole groups per rank (n_group % ep == 0) it never exceeds topk_group."""
    if ep == 1:
        return 0.0
    hits = sum(_rank_hit_probability(r, n_experts, topk, ep, n_group, topk_group) for r in range(ep))
    return (ep - 1) / ep * hits


def alltoall_bytes_expected(tokens: float, topk: int, hidden: int, ep: int, bytes_per_elem: int,
                            n_experts: Optional[int] = None, dedup: bool = False, n_group: int = 1,
                            topk_group: int = 1) -> AllToAllBytes:
    """Expected bytes per rank of one layer's dispatch + combine under uniform routing.

    Without dedup: tokens * topk * hidden * bytes per direction, times (1 - 1/ep), the share of copies
    that leave the rank (group limits do not change it: each expert stays equally likely). So
    `sent` = tokens * topk * hidden * bytes * 2 * (1 - 1/ep); ep = 1 moves nothing. With dedup a token
    crosses to each rank once: `expected_remote_ranks` copies instead of topk * (1 - 1/ep).
    """
    if dedup and n_experts is None:
        raise PlanError("the expected all-to-all with dedup needs n_experts.")
    copies = expected_remote_ranks(n_experts, topk, ep, n_group, topk_group) if dedup else topk * (ep - 1) / ep
    send = tokens * copies * hidden * bytes_per_elem
    return AllToAllBytes.of(send, send)


def alltoall_bytes(tokens: float, topk: int, hidden: int, ep: int, bytes_per_elem: int, routing=None,
                   n_experts: Optional[int] = None, rank: int = 0, dedup: bool = False, n_group: int = 1,
                   topk_group: int = 1) -> AllToAllBytes:
    """One entry point: `alltoall_bytes_exact` for a concrete `routing`, else `alltoall_bytes_expected`."""
    if routing is None:
        return alltoall_bytes_expected(tokens, topk, hidden, ep, bytes_per_elem, n_experts, dedup, n_group,
                                       topk_group)
    if n_experts is None:
        raise PlanError("an exact all-to-all count needs n_experts to place experts on ranks.")
    return alltoall_bytes_exact(routing, n_experts, ep, rank, hidden, bytes_per_elem, dedup)


# ----------------------------------------------------------------------------- other collectives

@dataclass(frozen=True)
class ZeroComm:
    """Bytes one rank sends per optimizer step for gradient reduction and ZeRO's parameter gathers."""

    all_reduce: float
    reduce_scatter: float
    all_gather: float
    total: float

    @classmethod
    def of(cls, all_reduce: float = 0.0, reduce_scatter: float = 0.0, all_gather: float = 0.0) -> "ZeroComm":
        return cls(all_reduce, reduce_scatter, all_gather, all_reduce + reduce_scatter + all_gather)


def zero_comm(n_params: float, group: int, zero: int, micro_batches: int, prec: Precision,
              stage1_all_reduce: bool = False) -> ZeroComm:
    """Data-parallel traffic for `n_params` parameters replicated over `group` ranks. What is counted:

    ZeRO-0: one all-reduce of the gradients per step (accumulated locally over the micro-batches).
    ZeRO-1: the gradients reduce-scattered once per step (each rank needs the sum for its optimizer
    shard only), then the updated parameters all-gathered: together the bytes of one all-reduce.
    With `stage1_all_reduce` (what DeepSpeed's stage 1 does, and so `make_plan`: it all-reduces the
    whole gradient buffer at the accumulation boundary, reduce-scattering only from stage 2 on) the
    gradients are all-reduced instead: 1.5x the bytes of the textbook ZeRO-1.
    ZeRO-2: the reduce-scatter runs every micro-batch (no full gradient buffer to accumulate into, as
    in DeepSpeed), then one all-gather. ZeRO-3: every micro-batch all-gathers the parameters for the
    forward and again for the backward and reduce-scatters the gradients (3x instead of 2x).
    """
    f = (group - 1) / group
    grads, params = n_params * prec.grad_bytes * f, n_params * prec.param_bytes * f
    if zero == 0:
        return ZeroComm.of(all_reduce=2 * grads)
    if zero == 1:
        if stage1_all_reduce:
            return ZeroComm.of(all_reduce=2 * grads, all_gather=params)
        return ZeroComm.of(reduce_scatter=grads, all_gather=params)
    if zero == 2:
        return ZeroComm.of(reduce_scatter=micro_batches * grads, all_gather=params)
    return ZeroComm.of(reduce_scatter=micro_batches * grads, all_gather=2 * micro_batches * params)


def _passes(recompute: str) -> int:
    """Forward-like passes per micro-batch: forward, backward, and the recomputed forward."""
    return 3 if recompute == "full" else 2


def pipeline_bytes(stage: int, pp: int, micro_batches: int, boundary_bytes: float) -> float:
    """Send/recv per step: each micro-batch's activations go to the next stage in the forward and
    their gradients to the previous stage in the backward (boundary_bytes each)."""
    sends = (stage < pp - 1) + (stage > 0)
    return micro_batches * sends * boundary_bytes


def tensor_parallel_bytes(blocks: int, micro_batches: int, tp: int, activation_bytes: float, recompute: str) -> float:
    """Per block and pass, 2 all-reduces of the [tokens, hidden] activation (activation_bytes), or with
    sequence parallelism 2 all-gathers + 2 reduce-scatters: the same 4 (tp-1)/tp * activation_bytes."""
    return blocks * micro_batches * _passes(recompute) * 4 * (tp - 1) / tp * activation_bytes


def tensor_parallel_extra_bytes(m: ModelConfig, stage: int, pp: int, n_blocks: int, micro_batches: int, tp: int,
                                 tokens: float, act_bytes: int, grad_bytes: int, sp: bool) -> float:
    """What tensor parallelism moves outside the blocks' 4 collectives per pass, per step: the
    vocabulary-parallel embedding (first stage: all-reduce forward, or reduce-scatter forward +
    all-gather backward with SP) and the head's input (last stage: all-reduce backward, or all-gather
    forward + reduce-scatter backward): 2 (tp-1)/tp x [tokens, hidden] each; the vocabulary-parallel
    loss (last stage: 3 all-reduces of an fp32 [tokens] vector: max, sum of exponentials, target
    logit); with SP the all-reduce of each replicated RMSNorm weight's partial grad (2 per block +
    the final norm); k/v projections replicated because kv heads < tp: their grads all-reduced in an
    (kv heads, ...) buffer. Every micro-batch."""
    if tp == 1:
        return 0.0
    f, h = 2 * (tp - 1) / tp, m.hidden_size
    ends = (stage == 0) + (stage == pp - 1)
    per_mb = ends * f * tokens * h * act_bytes
    if stage == pp - 1:
        per_mb += 3 * f * tokens * FP32
    if sp:
        per_mb += f * h * grad_bytes * (2 * n_blocks + (stage == pp - 1))
    kv = m.num_key_value_heads or m.num_attention_heads
    if m.arch == "llama3" and kv < tp:
        d = m.head_dim or h // m.num_attention_heads
        per_mb += n_blocks * 2 * f * kv * d * h * grad_bytes
    return micro_batches * per_mb


def context_parallel_bytes(blocks: int, micro_batches: int, cp: int, local_kv_bytes: float, recompute: str) -> float:
    """Per block: the forward all-gathers K and V from the cp ranks ((cp-1) * local_kv_bytes sent), the
    backward reduce-scatters their gradients (the same); a full recomputation gathers again."""
    return blocks * micro_batches * _passes(recompute) * (cp - 1) * local_kv_bytes


def _kv_bytes_per_token(m: ModelConfig, tp: int, b: int) -> float:
    """What context parallelism gathers per token: K and V of the rank's heads (GQA), or for MLA the
    compressed latent plus the shared RoPE key (kv_lora_rank + qk_rope_head_dim), up-projected locally."""
    if m.arch == "deepseek_v3":
        return (m.kv_lora_rank + m.qk_rope_head_dim) * b
    kv, d = m.num_key_value_heads or m.num_attention_heads, m.head_dim or m.hidden_size // m.num_attention_heads
    return 2 * max(kv / tp, 1) * d * b


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
    params: RankParams
    states: ModelStateBytes  # under the plan's ZeRO stage and precision
    activations: StageActivations
    activation_bytes: float  # under the config's parallel.recompute
    total: float  # states + activation_bytes
    comm: StageComm


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


def _bubble_line(plan: Plan, pp: int, mb: int) -> str:
    """The pipeline bubble and stage 0's activations in flight, plain or interleaved (v > 1)."""
    v = plan.virtual_stages
    flight = plan.stages[0].activations.in_flight
    if v == 1:
        return (f"**Pipeline bubble** (p-1)/(m+p-1) = {pp - 1}/{mb + pp - 1} = {plan.bubble:.1%}. "
                f"In flight on stage 0: {flight} micro-batches.")
    return (f"**Pipeline bubble**, interleaved 1F1B over v = {v} chunks per rank: (p-1)/(v*m+p-1) = {pp - 1}/"
            f"{v * mb + pp - 1} = {plan.bubble:.1%} (plain 1F1B: {bubble_fraction(pp, mb):.1%}). In flight on "
            f"stage 0: {flight:g} micro-batches' worth of activations (plain 1F1B: {in_flight(0, pp, mb)}).")


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
    acts = stage_activation_bytes(cfg, partition, stage, st.micro_batches, st.precision)
    act = acts.full_recompute if cfg.parallel.recompute == "full" else acts.no_recompute
    blocks = _stage_blocks(cfg.model, partition, stage)
    comm = _stage_comm(cfg, st, stage, blocks, params)
    moe = sum(is_moe_layer(cfg.model, i) for i in blocks)
    return StagePlan(stage, partition[stage], moe, params, states, acts, act, states.total + act, comm)


def make_plan(cfg: Config, gpus: int, gpu_memory_gb: float = 80.0, zero: int = 1,
              precision: Optional[str] = None) -> Plan:
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
    layout = validate_layout(cfg, gpus)
    prec = precision_for(precision, t.dtype)
    partition = stage_partition(cfg)
    alltoall = alltoall_bytes_expected(_tokens_per_rank(cfg), m.num_experts_per_tok, m.hidden_size, p.ep,
                                       prec.act_bytes, m.n_routed_experts, p.dedup_dispatch, m.n_group,
                                       m.topk_group)
    st = _Setting(prec, zero, layout.grad_accum, layout.dp * layout.cp, layout.edp, alltoall)
    per_rank = rank_params(m, p, partition)
    stages = [_stage_plan(cfg, st, partition, s, per_rank[s]) for s in range(p.pp)]
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
        bubble=bubble_fraction(p.pp, layout.grad_accum, p.virtual_stages), peak_stage=peak.stage, peak_bytes=peak.total,
        fits=peak.total <= gpu_memory_gb * GB, virtual_stages=p.virtual_stages)


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


# ----------------------------------------------------------------------------- reports

def fmt_count(n: float) -> str:
    """Parameter counts: 671.03B, 14.7M, 320."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def fmt_bytes(n: float) -> str:
    """Decimal byte units (GB = 1e9 bytes): 31.41 GB, 924.8 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


_PART_LABELS = {
    "embedding": "embedding (embed_tokens + lm_head)", "attention": "attention", "dense_ffn": "dense FFN",
    "shared_experts": "shared experts", "routed_experts": "routed experts", "mtp": "MTP modules (own parameters)",
    "norms_router": "norms + router",
}


def _param_lines(pr: ParamReport) -> list[str]:
    rows = [[_PART_LABELS[p], fmt_count(getattr(pr.total, p)), fmt_count(getattr(pr.activated, p))] for p in PARTS]
    rows += [["**main model** (without MTP)", f"**{fmt_count(pr.total.main)}**",
              f"**{fmt_count(pr.activated.main)}**"],
             ["all unique parameters (= sum of numel)", fmt_count(pr.total.total), fmt_count(pr.activated.total)]]
    lines = ["### Parameters", "", *_table(["part", "total", "activated per token"], rows), ""]
    if pr.total.mtp:
        mtp = pr.mtp_parts
        lines += [f"MTP modules: {fmt_count(mtp.total)} own parameters (routed experts "
                  f"{fmt_count(mtp.routed_experts)}), "
                  f"{fmt_count(mtp.total + pr.shared_embedding_head)} counted with the embedding and head they share; "
                  f"main model + MTP with its shared copies = {fmt_count(pr.hf_checkpoint_total)} "
                  f"(the Hugging Face checkpoint's size).", ""]
    lines += ["Activated: the top-k routed experts, the lm_head, not the input embedding table (a lookup reads one "
              "row of it).", ""]
    return lines


def _state_lines(plan: Plan) -> list[str]:
    rows = [[name, f"ZeRO-{z}", fmt_bytes(s.params), fmt_bytes(s.grads), fmt_bytes(s.optimizer), fmt_bytes(s.total)]
            for name, states in plan.state_table.items() for z, s in enumerate(states)]
    heavy = plan.stages[plan.heaviest_stage].params
    notes = [f"`{p.name}`: {p.description}" for p in PRECISIONS.values()]
    experts = f", {fmt_count(heavy.expert)} expert parameters over edp = {plan.edp}" if heavy.expert else ""
    return [f"### Model states per rank (stage {plan.heaviest_stage}, the heaviest: {fmt_count(heavy.dense)} dense "
            f"parameters, ZeRO over dp x cp = {plan.dense_group} ranks{experts})", "", *_table(["precision", "ZeRO", "parameters", "gradients", "optimizer", "total"], rows),
            "", "; ".join(notes) + ".", ""]


def _stage_lines(plan: Plan) -> list[str]:
    limit = plan.gpu_memory_gb * GB
    rows = [[s.stage, s.layers, s.moe_blocks, fmt_count(s.params.dense + s.params.expert), fmt_bytes(s.states.total),
             fmt_bytes(s.activations.per_micro_batch), fmt_bytes(s.activations.per_micro_batch_recompute),
             s.activations.in_flight, fmt_bytes(s.activations.no_recompute), fmt_bytes(s.activations.full_recompute),
             fmt_bytes(s.total), "yes" if s.total <= limit else "**no**"] for s in plan.stages]
    header = ["stage", "layers", "MoE", "params/rank", "model states", "act/micro-batch", "act/micro-batch recomputed",
              "in flight", "act no recompute", "act full recompute", f"total ({plan.recompute})",
              f"fits {plan.gpu_memory_gb:g} GB"]
    return [f"### Memory per rank by stage (ZeRO-{plan.zero}, `{plan.precision.name}`, recompute {plan.recompute})",
            "", *_table(header, rows), "",
            "Activations (Korthikanti et al. 2022's accounting with flash attention, real MLA/GQA/SwiGLU shapes, "
            "MoE: top-k routed copies per token, fp32 logits on the last stage): in flight = min(pp - stage, "
            "micro-batches) under 1F1B; full recomputation keeps each layer's input plus one layer being "
            "recomputed. Not counted: communication buffers, allocator fragmentation, CUDA workspaces.", ""]


_ZERO_TRAFFIC = {0: "all-reduce of gradients", 1: "all-reduce gradients (as DeepSpeed's stage 1 does) + all-gather "
                                                 "parameters, once per step",
                 2: "reduce-scatter gradients every micro-batch + all-gather parameters",
                 3: "all-gather parameters twice and reduce-scatter gradients, every micro-batch"}


def _comm_rows(plan: Plan) -> list[tuple[str, object]]:
    """(label, bytes of a StagePlan) for each kind of traffic."""
    recompute = " + recompute" if plan.recompute == "full" else ""
    sp = ", as all-gather + reduce-scatter with SP" if plan.sequence_parallel else ""
    return [
        (f"data parallel, dense (ZeRO-{plan.zero}: {_ZERO_TRAFFIC[plan.zero]}; dp x cp = {plan.dense_group} ranks)",
         lambda s: s.comm.dense_dp.total),
        (f"data parallel, experts (same, over edp = {plan.edp} ranks)", lambda s: s.comm.expert_dp.total),
        (f"expert all-to-all (dispatch + combine, forward + backward{recompute}; "
         f"{fmt_bytes(plan.alltoall_per_layer.sent)} per MoE layer and micro-batch)", lambda s: s.comm.all_to_all),
        ("pipeline send/recv (activations forward, gradients backward)", lambda s: s.comm.pipeline),
        (f"tensor parallel (tp {plan.tp}: 2 all-reduces per layer per pass{sp}; embedding, head input, "
         f"vocabulary-parallel loss, replicated-weight grads)", lambda s: s.comm.tensor),
        (f"context parallel (cp {plan.cp}: all-gather K, V forward; reduce-scatter grads backward)",
         lambda s: s.comm.context),
        ("**total**", lambda s: s.comm.total),
    ]


def _comm_lines(plan: Plan) -> list[str]:
    rows = []
    for label, get in _comm_rows(plan):
        worst = max(plan.stages, key=get)
        rows.append([label, fmt_bytes(get(worst)), worst.stage] if get(worst) else [label, "-", "-"])
    dedup = " with one copy per destination rank (dedup)" if plan.dedup_dispatch else ""
    return ["### Communication per optimizer step, bytes sent by one rank (received: the same)", "",
            *_table(["collective", "bytes per step", "worst stage"], rows), "",
            "Ring collectives over g ranks: all-reduce 2(g-1)/g x size, reduce-scatter and all-gather (g-1)/g x "
            f"size. All-to-all: only copies that leave the rank, under uniform routing{dedup}.", ""]


def format_plan(plan: Plan, title: str = "") -> str:
    """The plan as a markdown report."""
    mb, pp = plan.micro_batches, plan.pp
    tokens = plan.global_batch_size * plan.seq_len
    verdict = "fits" if plan.fits else "does NOT fit"
    lines = [f"## {title or plan.arch}", "",
             f"{plan.gpus} GPUs = pp {pp} x dp {plan.dp} x tp {plan.tp} x cp {plan.cp}; ep {plan.ep} inside dp x cp, "
             f"expert-data-parallel {plan.edp}. Stages (layers): {plan.partition}. Micro-batch "
             f"{plan.micro_batch_size} x {plan.seq_len} tokens, {mb} micro-batches per step, global batch "
             f"{plan.global_batch_size} sequences = {tokens / 1e6:.1f}M tokens.", "",
             *_param_lines(plan.params), *_state_lines(plan), *_stage_lines(plan), *_comm_lines(plan),
             _bubble_line(plan, pp, mb), "",
             f"**Verdict:** the heaviest rank (stage {plan.peak_stage}) needs {fmt_bytes(plan.peak_bytes)}; "
             f"it {verdict} in {plan.gpu_memory_gb:g} GB.", ""]
    return "\n".join(lines)


def _paper_gb(n: float) -> str:
    """The ZeRO paper's rounding: 120 GB, 31.4 GB, 1.9 GB."""
    gb = n / GB
    return f"{gb:.0f} GB" if gb >= 100 else f"{gb:.1f} GB"


def format_zero_table(rows: Sequence[ZeroRow], n_params: float, dp: int, k: int = 12) -> str:
    """The ZeRO table as markdown."""
    names = ["0 (data parallel)", "1 (P_os)", "2 (P_os+g)", "3 (P_os+g+p)"]
    comm = ["2x parameters (all-reduce)", "2x parameters (reduce-scatter + all-gather)", "2x parameters",
            "3x parameters (1.5x data parallel)"]
    body = [[names[r.stage], _paper_gb(r.params), _paper_gb(r.grads), _paper_gb(r.optimizer), _paper_gb(r.total),
             comm[r.stage]] for r in rows]
    head = (f"ZeRO memory per rank (Rajbhandari et al. 2019): {n_params:.4g} parameters, data parallel {dp}, "
            f"mixed precision Adam with 2 + 2 + K={k} bytes per parameter; GB = 1e9 bytes.")
    return "\n".join([head, "", *_table(["stage", "parameters", "gradients", "optimizer state",
                                         "total per rank", "communication per step"], body), ""])
