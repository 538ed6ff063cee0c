"""Memory and communication planner: numbers in, numbers out.

Pure functions over a `Config` or plain numbers, no torch and no process groups
(`tools/plan.py` is the command line). One module per concern: `params` (names,
shapes, counts, precision recipes), `pipeline` (stages, in-flight count, bubble),
`memory` (model states under ZeRO, activations, the ZeRO paper's table), `comm`
(bytes per collective), `layout` (`make_plan`: all of it for one config on N
GPUs) and `report` (markdown). Everything public is importable from here. The step-time model and
the layout search (`tools/plan.py --time`, `--search`) are `work` (what a rank computes and sends),
`time`, `gpus`, `published`, `search` and `time_report`, imported by module.

What it answers before GPU time is bought:

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
- the ZeRO paper's memory table (`zero_table`);
- where the traffic goes: bytes inside and across nodes per kind under the run's rank order, and
  the communication time at given NVLink and network speeds (`nodes`).

Units: parameter counts are plain numbers; memory and traffic are bytes (the
reports print GB = 1e9 bytes, as the ZeRO paper does). Traffic is what ONE rank
sends per optimizer step with ring collectives; what it receives is the same
(exactly for the ring collectives, in expectation for the all-to-all). For a
collective over g ranks on a tensor of N bytes (the full, unsharded size):
all-reduce sends 2(g-1)/g * N, reduce-scatter and all-gather (g-1)/g * N each.
The estimates ignore communication buffers, allocator fragmentation and CUDA
workspaces: leave headroom.
"""
from .comm import (AllToAllBytes, ZeroComm, alltoall_bytes, alltoall_bytes_exact, alltoall_bytes_expected,
                   context_parallel_bytes, expected_remote_ranks, pipeline_bytes, remote_copies, tensor_parallel_bytes,
                   tensor_parallel_extra_bytes, zero_comm)
from .layout import Plan, StageComm, StagePlan, make_plan, plan_to_dict
from .nodes import IB_GBPS, NVLINK_GBPS, Links, NodeTraffic, stage_node_traffic
from .memory import (FP32, CopyBytes, ModelStateBytes, RankParams, StageActivations, TokenActs, ZeroRow, copy_bytes,
                     layer_acts, model_state_bytes, rank_params, stage_activation_bytes, zero_table)
from .params import (GB, PARTS, PRECISIONS, ParamCount, ParamReport, PlanError, Precision, base_part, count_parameters,
                     expected_numel, is_moe_layer, layer_shapes, mtp_layers, numel, param_part, param_shapes,
                     precision_for, routed_fraction)
from .pipeline import balanced_partition, bubble_fraction, in_flight, stage_partition
from .report import fmt_bytes, fmt_count, format_plan, format_zero_table

__all__ = [
    "AllToAllBytes", "ZeroComm", "alltoall_bytes", "alltoall_bytes_exact", "alltoall_bytes_expected",
    "context_parallel_bytes", "expected_remote_ranks", "pipeline_bytes", "remote_copies", "tensor_parallel_bytes",
    "tensor_parallel_extra_bytes", "zero_comm",
    "Plan", "StageComm", "StagePlan", "make_plan", "plan_to_dict",
    "IB_GBPS", "NVLINK_GBPS", "Links", "NodeTraffic", "stage_node_traffic",
    "FP32", "CopyBytes", "copy_bytes", "ModelStateBytes", "RankParams", "StageActivations", "TokenActs", "ZeroRow",
    "layer_acts", "model_state_bytes", "rank_params", "stage_activation_bytes", "zero_table",
    "GB", "PARTS", "PRECISIONS", "ParamCount", "ParamReport", "PlanError", "Precision", "base_part",
    "count_parameters", "expected_numel", "is_moe_layer", "layer_shapes", "mtp_layers", "numel", "param_part",
    "param_shapes", "precision_for", "routed_fraction",
    "balanced_partition", "bubble_fraction", "in_flight", "stage_partition",
    "fmt_bytes", "fmt_count", "format_plan", "format_zero_table",
]
