"""Parameters: every parameter's Hugging Face name and shape, counts by part (total and
activated per token), and the precision recipes (bytes per parameter). Pure numbers."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from ..config import ModelConfig

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
    # what this trainer holds for train.dtype bf16 with train.grad_accum_dtype fp32 (the default): DeepSpeed's
    # BF16_Optimizer sums the micro-batches' gradients and all-reduces them in fp32, as Megatron's main grads
    "mixed_fp32_grads": Precision("mixed_fp32_grads", 2, 4, 12, 2, "bf16 params 2 + fp32 grads 4 (accumulated "
                                  "and reduced in fp32) + fp32 master, Adam m, v 12 (BF16_Optimizer)"),
}


def precision_for(name: Optional[str], train_dtype: str, grad_accum_dtype: str = "fp32") -> Precision:
    """The named recipe; by default what the trainer's DeepSpeed ZeRO-1 engine holds: `fp32_master` for
    train.dtype fp32, and for bf16 (auto: bf16 on the GPUs planned for) `mixed_fp32_grads`, or `mixed`
    with train.grad_accum_dtype bf16."""
    bf16 = "mixed_fp32_grads" if grad_accum_dtype == "fp32" else "mixed"
    name = name or ("fp32_master" if train_dtype == "fp32" else bf16)
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
