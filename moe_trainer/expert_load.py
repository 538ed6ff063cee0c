"""Expert load of a run directory: the on-disk format, statistics, report and placement plan.

Format (written by the trainer through `write_expert_load`, read by the tool):
    <run_dir>/expert_load/step_<N:08d>.safetensors
        counts  float32 [moe_layers, n_routed_experts]: tokens routed to each
                global expert during the logging interval ending at step N,
                summed over all ranks;
        bias    float32, same shape, optional: the aux-loss-free balancing
                bias at step N;
        metadata {"step": "N", "layer_ids": "[global ids of the MoE layers]"}.
Files are written atomically (temp file + os.replace). A reader may still meet
a broken file (a run in progress on a shared file system, a crash, a copy cut
short): unreadable files are skipped with a warning, never fatal.

Command line (`tools/expert_load.py`, see `--help`):
    expert_load.py RUN_DIR --out DIR [--step N]     imbalance report + plots
    expert_load.py plan --load FILE|RUN_DIR --replicas R --groups G --nodes N
                   --gpus P --out plan.json          redundant-expert placement
                   [--apply RUN_DIR]                 ... also RUN_DIR/expert_placement.json,
                                                     which the run uses at its next start or resume

Why one module of ~620 lines: it is the whole contract of one directory, the format the trainer
writes and everything the tool does with it, read top to bottom in that order (format, stats,
report and plots, plan, command line); the placement solvers it calls live in moe/placement/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

EXPERT_LOAD_DIR = "expert_load"
PLACEMENT_FILE = "expert_placement.json"  # in a run directory: the plan parallel.expert_placement=auto uses
_FILE_RE = re.compile(r"^step_(\d+)\.safetensors$")


class ExpertLoadError(ValueError):
    """Bad input to the analysis: the message is one user-facing sentence."""


class ExpertLoadWarning(UserWarning):
    """A file that was skipped (unreadable or inconsistent)."""


# ---------------------------------------------------------------------------
# Statistics (pure; also used by the trainer for its per-step metrics)
# ---------------------------------------------------------------------------

def imbalance_stats(counts: Tensor) -> dict[str, Tensor]:
    """Per-layer imbalance of expert load.

    Args:
        counts: [..., E] tokens per expert (typically [layers, experts]).
    Returns:
        dict of [...] float64 tensors:
        max_over_mean: most loaded expert over the mean expert load (1 = balanced);
        cv: coefficient of variation, population std over mean;
        frac_below_10pct: share of experts with load strictly below 10% of the mean.
        A layer with no load counts as balanced (1, 0, 0).
    """
    c = counts.double()
    mean = c.mean(-1)
    empty = mean <= 0
    safe = torch.where(empty, torch.ones_like(mean), mean)
    return {
        "max_over_mean": torch.where(empty, torch.ones_like(mean), c.max(-1).values / safe),
        "cv": torch.where(empty, torch.zeros_like(mean), c.std(-1, correction=0) / safe),
        "frac_below_10pct": (c < 0.1 * mean.unsqueeze(-1)).double().mean(-1),
    }


STAT_NAMES = {
    "max_over_mean": "max/mean",
    "cv": "coefficient of variation",
    "frac_below_10pct": "share of experts below 10% of the mean load",
}


# ---------------------------------------------------------------------------
# The on-disk format
# ---------------------------------------------------------------------------

def expert_load_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / EXPERT_LOAD_DIR / f"step_{step:08d}.safetensors"


def write_expert_load(run_dir: str | os.PathLike, step: int, counts: Tensor, bias: Optional[Tensor] = None,
                      layer_ids: Optional[Sequence[int]] = None) -> Path:
    """Write one interval's expert load atomically; returns the file's path.

    Args:
        counts: [moe_layers, n_routed_experts] tokens per global expert, summed over ranks.
        bias: same shape, optional aux-loss-free balancing bias.
        layer_ids: global layer id of each MoE layer (default 0 .. moe_layers-1).
    """
    from safetensors.torch import save_file

    counts = counts.detach().to("cpu", torch.float32).contiguous()
    if counts.dim() != 2:
        raise ExpertLoadError(f"counts must have shape [moe_layers, n_routed_experts], got {list(counts.shape)}.")
    tensors = {"counts": counts}
    if bias is not None:
        bias = bias.detach().to("cpu", torch.float32).contiguous()
        if bias.shape != counts.shape:
            raise ExpertLoadError(f"bias must have the shape of counts {list(counts.shape)}, got {list(bias.shape)}.")
        tensors["bias"] = bias
    ids = list(range(counts.shape[0])) if layer_ids is None else [int(i) for i in layer_ids]
    if len(ids) != counts.shape[0]:
        raise ExpertLoadError(f"layer_ids has {len(ids)} entries but counts has {counts.shape[0]} MoE layers.")
    path = expert_load_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"step": str(int(step)), "layer_ids": json.dumps(ids)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@dataclass
class ExpertLoadRecord:
    step: int
    counts: Tensor  # [L, E] float32
    bias: Optional[Tensor]  # [L, E] float32 or None
    layer_ids: list[int]
    path: Path


def read_expert_load(path: str | os.PathLike) -> ExpertLoadRecord:
    """Read one file; raises ExpertLoadError (one sentence) if it is unreadable or malformed."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            if "counts" not in keys:
                raise ExpertLoadError(f"{path} has no tensor 'counts'.")
            counts = f.get_tensor("counts").float()
            bias = f.get_tensor("bias").float() if "bias" in keys else None
    except ExpertLoadError:
        raise
    except Exception as e:  # safetensors raises several types for truncated/corrupt files
        raise ExpertLoadError(f"{path} is unreadable ({type(e).__name__}: {str(e).strip()[:120]}).") from None
    if counts.dim() != 2:
        raise ExpertLoadError(f"{path}: counts has shape {list(counts.shape)}, expected [moe_layers, experts].")
    if bias is not None and bias.shape != counts.shape:
        raise ExpertLoadError(f"{path}: bias shape {list(bias.shape)} differs from counts {list(counts.shape)}.")
    match = _FILE_RE.match(path.name)
    try:
        step = int(meta["step"]) if "step" in meta else int(match.group(1))
        ids = json.loads(meta["layer_ids"]) if "layer_ids" in meta else range(counts.shape[0])
        layer_ids = [int(i) for i in ids]
    except (ValueError, TypeError, AttributeError):  # json.JSONDecodeError is a ValueError
        raise ExpertLoadError(f"{path} has malformed metadata {meta}.") from None
    if len(layer_ids) != counts.shape[0]:
        raise ExpertLoadError(f"{path}: {len(layer_ids)} layer_ids for {counts.shape[0]} MoE layers.")
    return ExpertLoadRecord(step, counts, bias, layer_ids, path)


