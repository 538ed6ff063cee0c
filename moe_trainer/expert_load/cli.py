"""The command line: `tools/expert_load.py RUN_DIR ...` (report) and `... plan ...` (placement)."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from .files import PLACEMENT_FILE, ExpertLoadError, ExpertLoadWarning, _atomic_write_bytes, _make_out_dir
from .plan import dump_plan, load_for_plan, make_plan
from .report import write_report

_ANALYZE_HELP = """Expert-load analysis of a moe_trainer run directory (works on a run in progress).

  expert_load.py RUN_DIR --out DIR [--step N]
      DIR/expert_load.md: per MoE layer, max/mean, coefficient of variation and share of
      experts below 10% of the mean load at the first, middle and last logged step and
      overall; DIR/expert_load_heatmap_step_<N>.png (load per expert per layer at step N,
      default the latest); DIR/expert_load_max_over_mean.png (max/mean per layer over steps).

  expert_load.py plan --load FILE --replicas R --groups G --nodes N --gpus P --out plan.json
      redundant-expert placement (the EPLB problem); see `expert_load.py plan --help`.
"""

_PLAN_HELP = """Plan a redundant-expert placement (the problem DeepSeek's EPLB solves).

R physical expert slots on P GPUs (R/P each; GPU g holds slots [g*R/P, (g+1)*R/P)), every
logical expert at least once; with G expert groups divisible by N nodes every group's
replicas stay on one node (P/N GPUs each). The plan starts from EPLB's greedy and improves
it; per layer it is never worse than EPLB. plan.json holds phy2log (R logical ids per
layer), max_over_mean (max GPU load / mean GPU load), eplb_max_over_mean, lower_bound and
gap_to_lower_bound per layer.

--apply RUN_DIR also writes the plan (atomically) to RUN_DIR/expert_placement.json: a run
with parallel.expert_placement=auto (the default) places its experts by it at its next start
or resume. Make the plan with --gpus = parallel.ep; delete the file (or set
parallel.expert_placement=none) to go back to one copy of each expert.
"""


def _analyze_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="expert_load.py", description=_ANALYZE_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="run directory (holds expert_load/step_<N>.safetensors)")
    ap.add_argument("--out", required=True, help="directory for expert_load.md and the PNG plots")
    ap.add_argument("--step", type=int, help="step shown in the heatmap (default: the latest logged)")
    args = ap.parse_args(argv)
    written = write_report(args.run_dir, args.out, args.step)
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


def _plan_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="expert_load.py plan", description=_PLAN_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", required=True,
                    help="safetensors file with a float tensor 'load' [layers, experts], or a run directory")
    ap.add_argument("--last", type=int, help="with a run directory: sum the newest K expert-load files "
                                             "(default: all)")
    ap.add_argument("--replicas", type=int, required=True, help="R physical expert slots (>= experts, "
                                                                "a multiple of --gpus)")
    ap.add_argument("--groups", type=int, default=1, help="G expert groups (model.n_group; default 1)")
    ap.add_argument("--nodes", type=int, default=1, help="N nodes (default 1)")
    ap.add_argument("--gpus", type=int, required=True, help="P GPUs holding experts (the EP size)")
    ap.add_argument("--out", help="plan JSON to write (required unless --apply is given)")
    ap.add_argument("--apply", metavar="RUN_DIR", help="also write RUN_DIR/expert_placement.json, which the run "
                                                       "places its experts by at its next start or resume")
    args = ap.parse_args(argv)
    if not args.out and not args.apply:
        raise ExpertLoadError("plan needs --out FILE, --apply RUN_DIR or both.")
    if args.apply and not Path(args.apply).is_dir():
        raise ExpertLoadError(f"--apply: run directory {args.apply} does not exist.")
    load, layer_ids = load_for_plan(args.load, args.last)
    plan = make_plan(load, args.replicas, args.groups, args.nodes, args.gpus, layer_ids)
    text = dump_plan(plan).encode()
    targets = [Path(args.out)] if args.out else []
    if args.apply:
        targets.append(Path(args.apply) / PLACEMENT_FILE)
    for out in targets:
        _make_out_dir(out.parent)
        _atomic_write_bytes(out, text)
    s = plan["summary"]
    print(f"wrote {', '.join(map(str, targets))}: {plan['layout']['policy']} placement of {load.shape[1]} experts "
          f"on {args.gpus} GPUs; mean max/mean {s['mean_max_over_mean']:.4f} (EPLB "
          f"{s['mean_eplb_max_over_mean']:.4f}, lower bound {s['mean_lower_bound']:.4f})")
    if args.apply:
        print(f"the run in {args.apply} places its experts by this plan at its next start or resume "
              f"(parallel.expert_placement=auto)")
    for i, layer in enumerate(plan["layer_ids"]):
        print(f"  layer {layer}: max/mean {plan['max_over_mean'][i]:.4f}  EPLB {plan['eplb_max_over_mean'][i]:.4f}"
              f"  lower bound {plan['lower_bound'][i]:.4f}")
    return 0


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status (1 with one sentence on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings():
        warnings.simplefilter("always", ExpertLoadWarning)
        warnings.showwarning = _show_warning
        try:
            if argv and argv[0] == "plan":
                return _plan_main(argv[1:])
            return _analyze_main(argv)
        except ExpertLoadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except OSError as e:  # e.g. an output path that cannot be written
            print(f"error: cannot access {e.filename or 'a file'} ({e.strerror or e}).", file=sys.stderr)
            return 1
