#!/usr/bin/env python
"""Plan a layout's memory per rank and communication per step before buying GPU time.

  python tools/plan.py --config configs/deepseek_v3_671b.yaml --gpus 2048
  python tools/plan.py --config configs/llama3_405b.yaml --set parallel.pp=8 --gpus 8192 --json
  python tools/plan.py zero --params 7.5e9 --dp 64
  python tools/plan.py --config configs/deepseek_v3_671b.yaml --gpus 2048 --time --gpu h800 [--overlap]
  python tools/plan.py --config configs/llama3_405b.yaml --gpus 16384 --search --gpu h100 --json PLAN.json
  python tools/plan.py calibrate    the four published runs, a cross-check and this trainer's H200 runs: estimate against figure

The logic lives in the moe_trainer/plan package; this file only parses arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moe_trainer import plan, profiling  # noqa: E402
from moe_trainer.config import ConfigError, read_config  # noqa: E402
from moe_trainer.plan import gpus as gpus_mod, published, search as search_mod, time as time_mod  # noqa: E402
from moe_trainer.plan import replacement, time_report  # noqa: E402
from moe_trainer.plan.work import setup_from_config  # noqa: E402
from moe_trainer.resolve import load_config  # noqa: E402

EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3

EPILOG = """\
subcommand:
  zero --params P --dp N [--k 12]   the ZeRO paper's table (Rajbhandari et al. 2019): memory
                                    per rank for stages 0-3 and traffic per step
                                    (see `tools/plan.py zero --help`)
  calibrate                         the step-time model against the four published runs
                                    (Llama 3 405B, DeepSeek-V3, Qwen3-235B-A22B, Mixtral 8x22B),
                                    the cross-check Qwen3-30B-A3B (Megatron's H100 recipe)
                                    and this trainer's moe_1b_gpu on one H200, eager and compiled;
                                    NVIDIA's re-measured Qwen3 figures; the same at host times per
                                    kernel from 9 to 72 us; one MoE layer against Megatron's own
                                    H100 layer benchmark

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
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT",
                   help="the plan (or --time's estimate, --search's best layout) as JSON: to OUT, or to stdout "
                        "without a path (instead of markdown)")
    t = p.add_argument_group("step time (--time) and layout search (--search)")
    t.add_argument("--time", action="store_true", help="estimate the step time on --gpu: compute, exposed "
                   "communication, bubble, optimizer; tokens/s, TFLOP/s and MFU per GPU")
    t.add_argument("--search", action="store_true", help="rank every legal, fitting layout of the config on "
                   "--gpus by estimated tokens/s per GPU and print the top ten")
    t.add_argument("--gpu", default="h100", help=f"one of {', '.join(gpus_mod.GPUS)} (default h100)")
    t.add_argument("--gemm-dtype", choices=("bf16", "fp8"), default=None,
                   help="GEMM precision (attention stays bf16); default bf16, or the published run's")
    t.add_argument("--overlap", action="store_true", help="model the all-to-all hidden behind the other "
                   "micro-batch's compute, as parallel.overlap=a2a runs it (pp 1, and pp > 1 under interleaved "
                   "1F1B): each transfer hides behind the one compute phase of the partner beside it; the "
                   "warm-up and cool-down chunks and the split-size exchanges stay exposed")
    t.add_argument("--load", metavar="RUN_DIR", help="natural load imbalance measured from a run's expert_load/")
    t.add_argument("--imbalance", type=float, help="natural load imbalance: the busiest EP rank's load / mean")
    t.add_argument("--profile", metavar="RUN_DIR", help="with --time: hold the estimate against the run's profiled "
                   "steps (its profile/, written with --set debug.profile_steps=[FIRST,LAST]), part by part")
    t.add_argument("--gpu-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a GPU figure, e.g. --gpu-set net_gbs=25 (keys: bf16_tflops, fp8_tflops, "
                        "hbm_tbs, nvlink_gbs, net_gbs, gpus_per_node)")
    t.add_argument("--eff-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an efficiency, e.g. --eff-set gemm=0.7 (see docs/PLANS.md)")
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


def _emit_json(target: str, data: dict) -> None:
    """JSON to stdout ('-') or written whole to a file (a temporary file renamed: never half-written)."""
    text = json.dumps(data, indent=1, default=str)
    if target == "-":
        print(text)
        return
    out = Path(target)
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(text + "\n")
        os.replace(tmp, out)
    except OSError as e:
        raise plan.PlanError(f"--json {target} cannot be written ({e.strerror}).") from None


