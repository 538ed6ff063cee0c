"""The figures the step-time model converts work into seconds with: each GPU's datasheet rates and
links, and the efficiencies kernels and collectives reach, every one with its public source.

Rates are dense (no 2:4 sparsity), per GPU. Link bandwidths are per GPU and per direction in GB/s
(1e9 bytes/s). NCCL's achievable bus bandwidth is the line rate times an efficiency (nccl-tests
report bus bandwidth, so the time of a collective is the bytes one rank sends / bus bandwidth).
Every figure can be overridden from the command line (`tools/plan.py --time --gpu-set key=value`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .params import PlanError


@dataclass(frozen=True)
class Gpu:
    """One accelerator and its links."""

    name: str
    bf16_tflops: float  # dense tensor-core peak
    fp8_tflops: float  # dense; 0 = no FP8 tensor cores
    hbm_tbs: float  # memory bandwidth, TB/s
    nvlink_gbs: float  # per GPU and direction, GB/s
    net_gbs: float  # scale-out network per GPU and direction, GB/s
    gpus_per_node: int
    source: str


# public datasheets (dense figures are half the "with sparsity" ones the datasheets print first)
GPUS = {
    "h100": Gpu("H100 SXM5 80GB", 989.4, 1978.9, 3.35, 450.0, 50.0, 8,
                "NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 1,979 / FP8 3,958 TFLOPS with sparsity, HBM3 "
                "3.35 TB/s, NVLink 900 GB/s both directions); DGX H100: 8 x 400 Gb/s ConnectX-7, one per GPU"),
    "h800": Gpu("H800 SXM5 80GB", 989.4, 1978.9, 3.35, 200.0, 50.0, 8,
                "H800: the H100's compute and HBM3 with NVLink cut to 400 GB/s both directions (DeepSeek-V3 "
                "technical report, arXiv:2412.19437, sec. 3.1: 'NVLink 160 GB/s achievable, IB 50 GB/s' per GPU)"),
    "h200": Gpu("H200 SXM 141GB", 989.4, 1978.9, 4.8, 450.0, 50.0, 8,
                "NVIDIA H200 datasheet (H100's tensor cores, HBM3e 4.8 TB/s, NVLink 900 GB/s); HGX H200 with one "
                "400 Gb/s NIC per GPU"),
    "b200": Gpu("B200 (HGX)", 2250.0, 4500.0, 8.0, 900.0, 50.0, 8,
                "NVIDIA DGX B200 datasheet (72 PFLOPS FP8 training per 8 GPUs with sparsity: 4.5 PF FP8, 2.25 PF "
                "BF16 dense per GPU; HBM3e 8 TB/s; NVLink 5 1.8 TB/s both directions; 8 x 400 Gb/s ConnectX-7)"),
    "a100": Gpu("A100 SXM4 80GB", 312.0, 0.0, 2.039, 300.0, 25.0, 8,
                "NVIDIA A100 datasheet (BF16 312 TFLOPS dense, HBM2e 2,039 GB/s, NVLink 3 600 GB/s both "
                "directions, no FP8); DGX A100: 8 x 200 Gb/s HDR, one per GPU"),
}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a peak that kernels and collectives sustain (one set for every run)."""

    gemm: float = 0.80  # dense GEMM at large shapes, of the tensor-core peak
    grouped: float = 0.90  # a grouped (per-expert) BF16 GEMM relative to a dense one of the same shape
    fp8_gemm: float = 0.51  # FP8 GEMM with fine-grained scaling at DeepSeek-V3's shapes, of the FP8 peak
    fp8_grouped: float = 0.50  # the same for the routed experts' grouped FP8 GEMMs (of the peak, not of fp8_gemm)
    attn_fwd: float = 0.60  # flash attention forward, of the BF16 peak
    attn_bwd: float = 0.45  # flash attention backward
    memory: float = 0.80  # memory-bound kernels, of the HBM bandwidth
    nvlink: float = 0.80  # NCCL ring collectives inside a node (bus bandwidth / line rate)
    net: float = 0.90  # NCCL ring collectives across nodes
    a2a: float = 0.80  # all-to-all (NVLink and network alike)
    glue_passes: float = 6.3  # bytes the elementwise glue moves per byte of stored activations (eager)
    fused_glue: float = 0.57  # a fused framework's (compiled / Megatron-TE) glue bytes per eager byte
    host_eager_us: float = 72.0  # this trainer's host time per launched kernel, eager (all host work included)
    launch_us: float = 9.0  # host time per kernel launched from compiled or fused code (no CUDA graph)
    # Megatron-Core's eager module path over TE's fused kernels: host time per fused kernel of a block
    # (plus TE's grouped GEMM's launch per further local expert at launch_us)
    host_megatron_us: float = 41.0
    graph_us: float = 40.0  # host time per call of a compiled graph (guards, wrapper): forward and backward
    sync_us: float = 15.0  # one device-to-host read of a small tensor: its copy and the stream drain's latency
    # an expert all-to-all's fixed time per call, whatever its bytes: every row transfer pays it, and so does
    # the dispatcher's split-size exchange (one per MoE block and forward pass, blocking in both executors);
    # 0 on the GPUs (not measured here), the emulated link's debug.link_latency_us on CPU ranks
    a2a_latency_us: float = 0.0
    # the share of the paired all-to-alls' ideal hiding (each transfer behind its partner's compute phase)
    # Megatron's combined 1F1B achieves, measured by its on / off pair (Mechanisms.a2a_hiding megatron)
    megatron_a2a_hidden: float = 0.36