def list_expert_load_files(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every expert-load file of a run, by step; errors if there are none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        raise ExpertLoadError(f"Run directory {run_dir} {what}.")
    d = run_dir / EXPERT_LOAD_DIR
    files = sorted((int(m.group(1)), p) for p in (d.iterdir() if d.is_dir() else [])
                   if (m := _FILE_RE.match(p.name)) and p.is_file())
    if not files:
        raise ExpertLoadError(f"{run_dir} has no expert-load files ({EXPERT_LOAD_DIR}/step_<N>.safetensors); "
                              f"is it a run directory of a MoE model that has logged at least once?")
    return files


def iter_expert_load(files: Sequence[tuple[int, Path]], skipped: Optional[list[str]] = None
                     ) -> Iterator[ExpertLoadRecord]:
    """Read files in step order, skipping unreadable ones and ones whose shape or layer ids
    differ from the newest readable file's (the current run's).

    Every skipped file emits an ExpertLoadWarning and, if given, appends its reason to `skipped`.
    """
    def skip(reason: str) -> None:
        warnings.warn(f"{reason.rstrip('.')}; skipped it.", ExpertLoadWarning, stacklevel=3)
        if skipped is not None:
            skipped.append(reason)

    newest, ref = len(files), None
    while ref is None and newest > 0:  # a run in progress may have a broken newest file
        newest -= 1
        try:
            ref = read_expert_load(files[newest][1])
        except ExpertLoadError as e:
            skip(str(e))
    if ref is None:
        return
    for _, path in files[:newest]:
        try:
            rec = read_expert_load(path)
        except ExpertLoadError as e:
            skip(str(e))
            continue
        if rec.counts.shape != ref.counts.shape or rec.layer_ids != ref.layer_ids:
            skip(f"{path}: shape {list(rec.counts.shape)} and layers {rec.layer_ids} differ from the newest "
                 f"file's {list(ref.counts.shape)} and {ref.layer_ids}.")
            continue
        yield rec
    yield ref


# ---------------------------------------------------------------------------
# Analysis of a run
# ---------------------------------------------------------------------------

@dataclass
class RunAnalysis:
    run_dir: Path
    steps: list[int]  # logged steps whose files were readable, ascending
    layer_ids: list[int]
    num_experts: int
    stats: dict[str, Tensor]  # name -> [T, L] per logged interval
    total: Tensor  # [L, E] counts summed over all readable intervals
    chosen: ExpertLoadRecord  # the step shown in the heatmap
    at: dict[int, ExpertLoadRecord] = field(default_factory=dict)  # first / middle / last records
    skipped: int = 0
    losses: dict[int, float] = field(default_factory=dict)

    @property
    def report_steps(self) -> list[int]:
        """First, middle and last logged steps (distinct, ascending)."""
        s = self.steps
        return sorted({s[0], s[len(s) // 2], s[-1]})


def read_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl, skipping lines that are not complete JSON objects."""
    out: dict[int, float] = {}
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
            out[int(r["step"])] = float(r["loss"])
        except (ValueError, KeyError, TypeError):
            continue
    return out


def analyze_run(run_dir: str | os.PathLike, step: Optional[int] = None) -> RunAnalysis:
    """Stream over a run's expert-load files: per-interval statistics, total load, chosen step.

    Only the first and newest records stay in memory; the middle and chosen ones are re-read.
    """
    run_dir = Path(run_dir)
    files = list_expert_load_files(run_dir)
    skipped: list[str] = []
    steps, rows, paths, total, first, last = [], [], {}, None, None, None
    for rec in iter_expert_load(files, skipped):
        steps.append(rec.step)
        paths[rec.step] = rec.path
        rows.append(imbalance_stats(rec.counts))
        total = rec.counts.double() if total is None else total + rec.counts.double()
        first, last = first or rec, rec
    if not steps:
        raise ExpertLoadError(f"None of the {len(files)} expert-load files in {run_dir / EXPERT_LOAD_DIR} "
                              f"is readable.")
    if step is not None and step not in steps:
        raise ExpertLoadError(f"Step {step} is not logged in {run_dir / EXPERT_LOAD_DIR}; logged steps run "
                              f"from {steps[0]} to {steps[-1]} ({len(steps)} files), e.g. {_examples(steps)}.")
    chosen = steps[-1] if step is None else step
    known = {first.step: first, last.step: last}
    at = {s: known.get(s) or read_expert_load(paths[s])
          for s in sorted({steps[0], steps[len(steps) // 2], steps[-1], chosen})}
    return RunAnalysis(run_dir=run_dir, steps=steps, layer_ids=last.layer_ids, num_experts=last.counts.shape[1],
                       stats={k: torch.stack([r[k] for r in rows]) for k in rows[0]}, total=total,
                       chosen=at[chosen], at=at, skipped=len(skipped), losses=read_losses(run_dir))


def _examples(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:3])) + (f", ..., {steps[-1]}" if len(steps) > 3 else "")


def _fmt(x: float) -> str:
    return f"{x:.3f}"


def markdown_report(a: RunAnalysis, plots: Sequence[str] = ()) -> str:
    """The report: per MoE layer, each statistic at the first, middle and last logged step and overall."""
    cols = a.report_steps
    overall = imbalance_stats(a.total)
    at_stats = {s: imbalance_stats(a.at[s].counts) for s in cols}
    lines = [f"# Expert load: {a.run_dir}", ""]
    lines.append(f"{len(a.steps)} logged intervals, steps {a.steps[0]} to {a.steps[-1]}; "
                 f"{len(a.layer_ids)} MoE layers x {a.num_experts} routed experts."
                 + (f" {a.skipped} unreadable or inconsistent file(s) skipped." if a.skipped else ""))
    lines += ["", "Columns: the first, middle and last logged step (tokens of the interval ending there) and "
              "*overall* (tokens summed over every logged interval). max/mean: most loaded expert over the mean "
              "(1 = balanced); CV: population standard deviation over mean; <10%: share of experts receiving "
              "under 10% of the mean load.", ""]
    if any(s in a.losses for s in cols):
        lines += ["Loss at those steps: " + ", ".join(f"step {s}: {a.losses[s]:.4f}" for s in cols
                                                     if s in a.losses) + ".", ""]
    header = "| layer | " + " | ".join(f"step {s}" for s in cols) + " | overall |"
    rule = "|---:|" + "---:|" * (len(cols) + 1)
    for key, title in STAT_NAMES.items():
        lines += [f"## {title}", "", header, rule]
        for i, layer in enumerate(a.layer_ids):
            vals = [at_stats[s][key][i] for s in cols] + [overall[key][i]]
            lines.append(f"| {layer} | " + " | ".join(_fmt(float(v)) for v in vals) + " |")
        means = [at_stats[s][key].mean() for s in cols] + [overall[key].mean()]
        lines.append("| mean | " + " | ".join(_fmt(float(v)) for v in means) + " |")
        lines.append("")
    if a.chosen.bias is not None:
        b = a.chosen.bias
        lines += [f"## aux-loss-free bias at step {a.chosen.step}", "", "| layer | min | max | spread |",
                  "|---:|---:|---:|---:|"]
        for i, layer in enumerate(a.layer_ids):
            lines.append(f"| {layer} | {b[i].min():.4g} | {b[i].max():.4g} | {b[i].max() - b[i].min():.4g} |")
        lines.append("")
    if plots:
        lines += ["## plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines).rstrip() + "\n"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a reader (a resuming run) never sees a half-written file
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _save_figure(fig, path: Path) -> None:
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _atomic_write_bytes(path, buf.getvalue())


def plot_heatmap(rec: ExpertLoadRecord, path: Path) -> None:
    """Load per expert (columns) per MoE layer (rows) at one step, relative to the layer's mean."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    c = rec.counts.double()
    rel = (c / c.mean(-1, keepdim=True).clamp_min(1e-12)).numpy()
    L, E = rel.shape
    fig = Figure(figsize=(min(3 + E * 0.12, 24), 1.5 + L * 0.35))
    ax = fig.add_subplot()
    im = ax.imshow(rel, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("expert (global id)")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(L), [str(i) for i in rec.layer_ids])
    ax.set_title(f"expert load / layer mean at step {rec.step}")
    fig.colorbar(im, ax=ax, label="load / mean")
    _save_figure(fig, path)


def plot_max_over_mean(a: RunAnalysis, path: Path) -> None:
    """max/mean expert load of each MoE layer over the logged steps."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    m = a.stats["max_over_mean"].numpy()  # [T, L]
    for i, layer in enumerate(a.layer_ids):
        ax.plot(a.steps, m[:, i], marker="." if len(a.steps) < 50 else None, label=f"layer {layer}")
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean expert load")
    ax.set_title("expert load imbalance per MoE layer")
    ax.grid(alpha=0.3)
    if len(a.layer_ids) <= 16:
        ax.legend(fontsize="small", ncol=2)
    _save_figure(fig, path)


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike, step: Optional[int] = None) -> list[Path]:
    """Analyse a run and write expert_load.md, the heatmap and the imbalance plot into out_dir."""
    a = analyze_run(run_dir, step)
    out = _make_out_dir(out_dir)
    heat = out / f"expert_load_heatmap_step_{a.chosen.step:08d}.png"
    curve = out / "expert_load_max_over_mean.png"
    plot_heatmap(a.chosen, heat)
    plot_max_over_mean(a, curve)
    md = out / "expert_load.md"
    _atomic_write_bytes(md, markdown_report(a, [heat, curve]).encode())
    return [md, heat, curve]


def _make_out_dir(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExpertLoadError(f"Cannot create the output directory {out} ({e.strerror}).") from None
    return out


# ---------------------------------------------------------------------------
# Placement plan
# ---------------------------------------------------------------------------

def load_for_plan(source: str | os.PathLike, last: Optional[int] = None) -> tuple[Tensor, list[int]]:
    """The [layers, experts] load to plan for, and the layer ids.

    source: a safetensors file with tensor `load` (or `counts`), or a run
    directory, whose newest `last` readable expert-load files (default all) are summed.
    """
    source = Path(source)
    if last is not None and last < 1:
        raise ExpertLoadError(f"--last must be a positive number of files, got {last}.")
    if source.is_dir():
        files = list_expert_load_files(source)
        records = list(iter_expert_load(files))
        if not records:
            raise ExpertLoadError(f"None of the {len(files)} expert-load files in {source} is readable.")
        records = records[-last:] if last else records
        return torch.stack([r.counts.double() for r in records]).sum(0), records[-1].layer_ids
    if not source.is_file():
        raise ExpertLoadError(f"Load file {source} does not exist (give a safetensors file with a tensor "
                              f"'load' of shape [layers, experts], or a run directory).")
    from safetensors import safe_open

    try:
        with safe_open(str(source), framework="pt") as f:
            keys = set(f.keys())
            key = "load" if "load" in keys else "counts" if "counts" in keys else None
            if key is None:
                raise ExpertLoadError(f"{source} has no tensor 'load' (found: {sorted(keys) or 'none'}).")
            load = f.get_tensor(key).double()
            meta = f.metadata() or {}
    except ExpertLoadError:
        raise
    except Exception as e:
        raise ExpertLoadError(f"{source} is not a readable safetensors file ({type(e).__name__}).") from None
    if load.dim() != 2:
        raise ExpertLoadError(f"The load in {source} must have shape [layers, experts], got {list(load.shape)}.")
    try:
        layer_ids = [int(i) for i in json.loads(meta["layer_ids"])]
        assert len(layer_ids) == load.shape[0]
    except (KeyError, ValueError, TypeError, AssertionError):
        layer_ids = list(range(load.shape[0]))
    return load, layer_ids


def make_plan(load: Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
              layer_ids: Optional[list[int]] = None) -> dict:
    """Placement plan and its quality as a JSON-able dict (see `tools/expert_load.py plan --help`)."""
    from .moe import placement as pl

    if not torch.isfinite(load).all() or (load < 0).any():
        raise ExpertLoadError("The load must be finite and non-negative.")
    try:
        pl.check_layout(load.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    except pl.PlacementError as e:
        raise ExpertLoadError(f"{str(e).rstrip('.')} (the load has {load.shape[1]} experts).") from None
    phy2log, _, logcnt = pl.rebalance_experts(load, num_replicas, num_groups, num_nodes, num_gpus)
    ref = pl.eplb_reference(load, num_replicas, num_groups, num_nodes, num_gpus)
    ours = pl.max_over_mean(load, phy2log, num_gpus)
    eplb = pl.max_over_mean(load, ref, num_gpus)
    bound = pl.lower_bound(load, num_replicas, num_groups, num_nodes, num_gpus)
    gpu = pl.gpu_loads(load, phy2log, num_gpus)
    S = num_replicas // num_gpus
    r = lambda t: [round(float(x), 6) for x in t]  # noqa: E731
    return {
        "layout": {"num_experts": load.shape[1], "num_replicas": num_replicas, "num_groups": num_groups,
                   "num_nodes": num_nodes, "num_gpus": num_gpus, "slots_per_gpu": S,
                   "policy": "hierarchical" if pl.is_hierarchical(num_groups, num_nodes) else "global"},
        "layer_ids": list(layer_ids) if layer_ids is not None else list(range(load.shape[0])),
        "phy2log": phy2log.tolist(),
        "logcnt": logcnt.tolist(),
        "max_over_mean": r(ours),
        "eplb_max_over_mean": r(eplb),
        "lower_bound": r(bound),
        "gap_to_lower_bound": r(ours / bound - 1),
        "max_gpu_load": r(gpu.max(-1).values),
        "mean_gpu_load": r(gpu.mean(-1)),
        "summary": {"mean_max_over_mean": float(ours.mean()), "mean_eplb_max_over_mean": float(eplb.mean()),
                    "mean_lower_bound": float(bound.mean()),
                    "mean_gap_to_lower_bound": float((ours / bound - 1).mean())},
        "notes": "GPU g holds physical slots [g*slots_per_gpu, (g+1)*slots_per_gpu); phy2log[layer][slot] is the "
                 "logical expert in that slot. max_over_mean = max GPU load / mean GPU load, a replica carrying "
                 "its expert's load / its replica count. lower_bound: no plan of this layout can do better "
                 "(moe_trainer.moe.placement.lower_bound).",
    }


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

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


def dump_plan(plan: dict) -> str:
    """JSON with one line per top-level key, and one line per layer for per-layer lists of lists."""
    lines = []
    for key, value in plan.items():
        if isinstance(value, list) and value and isinstance(value[0], list):
            rows = ",\n".join("    " + json.dumps(row) for row in value)
            lines.append(f"  {json.dumps(key)}: [\n{rows}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


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