def _gpu_eff(args):
    return gpus_mod.with_overrides(gpus_mod.gpu_named(args.gpu), gpus_mod.Efficiency(), args.gpu_set, args.eff_set)


def _measured(args):
    """--load's run, read (None without it); --load and --imbalance exclude each other."""
    if args.load and args.imbalance is not None:
        raise plan.PlanError("give --load RUN_DIR or --imbalance X, not both.")
    return replacement.read_load(args.load) if args.load else None


def _natural(args, setup, load) -> tuple[float | None, str]:
    """The natural load imbalance at the setup's ep: measured with the experts at home (`load`, --load), given
    (--imbalance), or None (uniform routing's statistical maximum)."""
    if load:
        return replacement.natural_imbalance(load, setup.ep), f"measured from {args.load}"
    if args.imbalance is not None:
        return args.imbalance, "--imbalance"
    return None, "uniform routing's statistical maximum, a lower bound"


def _run_time(args, argv) -> int:
    """--time: a trainer config (this trainer's mechanisms, --overlap) or a published-run file; with
    parallel.replace_every and --load, a third column: the run's load as re-placement leaves it."""
    every = redundant = 0
    profiles = _profiles(args.profile) if args.profile else None  # read before anything is printed
    if published.is_published_file(args.config):
        pub, setup = published.load_published(args.config)
        if args.gpus != pub.gpus:
            raise plan.PlanError(f"{args.config} describes a run on {pub.gpus} GPUs; give --gpus {pub.gpus}.")
        mech = pub.mechanisms
    else:
        cfg = load_config(args.config, args.set, read_init_from=True)
        setup = setup_from_config(cfg, args.gpus, args.zero, args.gpus_per_node)
        every, redundant = cfg.parallel.replace_every, cfg.parallel.redundant_slots
        # parallel.overlap a2a (or auto where a CUDA run stays eager: resolve.overlap_runs): the trainer pairs
        # micro-batches as --overlap models (pp 1, interleaved pp > 1)
        # (and then holds the experts' weight gradients back: Mechanisms.wgrad_split)
        mech = search_mod.layout_mechanisms(cfg, time_mod.Mechanisms(a2a_overlap=args.overlap))
    mech = time_mod.dataclasses.replace(mech, a2a_overlap=mech.a2a_overlap or args.overlap,
                                        gemm_dtype=args.gemm_dtype or mech.gemm_dtype)
    gpu, eff = _gpu_eff(args)
    load = _measured(args)
    balanced = time_mod.step_time(setup, gpu, eff, mech, 1.0)
    value, source = _natural(args, setup, load)
    natural = time_mod.step_time(setup, gpu, eff, mech, value) if setup.ep > 1 else None
    columns = [("forced balance", balanced)] + \
        ([(f"natural (imbalance {natural.imbalance:.3f}: {source})", natural)] if natural else [])
    replaced = None
    if every and load:
        f, rep, where = replacement.at_layout(load, setup.ep, every, redundant,
                                              replacement.paying(setup, gpu, eff, mech))
        replaced = (time_mod.step_time(setup, gpu, eff, mech, f, rep), rep, where)
        columns.append((f"re-placed (imbalance {f:.3f}: {where})", replaced[0]))
    if args.json:
        _emit_json(args.json, time_report.time_to_dict(setup, gpu, eff, mech, balanced, natural, replaced))
    if args.json != "-":
        print(f"## python tools/plan.py {' '.join(shlex.quote(a) for a in argv)}\n")
        print(time_report.format_time(setup, gpu, eff, mech, columns))
        if every and not load:
            print(f"parallel.replace_every is {every}: give --load RUN_DIR (a run's expert_load/) to estimate the "
                  f"busiest rank's share re-placement leaves and its moves' and copies' time.\n")
        if args.profile:  # the last column: the load as the run had it, where known
            print(time_report.format_profile_comparison(time_report.predicted_parts(columns[-1][1]), profiles,
                                                        args.profile))
    return 0


def _profiles(run_dir: str) -> dict:
    """The run's profile summaries (profiling.read_summaries), or one sentence."""
    if not Path(run_dir, "profile").is_dir():
        raise plan.PlanError(f"--profile {run_dir}: no profile/ directory there; run with --set "
                             f"debug.profile_steps=[FIRST,LAST] first.")
    try:
        return profiling.read_summaries(Path(run_dir))
    except (OSError, ValueError, KeyError) as e:
        raise plan.PlanError(f"--profile {run_dir}: a summary in profile/ cannot be read ({e}).") from None


