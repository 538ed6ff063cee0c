"""The published runs the step-time model is held to, and the published-run files for architectures
the trainer does not build (configs/qwen3_235b_a22b.yaml, configs/mixtral_8x22b.yaml).

A published-run file has four sections: `published` (the figure, its unit, the GPU, the GPU count,
the balance it was measured under, its source, and the framework's mechanisms), `model` (Hugging
Face config.json names of a grouped-query-attention MoE model: qwen3_moe, mixtral), `train` and
`parallel` (degrees as the recipe gives them; expert TP is 1, EP folds over TP x DP as Megatron's
MoE parallel folding does). The two trainer configs (Llama 3 405B, DeepSeek-V3) are held to their
figures with the mechanisms and settings listed in `CALIBRATION`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from ..config import ModelConfig
from .params import PlanError
from .pipeline import balanced_partition
from .time import Mechanisms
from .work import Setup

UNITS = ("tflops_per_gpu", "mfu", "gpu_hours_per_trillion_tokens", "tokens_per_s_per_gpu")
# forced: every expert at the mean (token drop at capacity 1.0); random: Megatron's
# moe_router_force_load_balancing, random router logits (router.py apply_random_logits), i.e. uniform
# routing, whose busiest rank sits above the mean (work.uniform_imbalance); natural: the run's own router
BALANCES = ("forced", "random", "natural")
_MODEL_KEYS = {"model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size"}
_TRAIN_KEYS = {"seq_len", "micro_batch_size", "global_batch_size"}
_PARALLEL_KEYS = {"tp", "pp", "ep", "cp", "virtual_stages", "sequence_parallel", "recompute",
                  "embedding_and_loss_as_layers"}
_PUBLISHED_KEYS = {"name", "gpu", "gpus", "figure", "unit", "balance", "source", "mechanisms"}


@dataclass(frozen=True)
class Published:
    """A published figure and how the run that produced it was set up."""

    name: str
    gpu: str
    gpus: int
    figure: float
    unit: str  # UNITS
    balance: str  # BALANCES
    source: str
    mechanisms: Mechanisms = field(default_factory=Mechanisms)
    config: str = ""  # trainer config (for the trainer's own architectures)
    overrides: tuple = ()  # --set overrides of that config
    assumptions: str = ""


def is_published_file(path: str) -> bool:
    """Whether a YAML file is a published-run file (it has a `published` section)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "published" in data


def _section(data: dict, name: str, keys: set, path: str) -> dict:
    sec = data.get(name)
    if not isinstance(sec, dict):
        raise PlanError(f"{path}: section `{name}` is missing or not a mapping.")
    unknown = sorted(set(sec) - keys)
    if unknown:
        raise PlanError(f"{path}: unknown key {name}.{unknown[0]} (valid: {', '.join(sorted(keys))}).")
    return sec