EFFICIENCY_SOURCES = {
    "gemm": "maximum achievable matmul FLOPS, H100 SXM BF16 ~792 of 989 TFLOPS (80%), A100 268 of 312 (86%): "
            "S. Bekman, ml-engineering, compute/accelerator (mamf-finder); smaller shapes are held to their "
            "roofline (arithmetic intensity x HBM bandwidth) as well",
    "grouped": "grouped GEMM vs dense GEMM of the same total shape: DeepGEMM (deepseek-ai/DeepGEMM README) "
               "grouped contiguous-layout MoE GEMMs reach ~90% of its normal GEMMs' TFLOPS on H800",
    "fp8_gemm": "DeepGEMM's first README (deepseek-ai/DeepGEMM, 2025-02, H800): FP8 GEMMs with 1x128 / 128x128 "
                "scaling at DeepSeek-V3's six dense shapes with M = 4,096 tokens (q_a+kv_a 2112x7168, q_b 24576x1536, "
                "kv_b 32768x512, o 7168x16384, shared expert 4096x7168 and 7168x2048) at 775-1,520 TFLOPS, each "
                "1.2-1.4x faster than DeepSeek's 'internally and carefully optimized implementation based on "
                "CUTLASS 3.6', the kernels of V3's training; FLOP-weighted at those speeds: 1,006 TFLOPS, 51% of "
                "1,979 (DeepGEMM's own speeds give 66%; its best shape, 1,550 after 2025-04, 78%)",
    "fp8_grouped": "the same README's grouped contiguous-layout GEMMs at V3's training layout (4 experts x 8,192 "
                   "rows, 4096x7168 and 7168x2048): 1,346 and 1,214 TFLOPS, 1.3x DeepSeek's CUTLASS-3.6 kernels: "
                   "999 TFLOPS, 50% of 1,979 (DeepGEMM's own: 66%)",
    "attn_fwd": "FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) BF16 causal forward, head dim 128, "
                "8K-16K: ~600-660 TFLOPS of 989 on H100",
    "attn_bwd": "FlashAttention-3 backward, same setting: ~430-480 TFLOPS of 989",
    "memory": "STREAM-like copy kernels reach ~80-90% of HBM bandwidth on H100 (nvbandwidth / babelstream)",
    "nvlink": "nccl-tests all_reduce_perf on DGX H100 (8 GPUs, no NVLS): bus bandwidth ~360 GB/s of 450",
    "net": "nccl-tests across DGX H100 nodes over 8 x 400 Gb/s NDR: bus bandwidth ~45 GB/s of 50 per GPU",
    "a2a": "DeepEP (deepseek-ai/DeepEP README) on H800: intranode ~153-158 GB/s NVLink (of 200), internode "
           "~40-46 GB/s RDMA (of 50)",
    "glue_passes": "measured here: bench.kernel_proxy's bytes read + written outside the GEMMs per token of "
                   "one MoE layer, over the planner's stored activation bytes per token (6.0 at d 1024, 6.5 at "
                   "moe_1b_gpu); tests/test_plan_time.py re-measures it",
    "fused_glue": "measured here: kernel proxy --compiled moves 0.55-0.60x the glue bytes of eager "
                  "(docs/BENCHMARKS.md, issue #34)",
    "host_eager_us": "measured here: configs/moe_bench.yaml eager on one H200 (docs/BENCHMARKS.md, First GPU run), "
                     "a launch-bound run: 0.197 s per step over 4 micro-batches of 683 kernels each (the kernel "
                     "proxy's whole-model count, forward + backward, 563, and BF16_Optimizer's cast and add for "
                     "each of the 60 parameters): 72 us per kernel, everything the host does included (Python "
                     "model code, autograd, DeepSpeed's engine and hooks, views, the optimizer step); a bare "
                     "PyTorch op costs ~5-25 us of host time (dispatcher, autograd node, cudaLaunchKernel)",
    "launch_us": "inductor's per-kernel launch (CachingAutotuner.run): 6.8 us with no arguments, 9.1 us with 19, of "
                 "which cuLaunchKernel 3.0-3.3 us (meta-pytorch/tritonbench PR #1017, 2026-04, GB200); a fused "
                 "framework's launches counted alike; CUDA graphs replay a layer's kernels for one launch",
    "host_megatron_us": "measured here by proxy: bench/host_proxy (scripts/bench_host.sh, docs/BENCHMARKS.md, "
                        "issue #44): Megatron-Core 0.16.1's eager MoE layer forward + backward costs 0.74x this "
                        "trainer's on the host (0.69-0.75, seven runs on one CPU thread at tiny shapes), times "
                        "this trainer's layer on the H200 (72 us x 158 kernels, 11.4 ms; 11.7 ms step-matched), "
                        "less its router's and dispatcher's share (fused in the Qwen3 recipes, moe_router_fusion and "
                        "moe_permute_fusion): 5.7 ms per MoE layer over the planner's 139 fused kernels, 40.8-42.2 "
                        "us; TE's grouped GEMM launches a GEMM per further local expert (6 per layer, at launch_us)",
    "graph_us": "one call of an inductor-compiled graph end to end, guards and wrapper included: 33-44 us "
                "(meta-pytorch/tritonbench PR #1016/#1017); a compiled block runs two (forward, backward)",
    "sync_us": "an estimate, not a measurement: a small cudaMemcpy device-to-host plus the stream's drain, "
               "order 10-20 us; what the read costs is mostly the queue it drains, which the model counts "
               "apart (no run here moves by more than 0.4% between 0 and 30 us)",
    "megatron_a2a_hidden": "measured by Megatron's own on / off pair: Megatron-LM PR #6429 (the main-branch "
                           "counterpart of the merged dev PR #6311), DeepSeek-V3's shape at 14 layers on 64 H100, "
                           "TP 1 / PP 4 (v 2) / EP 16, alltoall dispatcher, full recompute: 185.2 TFLOP/s per GPU "
                           "without the EP overlap, 199.5 with (1.077x; 1.072x by mean iteration times). The model "
                           "costs the off arm at 0.96x and, hiding each transfer behind its partner's phase, the on "
                           "arm at 1.12x (1.25x the off arm's speed); hiding this share of that reproduces 1.077x "
                           "(0.34 by iteration times). Nothing else is fitted to it: applied to Qwen3-235B's recipe, "
                           "it reads 0.99x NVIDIA's re-measured 302.0 TFLOP/s, and 1.20x / 1.10x the same layout's "
                           "Megatron-MoE-ModelZoo runs without / with the overlap (245 / 276). A Megatron-Bridge "
                           "Nsight trace of the overlap (Qwen3-30B-A3B, EP 16 on 16 H100, HybridEP: "
                           "skills/nemo-mbridge-perf-expert-parallel-overlap) has 36.55% of the communication time "
                           "beside compute, at a layout where the phases could hide nearly all of it",
    "a2a_latency_us": "0 on the GPUs: no all-to-all latency measured here (a term the model carries: each row "
                      "transfer and each blocking split-size exchange pay it); on CPU ranks the emulated link's "
                      "debug.link_latency_us (bench.overlap --predict)",
}


