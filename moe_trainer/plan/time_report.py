"""The step-time estimate and the layout search as markdown and JSON, and the calibration table."""
from __future__ import annotations

import dataclasses
from typing import Optional

from .gpus import EFFICIENCY_SOURCES, Efficiency, Gpu
from .published import Published, estimate_in_unit, ratio
from .report import _table
from .time import TRAINER_OVERLAPS, Mechanisms, Replacement, StepTime
from .work import Setup

_COMM_LABELS = (("tensor", "tensor parallel"), ("context", "context parallel"), ("all_to_all", "expert all-to-all"),
                ("pipeline", "pipeline send/recv"), ("data_parallel", "ZeRO-1 reductions"),
                ("replacement", "expert re-placement"))


def _cell(r: StepTime, key: str) -> str:
    v = getattr(r, key) if hasattr(r, key) else r.split[key]
    return f"{v:.3f} s ({v / r.step:.1%})"


def format_time(s: Setup, gpu: Gpu, eff: Efficiency, mech: Mechanisms, columns: list[tuple[str, StepTime]]) -> str:
    """The step split and rates per column (forced balance first, then the natural load, then the load as
    re-placement leaves it), the communication table (whether this trainer overlaps each kind)."""
    balanced = columns[0][1]
    runs = [r for _, r in columns]

    def row(label: str, key: str) -> list[str]:
        return [label] + [_cell(r, key) for r in runs]
    rows = [row("compute", "compute")]
    rows += [row(f"exposed {label}", key) for key, label in _COMM_LABELS if any(r.totals[key] for r in runs)]
    rows += [row("pipeline bubble", "bubble"), row("optimizer step", "optimizer")]
    if any(r.host_wait for r in runs):
        rows.append(row("device waiting for the host's launches", "host_wait"))

    def rates(r: StepTime) -> list[str]:
        return [f"{r.step:.3f} s", f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.model_tflops_per_gpu:.1f}", f"{r.mfu:.1%}"]
    rate_names = ["step", "tokens/s per GPU", "model TFLOP/s per GPU", "MFU (of BF16 peak)"]
    comm = [[label, f"{balanced.totals[key]:.3f} s", f"{balanced.split[key]:.3f} s", TRAINER_OVERLAPS[label]]
            for key, label in _COMM_LABELS if balanced.totals[key]]
    kinds = {k.split(".", 1)[1]: v for k, v in balanced.totals.items() if k.startswith("compute.")}
    lines = [f"### Step time on {s.gpus} x {gpu.name} ({mech.describe()})", "",
             f"Layout: tp {s.tp} x cp {s.cp} x pp {s.pp} (v {s.virtual_stages}) x dp {s.dp}, ep {s.ep}; "
             f"{s.micro_batches} micro-batches of {s.micro_batch_size} x {s.seq_len} tokens per step; recompute "
             f"{s.recompute}; busiest stage {balanced.stage}.", "",
             *_table(["part of the step"] + [name for name, _ in columns], rows), "",
             *_table([""] + [name.split(" (")[0] for name, _ in columns],
                     [[name] + [rates(r)[i] for r in runs] for i, name in enumerate(rate_names)]), "",
             "Compute per step by kind: " + ", ".join(f"{k} {v:.3f} s" for k, v in kinds.items()) + ".", "",
             *(_table(["communication", "per step", "exposed", "overlapped by this trainer today?"], comm)
               if comm else []), "",
             f"Model FLOPs per token {balanced.flops_per_token / 1e9:.1f} GFLOP (3 x forward GEMMs of the activated "
             f"parameters + causal attention core, no recomputation; as Megatron-LM's num_floating_point_operations "
             f"and this trainer's metrics). Efficiencies: " + ", ".join(
                 f"{f.name} {getattr(eff, f.name):g}" for f in dataclasses.fields(eff)) + ".", ""]
    return "\n".join(lines)


def time_to_dict(s: Setup, gpu: Gpu, eff: Efficiency, mech: Mechanisms, balanced: StepTime,
                 natural: Optional[StepTime], replaced: Optional[tuple[StepTime, Replacement, str]] = None) -> dict:
    layout = {k: getattr(s, k) for k in ("name", "gpus", "tp", "cp", "pp", "virtual_stages", "ep", "dp",
                                          "micro_batches", "micro_batch_size", "seq_len", "recompute")}
    return {"layout": layout, "gpu": dataclasses.asdict(gpu), "efficiency": dataclasses.asdict(eff),
            "efficiency_sources": EFFICIENCY_SOURCES, "mechanisms": dataclasses.asdict(mech),
            "trainer_overlaps": TRAINER_OVERLAPS, "balanced": dataclasses.asdict(balanced),
            "natural": dataclasses.asdict(natural) if natural else None,
            "replaced": {**dataclasses.asdict(replaced[0]), "replacement": dataclasses.asdict(replaced[1]),
                         "source": replaced[2]} if replaced else None}


