#!/usr/bin/env python
"""A dry run of a layout at any world size, in one process, on fake CUDA tensors under NCCL's rules.

  python tools/dry_run.py --config configs/moe_tiny.yaml --world 2 --gpus-per-node 2
  python tools/dry_run.py --config configs/moe_1b_16gpu.yaml --world 16 --gpus-per-node 8 --ranks all
  python tools/dry_run.py --config configs/deepseek_v3_671b.yaml --world 2048 --gpus-per-node 8 --ranks roles

For each chosen rank it builds the Trainer (model, parallelism, DeepSpeed's engine and ZeRO-1, the
pipeline executor), runs two steps of its loop, saves a checkpoint and reloads it, with every tensor
a fake CUDA tensor (shapes, dtypes and devices; no data) and torch's fake process group behind
NCCL's rules. The logic lives in moe_trainer/parallel/dryrun; this file only parses arguments.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EPILOG = """\
--ranks:
  all       every rank
  roles     one rank of each role (pipeline stage, so first/last and MoE or not; tp rank 0 or not),
            each standing for the ranks of its role (default)
  R1,R2,..  these ranks, and rank 0 (it writes the checkpoint's state.json that every reload reads)
Each rank binds its GPU (DeepSpeed's device_id), builds its groups by communicator splits, and runs
two steps of the Trainer's loop (replica check, logging, straggler naming, expert metrics and
evaluation at every step) and its checkpoint; the checkpoint is then reloaded.

it fails (exit 1, one sentence naming the rule, the rank and the call site) on: a tensor not on the
rank's CUDA device in a collective, functional collective or transfer; a group created or split by
some ranks only, differently or out of order; collective sequences that differ between the members
of a group, compared across the roles that share it; sends and receives that do not pair; batched
transfers without the rank's device current; a device mismatch, shape or alignment error inside an op.

report: per rank, the peak fake-CUDA bytes beside the planner's estimate for its stage
(tools/plan.py), the bytes it sends inside and across nodes (node = rank // --gpus-per-node), and
its collectives counted by group and op (the set-up, one training step, the checkpoint), its bound
device and group splits, and the EP split sizes drawn. --json OUT writes {"world", "gpus_per_node",
"groups": every group of the world by kind, "ranks": {"<rank>": {"peak_bytes", "plan_bytes",
"intra_node_bytes", "inter_node_bytes", ...}}} for the ranks that ran.

capacity: a rank whose peak is over --gpu-memory-gb (default 80, or the size of the first CUDA card
this torch can see) fails the run with one sentence: the rank, its peak beside the planner's estimate,
the call sites that held the most at the peak, and the settings (micro-batch, full recomputation,
pipeline stages) that the planner, scaled by the measured peak / plan, says would bring it under.

exit status: 0 every check passed, 1 a check failed (capacity included), 2 bad input.
"""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one sentence on stderr, without the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see --help).\n")


def parse_args(argv):
    p = _Parser(prog="tools/dry_run.py", description="Build, train two steps, save and reload any layout at any "
                "world size in one process, on fake CUDA tensors under NCCL's rules.", epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML run config (e.g. configs/moe_1b_8gpu.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="typed config override, e.g. --set parallel.pp=2 (repeatable)")
    p.add_argument("--world", type=int, required=True, help="world size (GPUs) to simulate")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node: rank r is on node r // G")
    p.add_argument("--ranks", default="roles", help="all | roles | R1,R2,... (default: roles)")
    p.add_argument("--micro-batches", default="auto", choices=("auto", "all"),
                   help="auto (default): a schedule of more than pp + 1 micro-batches (2 pp / 3 pp when "
                   "interleaved) is run twice, at those two counts, and its traffic and collective counts "
                   "extrapolated exactly (both are linear in the count; the peak is already reached); "
                   "all: run every micro-batch")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory per GPU in GB = 1e9 bytes; a rank that peaks above it fails the run (default: "
                   "the first CUDA card's size when torch sees one, else 80)")
    p.add_argument("--routing", default="skewed", choices=("skewed", "balanced"),
                   help="the EP split sizes (fake tensors carry no routing): skewed (default), a seeded skewed "
                   "routing with one EP rank receiving nothing; balanced, the planner's expectation")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT")
    p.add_argument("--from-plan", metavar="PLAN.json", help="the layout `tools/plan.py --search --json PLAN.json` "
                   "found best: its --set overrides come first, yours after them")
    args = p.parse_args(argv)
    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        p.error(f"--gpu-memory-gb must be positive, got {args.gpu_memory_gb:g}")
    return args


def card_gb() -> float:
    """The first CUDA card's memory in GB when this torch sees one (read before the dry run shims
    torch.cuda), else 80, the planner's default."""
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 1e9
    return 80.0


def quiet_deepspeed_memory_reports() -> None:
    """DeepSpeed's see_memory_usage prints four lines ("MA ... GB", "CPU Virtual Memory: ...") when
    forced, and BF16_Optimizer forces it at every build: 6 reports per rank. In a dry run they
    read the fake device's meter and this host's RAM, which say nothing about the layout (the
    report's peaks are the figures that count), so the dry run's process makes it a no-op: in
    deepspeed.runtime.utils for modules imported later, and in every deepspeed module that
    already imported it by name."""
    import deepspeed.runtime.utils as ds_utils
    original = ds_utils.see_memory_usage

    def silent(message, force=False):
        return None
    for module in [ds_utils] + [m for name, m in list(sys.modules.items()) if name.startswith("deepspeed.")]:
        if getattr(module, "see_memory_usage", None) is original:
            module.see_memory_usage = silent


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_plan:
        try:
            chosen = json.loads(Path(args.from_plan).read_text())
            layout, gpus = list(chosen["set"]), int(chosen["gpus"])
        except (OSError, ValueError, KeyError, TypeError):
            print(f"error: --from-plan {args.from_plan} is not a plan from `tools/plan.py --search --json`.",
                  file=sys.stderr)
            return 2
        if gpus != args.world:
            print(f"error: --from-plan {args.from_plan} is a layout for {gpus} GPUs; give --world {gpus}.",
                  file=sys.stderr)
            return 2
        args.overrides = layout + args.overrides
    limit_gb = args.gpu_memory_gb or card_gb()
    from moe_trainer.parallel.dryrun.capacity import capacity_line, verdict
    from moe_trainer.parallel.dryrun.runner import DryRunError, RuleError, Simulator, choose_ranks, format_report
    import deepspeed.runtime.bf16_optimizer  # noqa: F401  (imported now, so that its see_memory_usage goes quiet)
    quiet_deepspeed_memory_reports()
    try:
        sim = Simulator(args.config, args.overrides, args.world, args.gpus_per_node, args.micro_batches,
                        args.routing)
        ranks = choose_ranks(args.ranks, sim.layout, args.world)
    except DryRunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mode = args.ranks if args.ranks in ("all", "roles") else "list"
    try:
        run = sim.run(ranks, mode, progress=lambda rep: print(f"rank {rep.rank} done in {rep.seconds:.1f} s",
                                                               flush=True))
    except (RuleError, DryRunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(run))
    print(capacity_line(run, limit_gb, args.config, args.overrides))
    if args.json:
        Path(args.json).write_text(json.dumps(run.as_json(), indent=1))
    over = verdict(run, limit_gb, args.config, args.overrides)
    if over:
        print(f"error: {over}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