def load_published(path: str) -> tuple[Published, Setup]:
    """A published-run file as its figure and the setup the time model reads."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PlanError(f"{path} is not a readable YAML file ({type(e).__name__}).") from None
    pub = _section(data, "published", _PUBLISHED_KEYS, path)
    mod = _section(data, "model", _MODEL_KEYS, path)
    tr = _section(data, "train", _TRAIN_KEYS, path)
    par = _section(data, "parallel", _PARALLEL_KEYS, path)
    if mod.get("model_type") not in ("qwen3_moe", "mixtral"):
        raise PlanError(f"{path}: model.model_type must be qwen3_moe or mixtral, got {mod.get('model_type')!r}.")
    if pub.get("balance", "natural") not in BALANCES:
        raise PlanError(f"{path}: published.balance must be one of {', '.join(BALANCES)}, got {pub.get('balance')!r}.")
    if pub.get("unit") not in UNITS:
        raise PlanError(f"{path}: published.unit must be one of {', '.join(UNITS)}, got {pub.get('unit')!r}.")
    try:
        mech = Mechanisms(**pub.get("mechanisms", {}))
        published = Published(name=pub["name"], gpu=pub["gpu"], gpus=int(pub["gpus"]), figure=float(pub["figure"]),
                              unit=pub["unit"], balance=pub.get("balance", "natural"), source=pub["source"],
                              mechanisms=mech, config=path)
        setup = _gqa_moe_setup(mod, tr, par, published.gpus, Path(path).stem)
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{path}: a required field is missing or malformed ({e}).") from None
    return published, setup


def _gqa_moe_setup(mod: dict, tr: dict, par: dict, gpus: int, name: str) -> Setup:
    """Attention counted as Llama's GQA, the FFN as DeepSeekMoE's without shared experts."""
    common = dict(vocab_size=mod["vocab_size"], hidden_size=mod["hidden_size"],
                  num_hidden_layers=mod["num_hidden_layers"], num_attention_heads=mod["num_attention_heads"],
                  num_key_value_heads=mod["num_key_value_heads"], head_dim=mod["head_dim"],
                  num_nextn_predict_layers=0)
    attn = ModelConfig(arch="llama3", intermediate_size=1, **common)
    ffn = ModelConfig(arch="deepseek_v3", first_k_dense_replace=0, n_routed_experts=mod["num_experts"],
                      num_experts_per_tok=mod["num_experts_per_tok"], n_shared_experts=0,
                      moe_intermediate_size=mod["moe_intermediate_size"], n_group=1, topk_group=1, **common)
    tp, pp, cp, ep, v = (int(par[k]) for k in ("tp", "pp", "cp", "ep", "virtual_stages"))
    if gpus % (tp * pp * cp):
        raise PlanError(f"published.gpus ({gpus}) must be a multiple of tp x pp x cp ({tp * pp * cp}).")
    dp = gpus // (tp * pp * cp)
    if (tp * dp * cp) % ep or mod["num_experts"] % ep:
        raise PlanError(f"ep ({ep}) must divide tp x dp x cp ({tp * dp * cp}) and the experts ({mod['num_experts']}).")
    mbs, gbs = int(tr["micro_batch_size"]), int(tr["global_batch_size"])
    if gbs % (mbs * dp):
        raise PlanError(f"train.global_batch_size ({gbs}) must be a multiple of micro_batch_size x dp ({mbs * dp}).")
    chunks = (_layers_with_embedding_and_loss(mod["num_hidden_layers"], pp * v)
              if par.get("embedding_and_loss_as_layers") else balanced_partition(mod["num_hidden_layers"], pp * v))
    partition = tuple(sum(chunks[c] for c in range(r, pp * v, pp)) for r in range(pp))
    return Setup(name=name, attn=attn, ffn=ffn, gpus=gpus, tp=tp, cp=cp, pp=pp, virtual_stages=v, ep=ep, dp=dp,
                 micro_batches=gbs // (mbs * dp), micro_batch_size=mbs, seq_len=int(tr["seq_len"]),
                 recompute=par.get("recompute", "none"), sequence_parallel=bool(par.get("sequence_parallel", True)),
                 zero=1, dedup_dispatch=False, gpus_per_node=8, partition=partition, moe_order=True)


def _layers_with_embedding_and_loss(n_layers: int, chunks: int) -> list[int]:
    """Decoder layers per pipeline chunk as Megatron splits them with account_for_embedding_in_pipeline_split
    and account_for_loss_in_pipeline_split: the embedding and the loss count as one layer each, the
    n + 2 spread evenly (Megatron requires it to divide), the first chunk's embedding and the last's
    loss taking a decoder layer's place (Qwen3-235B at PP 8 x v 4: 2, 3 x 30, 2; at PP 32 x v 3: 0,
    1 x 94, 0)."""
    if (n_layers + 2) % chunks:
        raise PlanError(f"embedding_and_loss_as_layers: the {n_layers} layers plus embedding and loss must split "
                        f"evenly over pp x virtual_stages ({chunks}) chunks.")
    sizes = [(n_layers + 2) // chunks] * chunks
    sizes[0] -= 1
    sizes[-1] -= 1
    return sizes


# ----------------------------------------------------------------------------- the calibration runs

CALIBRATION = (
    Published(
        name="Llama 3 405B, 8K (The Llama 3 Herd of Models, arXiv:2407.21783, Table 4)", gpu="h100", gpus=16384,
        figure=400.0, unit="tflops_per_gpu", balance="forced",
        source="arXiv:2407.21783 sec. 3.3.2, Table 4: 16,384 H100, TP 8, CP 1, PP 16, DP 128, 400 TFLOPs/GPU",
        mechanisms=Mechanisms(tp_overlap=False, dp_overlap=True, p2p_overlap=True, dp_reduce_scatter=True,
                              fused_glue=True, host="fused", grad_accum_fusion=True),
        config="configs/llama3_405b.yaml", overrides=("parallel.virtual_stages=2",),
        assumptions="interleaved 1F1B with v = 2 chunks per rank (the paper uses an interleaved schedule and "
                    "does not give v; 126 layers on 32 chunks); data-parallel reduction overlapped with the "
                    "backward and pipeline sends asynchronous (sec. 3.3.2); TP collectives exposed; fused "
                    "kernels launched at launch_us and fp32 accumulation inside the GEMMs (not stated: assumed)"),
    Published(
        name="DeepSeek-V3 671B (DeepSeek-V3 technical report, arXiv:2412.19437)", gpu="h800", gpus=2048,
        figure=180e3, unit="gpu_hours_per_trillion_tokens", balance="natural",
        source="arXiv:2412.19437 sec. 1 and 3: 180K H800 GPU hours per trillion tokens; 2,048 H800, PP 16, "
               "EP 64 over 8 nodes, ZeRO-1 DP, DualPipe, FP8 GEMMs, 20 of 132 SMs for communication",
        mechanisms=Mechanisms(a2a_overlap=True, dp_overlap=True, p2p_overlap=True, schedule="dualpipe",
                              comm_sm_share=20 / 132, fused_glue=True, gemm_dtype="fp8", node_dedup=True,
                              fp8_dispatch=True, host="fused", grad_accum_fusion=True),
        config="configs/deepseek_v3_671b.yaml", overrides=("parallel.recompute=none",),
        assumptions="DualPipe: all-to-all and pipeline sends hidden behind the paired micro-batch's compute, "
                    "dispatch over IB once per target node (at most 4) in FP8, combine in BF16, rank r holding stages r "
                    "and p-1-r, bubble (p/2 - 1)(F&B + B - 3W) with W = B/2, compute slowed by the 20 SMs given to "
                    "communication; FP8 GEMMs with their quantisation passes, BF16 attention; recomputation of RMSNorm and the MLA "
                    "up-projections only (counted as none); load imbalance of uniform routing (the bias "
                    "balances the expected load); 120 micro-batches per step (15,360 sequences of 4K); its "
                    "own fused kernels launched at launch_us, a tokens-per-expert read per MoE block"),
)


# this trainer on one H200 (docs/BENCHMARKS.md, First GPU run, 2026-12-04: scripts/gpu_check.sh --quick, median
# of steps 5-12): the same config eager and compiled
MEASURED = (
    Published(
        name="moe_1b_gpu eager (this trainer, one H200, docs/BENCHMARKS.md First GPU run)", gpu="h200", gpus=1,
        figure=15890.0, unit="tokens_per_s_per_gpu", balance="forced",
        source="scripts/gpu_check.sh on one H200, 2026-12-04: 15,890 tokens/s, 4.127 s per step",
        mechanisms=Mechanisms(host="eager"), config="configs/moe_1b_gpu.yaml", overrides=("train.compile=false",),
        assumptions="this trainer's eager path: the kernel proxy's eager kernel counts at host_eager_us each "
                    "(measured on configs/moe_bench.yaml on the same H200), BF16_Optimizer's fp32 accumulation"),
    Published(
        name="moe_1b_gpu compiled (this trainer, one H200, docs/BENCHMARKS.md First GPU run)", gpu="h200", gpus=1,
        figure=31537.0, unit="tokens_per_s_per_gpu", balance="forced",
        source="scripts/gpu_check.sh on one H200, 2026-12-04: 31,537 tokens/s, 2.078 s per step",
        mechanisms=Mechanisms(host="compiled", fused_glue=True), config="configs/moe_1b_gpu.yaml",
        overrides=("train.compile=true",),
        assumptions="train.compile: inductor's kernel counts and glue bytes (kernel proxy --compiled) at "
                    "launch_us per kernel; BF16_Optimizer's hooks stay eager"),
)


# Megatron's EP overlap measured on and off on one layout (Megatron-LM PR #6429, 2026-08-11, the main-branch
# counterpart of dev PR #6311, merged: "Recompute EP A2A overlap activations per layer", table "B vs C"):
# DeepSeek-V3's shape at 14 layers with its 256-expert MoE and MTP 1 on 64 H100 (8 nodes), TP 1 / PP 4 / EP 16,
# layout Ett|(tt|)*6mL (v = 2), alltoall dispatcher, seq 2048, MBS 1, GBS 256 (16 micro-batches), BF16, full
# recompute, one layer per segment; median TFLOP/s per GPU of 30 iterations, the first 5 dropped
OVERLAP_SOURCE = "Megatron-LM PR #6429 (main counterpart of the merged dev PR #6311), arms B and C, 64 H100"
_OVERLAP_RUN = dict(
    gpu="h100", gpus=64, unit="tflops_per_gpu", balance="random", config="configs/deepseek_v3_671b.yaml",
    overrides=("model.num_hidden_layers=14", "train.seq_len=2048", "train.global_batch_size=256", "parallel.pp=4",
               "parallel.virtual_stages=2", "parallel.ep=16", "parallel.recompute=full",
               "parallel.dedup_dispatch=false"),
    assumptions="the PR's layout and settings; not stated, assumed: DeepSeek-V3's first 3 layers dense, "
                "Megatron's random-logit balance (uniform routing), the benchmark runtime's overlapped "
                "gradient reduce and parameter gather, TE's fused kernels at host_megatron_us, and no SMs held "
                "back for NCCL's all-to-all (each (token, expert) copy sent: no node dedup); the trainer's "
                "balanced partition (4, 4, 3, 3 layers per rank, MTP last) for Megatron's 2-layer chunks")
OVERLAP_CHECK = (
    Published(name="DeepSeek-V3 proxy, EP overlap off (Megatron-LM PR #6429, 64 H100, full recompute)",
              figure=185.2, source=f"{OVERLAP_SOURCE}: arm C, overlap off, 185.2 TFLOP/s per GPU",
              mechanisms=Mechanisms(dp_overlap=True, p2p_overlap=True, dp_reduce_scatter=True, fused_glue=True,
                                    host="megatron", grad_accum_fusion=True), **_OVERLAP_RUN),
    Published(name="DeepSeek-V3 proxy, EP overlap on (Megatron-LM PR #6429, 64 H100, full recompute)",
              figure=199.5, source=f"{OVERLAP_SOURCE}: arm B, overlap on, 199.5 TFLOP/s per GPU",
              mechanisms=Mechanisms(a2a_overlap=True, dp_overlap=True, p2p_overlap=True, dp_reduce_scatter=True,
                                    fused_glue=True, host="megatron", grad_accum_fusion=True, a2a_hiding="megatron"),
              **_OVERLAP_RUN),
)


# Qwen3-235B-A22B at other layouts and settings, as NVIDIA's Megatron-MoE-ModelZoo measured it on 256 H100
# (best_practice/qwen3/readme.md): checks of the model, not fitted; the file headers give each row's source
MODELZOO = tuple(f"published/qwen3_235b_modelzoo_{k}.yaml" for k in ("ep32", "ep32_overlap", "a2a_pp32", "tp4"))


# the same layout without recomputation, overlap off, in the dev PR's own table (Megatron-LM PR #6311: 225.1
# TFLOP/s per GPU; its full-recompute arms, 184.2 off and 198.5 on at CUDA_DEVICE_MAX_CONNECTIONS 32, repeat
# #6429's within 1%): what the full recomputation costs
NO_RECOMPUTE_CHECK = dataclasses.replace(
    OVERLAP_CHECK[0], name="DeepSeek-V3 proxy, no recompute, EP overlap off (Megatron-LM PR #6311, 64 H100)",
    figure=225.1, source="Megatron-LM PR #6311 (dev, merged): 'no overlap, no recompute', 225.1 TFLOP/s per GPU",
    overrides=tuple(o.replace("parallel.recompute=full", "parallel.recompute=none") for o in OVERLAP_CHECK[0].overrides))


def calibration_setups(root: Path, measured: bool = True) -> list[tuple[Published, Setup]]:
    """The four published runs and their setups: the two trainer configs above with their overrides,
    the two published-run files; a cross-check (Qwen3-30B-A3B: the fine-grained MoE layer inside one
    node, no pipeline); Qwen3-235B at the ModelZoo's layouts (MODELZOO); Megatron's EP overlap off and
    on (OVERLAP_CHECK) and that layout without recomputation; then (`measured`) this trainer's own runs
    on a GPU."""
    from ..resolve import load_config
    from .work import setup_from_config
    out = []
    for pub in CALIBRATION:
        cfg = load_config(str(root / pub.config), list(pub.overrides))
        out.append((pub, setup_from_config(cfg, pub.gpus, name=Path(pub.config).stem)))
    # the cross-check sits in configs/published/ (the README's config table lists configs/*.yaml)
    for name in ("qwen3_235b_a22b.yaml", "mixtral_8x22b.yaml", "published/qwen3_30b_a3b.yaml", *MODELZOO):
        pub, setup = load_published(str(root / "configs" / name))
        pub = dataclasses.replace(pub, config=f"configs/{name}")
        out.append((pub, setup))
        again = remeasured(pub, name)
        if again is not None:
            out.append((again, setup))
    for pub in (NO_RECOMPUTE_CHECK, *OVERLAP_CHECK, *(MEASURED if measured else ())):
        cfg = load_config(str(root / pub.config), list(pub.overrides))
        out.append((pub, setup_from_config(cfg, pub.gpus, name=Path(pub.config).stem)))
    return out


# Figures NVIDIA re-measured for the same recipes: Megatron-LM PR #5728 ("docs: refresh Qwen3 MoE recipe
# performance", commit 7146484607, 2026-07-09, open on the dev branch; measured with the matching Megatron
# Bridge recipes, NVIDIA-NeMo/Megatron-Bridge#4469, "the same GPU count, parallelism, batch sizes, sequence
# length, precision, and CUDA graph mode as its linked recipe", median of iterations 30-45).
REMEASURED = {
    "qwen3_235b_a22b.yaml": (302.0, "Megatron-LM PR #5728 (commit 7146484607): the H100 BF16 recipe re-measured, "
                                    "214.3 -> 302.0 TFLOP/s per GPU"),
    "published/qwen3_30b_a3b.yaml": (240.5, "Megatron-LM PR #5728 (commit 7146484607): the H100 BF16 recipe "
                                            "re-measured, 234.1 -> 240.5 TFLOP/s per GPU"),
}


def remeasured(pub: Published, name: str) -> Optional[Published]:
    """The same run at NVIDIA's re-measured figure, if there is one (REMEASURED)."""
    if name not in REMEASURED:
        return None
    figure, source = REMEASURED[name]
    return dataclasses.replace(pub, name=f"{pub.name.split(' (')[0]} re-measured (Megatron-LM PR #5728, same recipe)",
                               figure=figure, source=source)


