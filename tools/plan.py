#!/usr/bin/env python
"""Plan a layout's memory per rank and communication per step before buying GPU time.

  python tools/plan.py --config configs/deepseek_v3_671b.yaml --gpus 2048
  python tools/plan.py --config configs/llama3_405b.yaml --set parallel.pp=8 --gpus 8192 --json
  python tools/plan.py zero --params 7.5e9 --dp 64

The logic lives in the moe_trainer/plan package; this file only parses arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moe_trainer import plan  # noqa: E402
from moe_trainer.config import ConfigError, load_config  # noqa: E402

EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3

EPILOG = """\
subcommand:
  zero --params P --dp N [--k 12]   the ZeRO paper's table (Rajbhandari et al. 2019): memory
                                    per rank for stages 0-3 and traffic per step
                                    (see `tools/plan.py zero --help`)

what the plan reports (markdown, or JSON with --json):
  parameters by part, total and activated per token; model states per rank for ZeRO 0-3 under
  the recipes (mixed: 2 + 2 + 12 bytes per parameter, mixed_fp32_grads: 2 + 4 + 12, fp32: 4 + 4 + 8,
  fp32_master: 4 + 4 + 12, bf16: 2 + 2 + 4); per
  pipeline stage the parameters, activations per micro-batch with and without recomputation, the
  1F1B in-flight count min(pp - stage, micro-batches) and whether it fits; bytes sent per rank per
  step by data parallel / ZeRO, expert all-to-all, pipeline, tensor and context parallel; the
  bubble (p-1)/(m+p-1). dp = gpus / (pp * tp * cp). Memory in GB = 1e9 bytes.

exit status: 0 the plan fits, 2 bad input (one sentence on stderr),
             3 the plan was printed but the heaviest rank does not fit in --gpu-memory-gb.
"""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one sentence on stderr, without the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see --help).\n")


def _plan_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tools/plan.py", description="Memory per rank and communication per step of a config "
                "and layout: parameter counts, ZeRO stages, activations, pipeline bubble, all-to-all volume.",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML run config (e.g. configs/deepseek_v3_671b.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set parallel.pp=8 (repeatable)")
    p.add_argument("--gpus", type=int, required=True, help="total GPUs (world size); dp = gpus / (pp * tp * cp)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU in GB = 1e9 bytes (default 80)")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage for the per-stage "
                   "memory and the data-parallel traffic (default 1; the table always shows 0-3)")
    p.add_argument("--precision", choices=tuple(plan.PRECISIONS), default=None,
                   help="bytes per parameter: mixed (2+2+12), mixed_fp32_grads (2+4+12), fp32 (4+4+8), "
                        "fp32_master (4+4+12), bf16 (2+2+4); default what the trainer holds: mixed_fp32_grads "
                        "for train.dtype bf16 (mixed with train.grad_accum_dtype bf16), fp32_master for fp32")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node for the rank order and the inside/across-node split (default: "
                        "parallel.gpus_per_node, else 8)")
    p.add_argument("--nvlink-gbps", type=float, default=plan.NVLINK_GBPS,
                   help="NVLink bandwidth per GPU and direction in Gb/s (default %(default)g: H100, 450 GB/s)")
    p.add_argument("--ib-gbps", type=float, default=plan.IB_GBPS,
                   help="network bandwidth per GPU and direction in Gb/s (default %(default)g: one NDR NIC per GPU)")
    p.add_argument("--sp-regather", action="store_true",
                   help="plan Megatron's sequence parallelism (Meta's Llama 3 training): a tensor-parallel region "
                        "keeps its input's 1/tp shard and all-gathers it again in the backward; default: what this "
                        "trainer does, keep the all-gathered input")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of markdown")
    return p


def _zero_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tools/plan.py zero", description="The ZeRO paper's memory table: per-rank bytes of "
                "parameters, gradients and optimizer state for stages 0-3 with mixed precision Adam "
                "(2 + 2 + K bytes per parameter), and traffic per step in multiples of the parameter count.")
    p.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7.5e9")
    p.add_argument("--dp", type=int, required=True, help="data-parallel ranks, e.g. 64")
    p.add_argument("--k", type=int, default=12, help="optimizer bytes per parameter (default 12: fp32 master, m, v)")
    return p


def _run_zero(argv: list[str]) -> int:
    args = _zero_parser().parse_args(argv)
    rows = plan.zero_table(args.params, args.dp, args.k)
    print(plan.format_zero_table(rows, args.params, args.dp, args.k))
    return 0


def _run_plan(argv: list[str]) -> int:
    args = _plan_parser().parse_args(argv)
    cfg = load_config(args.config, args.set, read_init_from=True)  # a Hugging Face train.init_from: plan its model
    node = args.gpus_per_node or cfg.parallel.gpus_per_node or 8
    result = plan.make_plan(cfg, args.gpus, args.gpu_memory_gb, args.zero, args.precision, node,
                            plan.Links(args.nvlink_gbps, args.ib_gbps), sp_regather=args.sp_regather)
    if args.json:
        print(json.dumps(plan.plan_to_dict(result), indent=1))
    else:
        print(plan.format_plan(result, "python tools/plan.py " + " ".join(shlex.quote(a) for a in argv)))
    if not result.fits:
        print(f"error: the plan does not fit: stage {result.peak_stage} needs {plan.fmt_bytes(result.peak_bytes)} "
              f"per rank, more than --gpu-memory-gb {args.gpu_memory_gb:g}.", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _run_zero(argv[1:]) if argv[:1] == ["zero"] else _run_plan(argv)
    except (ConfigError, plan.PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        sys.stdout = open(os.devnull, "w")
        return 1


if __name__ == "__main__":
    sys.exit(main())