def format_calibration(rows: list[tuple[Published, StepTime]]) -> str:
    """Published figure, estimate and ratio for each run."""
    unit = {"tflops_per_gpu": "TFLOP/s per GPU", "mfu": "MFU", "gpu_hours_per_trillion_tokens":
            "GPU hours per trillion tokens", "tokens_per_s_per_gpu": "tokens/s per GPU"}
    body = []
    for pub, r in rows:
        est = estimate_in_unit(pub.unit, r.tokens_per_s_per_gpu, r.model_tflops_per_gpu, r.mfu)
        fmt = (lambda x: f"{x:.1%}") if pub.unit == "mfu" else (lambda x: f"{x:,.1f}")
        body.append([pub.name, f"{fmt(pub.figure)} {unit[pub.unit]}", fmt(est), f"{ratio(pub.unit, est, pub.figure):.2f}",
                     f"{r.step:.2f} s: compute {r.compute:.2f}, exposed comm {r.exposed_comm:.2f}, bubble "
                     f"{r.bubble:.2f}, optimizer {r.optimizer:.3f}, waiting for the host {r.host_wait:.2f}"])
    return "\n".join(_table(["run", "published (or measured)", "estimate", "estimate / published speed", "estimated step"],
                            body)) + "\n"


def format_moe_layer_checks(rows: list[tuple[str, float, dict]]) -> str:
    """One MoE layer alone: the model's seconds by part against Megatron-LM's measured layer time."""
    body = [[name, f"{measured:.2f} ms", f"{sum(parts.values()) * 1e3:.2f} ms",
             f"{measured / (sum(parts.values()) * 1e3):.2f}",
             ", ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items())] for name, measured, parts in rows]
    return "\n".join(_table(["MoE layer alone (H100, EP 8, 4096 tokens per rank)", "measured forward + backward",
                             "estimate", "estimate / measured speed", "estimate by part (ms)"], body)) + "\n"


def format_host_sweep(sweep: dict) -> str:
    """Estimate / published speed of each run (rows) at each host time per kernel (columns, us)."""
    names = [pub.name.split(" (")[0] for pub, _r in next(iter(sweep.values()))]
    cols = []
    for rows in sweep.values():
        cols.append([ratio(pub.unit, estimate_in_unit(pub.unit, r.tokens_per_s_per_gpu, r.model_tflops_per_gpu, r.mfu),
                           pub.figure) for pub, r in rows])
    body = [[name, *(f"{c[i]:.2f}" for c in cols)] for i, name in enumerate(names)]
    return "\n".join(_table(["run", *(f"{us:g} us" for us in sweep)], body)) + "\n"


def predicted_parts(r: StepTime) -> dict[str, float]:
    """The estimate's step in the kinds a profile measures (profiling.summarize), seconds per step. The device's
    wait on communication is the exposed part and the bubble (a pipeline rank waits inside its receives)."""
    t = r.totals
    return {"gemm": t["compute.gemm"] + t["compute.expert_gemm"], "attention": t["compute.attention"],
            "other": t["compute.glue"] + t["compute.grad_accum"] + r.optimizer,
            "communication": r.exposed_comm + r.bubble, "idle": r.host_wait, "wall": r.step}


def format_profile_comparison(want: dict[str, float], summaries: dict[str, dict], run_dir: str) -> str:
    """The estimate's split (`predicted_parts`) against a run's profiled steps (debug.profile_steps): the profiled
    rank whose device was busiest, its mean step, part by part, with the ratio measured / estimated."""
    if not summaries:
        return (f"{run_dir} has no profile/*.summary.json: run it with --set debug.profile_steps=[FIRST,LAST] "
                f"(and debug.profile_ranks) to hold its steps against this estimate.\n")
    name, busiest = max(summaries.items(), key=lambda kv: kv[1]["mean"].get("busy_s", 0.0))
    m = busiest["mean"]
    labels = [("gemm", "GEMMs (dense and experts)"), ("attention", "attention"),
              ("other", "the rest of the device's work (glue, accumulation, optimizer)"),
              ("communication", "communication (estimate: exposed + bubble; measured: collective kernels, "
                                "waits included)"),
              ("idle", "device idle (waiting for the host)"), ("wall", "step")]
    rows = []
    for key, label in labels:
        got = m.get(f"{key}_s", 0.0)
        rows.append([label, f"{want[key]:.3f} s", f"{got:.3f} s", f"{got / want[key]:.2f}" if want[key] else "-"])
    steps = [s["step"] for s in busiest["steps"]]
    return "\n".join([f"### Against the profile of {run_dir}: {name}, steps {steps[0]}-{steps[-1]} on the "
                      f"{busiest['device']} ({len(summaries)} rank(s) profiled, the busiest shown)", "",
                      *_table(["part of the step", "estimated", "measured", "measured / estimated"], rows), "",
                      f"{m.get('kernels', 0):.0f} kernels a step on the device (top-level operators on a CPU)"
                      + _longest(busiest.get("top", [])) + "."]) + "\n"


def _longest(top: list[dict], n: int = 8) -> str:
    """The profile's longest kernels, per step: name (kind) time x launches."""
    return "; the longest, per step: " + "; ".join(
        f"{t['name'][:80]} ({t['kind']}) {t['s_per_step'] * 1e3:.1f} ms x {t['per_step']:.0f}" for t in top[:n]) \
        if top else ""