def gpu_named(name: str) -> Gpu:
    key = name.lower()
    if key not in GPUS:
        raise PlanError(f"--gpu must be one of {', '.join(GPUS)}, got {name!r}.")
    return GPUS[key]


def _override(obj, settings: list[str], what: str):
    """`obj` with `key=value` settings applied (floats), or a PlanError naming the valid keys."""
    fields = {f.name for f in dataclasses.fields(obj) if f.type in ("float", "int", float, int)}
    changes = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise PlanError(f"{what} takes KEY=VALUE with KEY one of {', '.join(sorted(fields))}, got {item!r}.")
        try:
            changes[key] = type(getattr(obj, key))(float(value))
        except ValueError:
            raise PlanError(f"{what} {key} must be a number, got {value!r}.") from None
        if changes[key] < 0:
            raise PlanError(f"{what} {key} must not be negative, got {value}.")
    return dataclasses.replace(obj, **changes)


def with_overrides(gpu: Gpu, eff: Efficiency, gpu_set: list[str], eff_set: list[str]) -> tuple[Gpu, Efficiency]:
    """The GPU and efficiencies with `--gpu-set` / `--eff-set` KEY=VALUE overrides."""
    return _override(gpu, gpu_set, "--gpu-set"), _override(eff, eff_set, "--eff-set")


def gpu_table() -> list[list[str]]:
    """Rows for the docs: name, peaks, HBM, links, source."""
    return [[k, g.name, f"{g.bf16_tflops:g}", f"{g.fp8_tflops:g}" if g.fp8_tflops else "-", f"{g.hbm_tbs:g}",
             f"{g.nvlink_gbs:g}", f"{g.net_gbs:g}", g.source] for k, g in GPUS.items()]