def _run_search(args, argv) -> int:
    if published.is_published_file(args.config):
        raise plan.PlanError(f"--search takes a trainer config; {args.config} is a published-run file (an "
                             f"architecture the trainer does not build), which --time estimates.")
    # the overlap as requested (load_config resolves auto for the config's own layout only): the search
    # resolves it per layout, as the trainer would; --overlap models it at every layout (a what-if)
    requested = read_config(args.config, args.set).parallel.overlap
    try:
        cfg = load_config(args.config, args.set, read_init_from=True)
    except ConfigError:
        if requested != "a2a":
            raise
        # a2a where the config's own layout cannot run it: other layouts can
        cfg = load_config(args.config, args.set + ["parallel.overlap=none"], read_init_from=True)
    gpu, eff = _gpu_eff(args)
    mech = time_mod.Mechanisms(a2a_overlap=args.overlap, gemm_dtype=args.gemm_dtype or "bf16")
    load = _measured(args)
    value, _ = _natural(args, setup_from_config(cfg, args.gpus), load)
    best, tried, fit = search_mod.search(cfg, args.gpus, gpu, eff, mech, args.gpu_memory_gb, value,
                                         overlap=requested, load=load)
    if not tried:
        if requested == "a2a":
            raise plan.PlanError(f"no legal layout of {args.config} on {args.gpus} GPUs can run parallel.overlap=a2a "
                                 f"(it needs ep > 1, tp = cp = 1, and pp 1 or interleaved 1F1B, whose micro-batches "
                                 f"per step are a multiple of pp); set parallel.overlap=auto or none.")
        raise plan.PlanError(f"no layout of {args.config} on {args.gpus} GPUs is legal.")
    if not best:
        raise plan.PlanError(f"none of the {tried} legal layouts of {args.config} on {args.gpus} GPUs fits in "
                             f"--gpu-memory-gb {args.gpu_memory_gb:g}.")
    own_setup, own_mech = setup_from_config(cfg, args.gpus, gpus_per_node=args.gpus_per_node), \
        search_mod.layout_mechanisms(cfg, mech)
    own = time_mod.step_time(own_setup, gpu, eff, own_mech,
                             *search_mod.load_of(cfg, own_setup, gpu, eff, own_mech, value, load))
    if args.json:
        b = best[0]
        _emit_json(args.json, {"config": args.config, "gpus": args.gpus, "set": args.set + b.overrides(),
                               "label": b.label(), "tokens_per_s_per_gpu": b.time.tokens_per_s_per_gpu,
                               "step_s": b.time.step, "peak_gb": b.peak_gb, "gpu": args.gpu})
    if args.json != "-":
        rows = [[i + 1, c.label(), f"{c.time.tokens_per_s_per_gpu:,.0f}", f"{c.time.model_tflops_per_gpu:.0f}",
                 f"{c.time.step:.2f} s", f"{c.time.compute:.2f} / {c.time.exposed_comm:.2f} / {c.time.bubble:.2f}",
                 f"{c.peak_gb:.1f}", c.reason] for i, c in enumerate(best)]
        print(f"## python tools/plan.py {' '.join(shlex.quote(a) for a in argv)}\n")
        what = "" if cfg.model.arch != "deepseek_v3" else "; the all-to-all overlap " + (
            "modelled at every layout (--overlap: its time; the memory as the trainer holds the layout)"
            if args.overlap else f"where parallel.overlap={requested} runs it (\"a2a overlap\" in the layout)")
        print(f"{tried} legal layouts, {fit} fit in {args.gpu_memory_gb:g} GB{what}; the best's mechanisms: "
              f"{best[0].mechanisms.describe()}.\n")
        print("\n".join(plan.report._table(["#", "layout", "tokens/s per GPU", "TFLOP/s per GPU", "step",
                                              "compute / exposed comm / bubble", "peak GB", "why it beats the next"],
                                             rows)))
        node = args.gpus_per_node or cfg.parallel.gpus_per_node or gpu.gpus_per_node
        peak = search_mod.peak_memory(cfg, args.gpus, node, plan.stage_partition(cfg)) / plan.GB
        fits = "fits" if peak <= args.gpu_memory_gb else "does NOT fit"
        print(f"\nThe config's own layout: {own.tokens_per_s_per_gpu:,.0f} tokens/s per GPU (step {own.step:.2f} s: "
              f"compute {own.compute:.2f}, exposed comm {own.exposed_comm:.2f}, bubble {own.bubble:.2f}; heaviest "
              f"rank {peak:.1f} GB: it {fits} in {args.gpu_memory_gb:g} GB); the best is "
              f"{best[0].time.tokens_per_s_per_gpu / own.tokens_per_s_per_gpu:.2f}x it.")
    return 0


