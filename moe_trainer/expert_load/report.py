"""The analysis of a run's expert load: per-interval statistics streamed over its files, the
markdown report (first, middle and last logged step and overall) and the plots."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from .files import (EXPERT_LOAD_DIR, ExpertLoadError, ExpertLoadRecord, _atomic_write_bytes, _make_out_dir,
                    iter_expert_load, list_expert_load_files, read_expert_load)
from .stats import STAT_NAMES, imbalance_stats


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
