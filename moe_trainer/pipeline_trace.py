"""Pipeline schedule traces: measured bubble, executed order, and a PNG timeline.

Input: one list of events per stage, each {"kind", "micro", "chunk", "start", "end"}
(seconds from the step's common start), as parallel/pipeline.py's Trace records; "chunk" is the
rank's chunk under the interleaved schedule (0 otherwise, and in traces written before it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

COMPUTE = ("forward", "backward")


def _op(e: dict) -> tuple[str, int, int]:
    return "F" if e["kind"] == "forward" else "B", e["micro"], e.get("chunk", 0)


def _op_spans(events: list[dict]) -> dict:
    """{op: (first start, last end)}: under parallel.overlap=a2a an operation of a pair is recorded as
    one event per stage it ran (its pieces interleaved with the other operation's)."""
    spans: dict = {}
    for e in events:
        if e["kind"] in COMPUTE:
            a, b = spans.get(_op(e), (e["start"], e["end"]))
            spans[_op(e)] = (min(a, e["start"]), max(b, e["end"]))
    return spans


def executed_order(events: list[dict]) -> list[tuple[str, int, int]]:
    """("F" | "B", micro, chunk) in the order this stage started them."""
    spans = _op_spans(events)
    return sorted(spans, key=lambda op: spans[op][0])


def peak_in_flight_measured(events: list[dict]) -> int:
    """Most (micro-batch, chunk) activations whose forward had ended and backward not yet started."""
    points = []
    for op, (start, end) in _op_spans(events).items():
        points.append((end, 1) if op[0] == "F" else (start, -1))
    live = peak = 0
    for _, delta in sorted(points, key=lambda p: (p[0], p[1])):
        live += delta
        peak = max(peak, live)
    return peak


def measured_bubble(stages: list[list[dict]]) -> float:
    """Share of the step's span that the stages spent not computing, averaged over stages."""
    starts = [e["start"] for ev in stages for e in ev if e["kind"] in COMPUTE]
    ends = [e["end"] for ev in stages for e in ev if e["kind"] in COMPUTE]
    span = max(ends) - min(starts)
    idle = [1.0 - sum(e["end"] - e["start"] for e in ev if e["kind"] in COMPUTE) / span for ev in stages]
    return sum(idle) / len(idle)


def write_trace(out_dir: Path, stages: list[list[dict]], micro_batches: int, step: int,
                schedule: str = "1f1b", chunks: int = 1) -> dict:
    """pipeline_trace.json and pipeline_trace.png in the run directory; returns the summary."""
    from .parallel.pipeline import theoretical_bubble
    pp = len(stages)
    summary = {"step": step, "schedule": schedule, "stages": pp, "micro_batches": micro_batches,
               "virtual_stages": chunks, "measured_bubble": measured_bubble(stages),
               "theoretical_bubble": theoretical_bubble(pp, micro_batches, chunks),
               "peak_in_flight": [peak_in_flight_measured(ev) for ev in stages],
               "events": stages}
    tmp = Path(out_dir) / f"pipeline_trace.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(summary))
    os.replace(tmp, Path(out_dir) / "pipeline_trace.json")
    plot_timeline(stages, Path(out_dir) / "pipeline_trace.png", summary)
    return summary


def plot_timeline(stages: list[list[dict]], path: Path, summary: dict) -> None:
    """Stages as rows, forward / backward boxes coloured by micro-batch and labelled F<micro> (F<micro>.<chunk>
    with chunks, each chunk with its own hatching), waits hatched grey."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cmap = plt.get_cmap("tab20")
    chunks = summary.get("virtual_stages", 1)
    hatches = ["", "..", "xx", "\\\\", "oo", "++"]
    fig, ax = plt.subplots(figsize=(12 if chunks == 1 else 16, 0.8 + 0.7 * len(stages)))
    for s, events in enumerate(stages):
        for e in events:
            if e["kind"] in COMPUTE:
                fwd, c = e["kind"] == "forward", e.get("chunk", 0)
                ax.barh(s, e["end"] - e["start"], left=e["start"], height=0.8 if fwd else 0.5,
                        color=cmap(e["micro"] % 20), edgecolor="black", linewidth=0.5, alpha=1.0 if fwd else 0.6,
                        hatch=hatches[c % len(hatches)])
                label = ("F" if fwd else "B") + str(e["micro"]) + (f".{c}" if chunks > 1 else "")
                ax.text(e["start"] + (e["end"] - e["start"]) / 2, s, label, ha="center", va="center", fontsize=6)
            elif e["kind"].startswith("recv"):
                ax.barh(s, e["end"] - e["start"], left=e["start"], height=0.2, color="lightgrey", hatch="//")
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in range(len(stages))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the step's start")
    name = summary["schedule"].upper() if chunks == 1 else f"interleaved {summary['schedule'].upper()} (v={chunks})"
    ax.set_title(f"{name}, {summary['stages']} stages x {summary['micro_batches']} micro-batches: bubble "
                 f"{100 * summary['measured_bubble']:.1f}% measured, "
                 f"{100 * summary['theoretical_bubble']:.1f}% = (p-1)/({'v*' if chunks > 1 else ''}m+p-1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