HOST_SWEEP_US = (9.0, 30.0, 41.0, 60.0, 72.0)  # launch_us's sourced 9, Megatron's 41, this trainer's eager 72


def _run_calibrate(argv: list[str]) -> int:
    """The four published runs and this trainer's measured GPU runs against their figures."""
    if argv:
        print("error: calibrate takes no arguments.", file=sys.stderr)
        return EXIT_BAD_INPUT
    runs = published.calibration_setups(ROOT)

    def rows_at(eff, host_us=None):
        """Each run's estimate; `host_us`: its framework's host time per kernel instead (host_megatron_us for
        the Megatron-Core runs, launch_us for the other fused and compiled ones)."""
        def eff_of(pub):
            if host_us is None:
                return eff
            key = "host_megatron_us" if pub.mechanisms.host == "megatron" else "launch_us"
            return dataclasses.replace(eff, **{key: host_us})
        return [(pub, time_mod.step_time(setup, gpus_mod.gpu_named(pub.gpu), eff_of(pub), pub.mechanisms,
                                         published.imbalance_of(pub))) for pub, setup in runs]
    eff = gpus_mod.Efficiency()
    rows = rows_at(eff)
    print(time_report.format_calibration(rows))
    off, on = ([t for p, t in rows if p is pub][0] for pub in published.OVERLAP_CHECK)
    measured = published.OVERLAP_CHECK[1].figure / published.OVERLAP_CHECK[0].figure
    print(f"Megatron's EP overlap on one layout ({published.OVERLAP_SOURCE}): on / off measured {measured:.3f}x, "
          f"estimated {on.model_tflops_per_gpu / off.model_tflops_per_gpu:.3f}x (docs/PLANS.md, \"Megatron's EP "
          "overlap, off and on\").\n")
    sweep = {us: rows_at(eff, us) for us in HOST_SWEEP_US}
    print("The same, the host's time per kernel of the run's framework swept (Megatron-Core's host_megatron_us, "
          f"measured by proxy at {eff.host_megatron_us:g} us; the other fused or compiled runs' launch_us, "
          f"{eff.launch_us:g} us): only the fine-grained MoE runs move (docs/PLANS.md, \"Why the fine-grained MoE "
          "runs read fast\"):\n")
    print(time_report.format_host_sweep(sweep))
    print(f"One MoE layer alone against Megatron-LM's own layer benchmark ({published.MOE_LAYER_SOURCE}):\n")
    print(time_report.format_moe_layer_checks(published.moe_layer_rows()))
    return 0


def _run_plan(argv: list[str]) -> int:
    args = _plan_parser().parse_args(argv)
    if args.time and args.search:
        raise plan.PlanError("give --time or --search, not both.")
    if args.profile and not args.time:
        raise plan.PlanError("--profile RUN_DIR holds a step-time estimate against a run's profile: give --time too.")
    if args.time:
        return _run_time(args, argv)
    if args.search:
        return _run_search(args, argv)
    cfg = load_config(args.config, args.set, read_init_from=True)  # a Hugging Face train.init_from: plan its model
    node = args.gpus_per_node or cfg.parallel.gpus_per_node or 8
    result = plan.make_plan(cfg, args.gpus, args.gpu_memory_gb, args.zero, args.precision, node,
                            plan.Links(args.nvlink_gbps, args.ib_gbps), sp_regather=args.sp_regather)
    if args.json:
        _emit_json(args.json, plan.plan_to_dict(result))
    if args.json != "-":
        print(plan.format_plan(result, "python tools/plan.py " + " ".join(shlex.quote(a) for a in argv)))
    if not result.fits:
        print(f"error: the plan does not fit: stage {result.peak_stage} needs {plan.fmt_bytes(result.peak_bytes)} "
              f"per rank, more than --gpu-memory-gb {args.gpu_memory_gb:g}.", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["calibrate"]:
            return _run_calibrate(argv[1:])
        return _run_zero(argv[1:]) if argv[:1] == ["zero"] else _run_plan(argv)
    except (ConfigError, plan.PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        sys.stdout = open(os.devnull, "w")
        return 1


if __name__ == "__main__":
    sys.exit(main())