# One MoE layer alone on H100 (router, dispatch, grouped-GEMM experts, combine; forward + backward), as
# Megatron-LM's own layer benchmark times it: tests/functional_tests/test_cases/common/moe_perf/
# (test_cases.py: the proxies, gpu_platform H100; baseline.json: forward_ms and backward_ms, the mean of 20
# measured iterations after 5 warm-up ones; tests/test_utils/recipes/module_performance.yaml: one dgx_h100
# node; commit cf39a4ddcf "Add moe layer perf UT" #2673). EP 8 inside one node,
# TP 1, 4096 tokens per rank, forced balance, HybridEP, moe_permute_fusion and moe_router_fusion, TE
# grouped GEMM, BF16; nothing overlapped (one layer, one stream). name: (model, measured forward + backward ms).
MOE_LAYER_CHECKS = {
    "Mixtral proxy (8 experts, top-2, h 4096, ffn 14336)":
        (dict(hidden_size=4096, moe_intermediate_size=14336, num_experts=8, num_experts_per_tok=2), 4.343 + 7.741),
    "DeepSeek proxy (32 experts, top-8, h 7168, ffn 2048, 1 shared)":
        (dict(hidden_size=7168, moe_intermediate_size=2048, num_experts=32, num_experts_per_tok=8,
              n_shared_experts=1), 5.391 + 8.795),
}
MOE_LAYER_SOURCE = ("NVIDIA/Megatron-LM tests/functional_tests/test_cases/common/moe_perf/baseline.json, cases "
                    "mixtral_hybridep_tp1ep8_bf16 and deepseek_hybridep_tp1ep8_bf16 (H100)")
# Megatron's fused MoE layer as the published recipes run it
MEGATRON_TE = Mechanisms(fused_glue=True, host="megatron", grad_accum_fusion=True, node_dedup=True)


def moe_layer_setup(name: str, ep: int = 8, tokens: int = 4096) -> Setup:
    """One MoE layer of MOE_LAYER_CHECKS[name] on `ep` GPUs of one node, `tokens` per rank."""
    shape = dict(MOE_LAYER_CHECKS[name][0])
    shared = shape.pop("n_shared_experts", 0)
    mod = dict(vocab_size=32000, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
               **shape)
    s = _gqa_moe_setup(mod, {"seq_len": tokens, "micro_batch_size": 1, "global_batch_size": ep},
                       {"tp": 1, "pp": 1, "cp": 1, "ep": ep, "virtual_stages": 1, "sequence_parallel": False}, ep,
                       "moe_layer")
    return dataclasses.replace(s, ffn=dataclasses.replace(s.ffn, n_shared_experts=shared))


def moe_layer_rows() -> list[tuple[str, float, dict]]:
    """(name, measured ms, the model's seconds by part) for each MOE_LAYER_CHECKS layer on an H100."""
    from .gpus import Efficiency, gpu_named
    from .time import moe_layer_seconds
    return [(name, measured, moe_layer_seconds(moe_layer_setup(name), gpu_named("h100"), Efficiency(), MEGATRON_TE))
            for name, (_shape, measured) in MOE_LAYER_CHECKS.items()]


def imbalance_of(pub: Published):
    """The load imbalance a run's figure was measured under: 1.0 for forced balance, else None (uniform
    routing's statistical maximum: Megatron's random-logit balance is exactly that, a natural router's
    a lower bound)."""
    return 1.0 if pub.balance == "forced" else None


def estimate_in_unit(unit: str, tokens_per_s_per_gpu: float, tflops: float, mfu: float) -> float:
    """The estimate in the published figure's unit."""
    if unit == "tflops_per_gpu":
        return tflops
    if unit == "mfu":
        return mfu
    if unit == "tokens_per_s_per_gpu":
        return tokens_per_s_per_gpu
    return 1e12 / tokens_per_s_per_gpu / 3600  # GPU hours per trillion tokens


def ratio(unit: str, estimate: float, figure: float) -> float:
    """Estimated over published speed (> 1: the model predicts faster than published)."""
    return figure / estimate if unit == "gpu_hours_per_trillion_tokens" else estimate / figure
