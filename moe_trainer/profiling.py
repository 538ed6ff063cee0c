"""A window of steps under torch.profiler, and where each step's time went (debug.profile_steps).

A run with `debug.profile_steps: [first, last]` records steps first..last (1-based, inclusive) on the
ranks `debug.profile_ranks` lists, each step inside a `moe_trainer.step <N>` range, and each of those
ranks writes into <out_dir>/profile/:

    rank<R>.steps<first>-<last>.json.gz       the Chrome trace (Perfetto, chrome://tracing)
    rank<R>.steps<first>-<last>.summary.json  per step, what `summarize` reads from that trace

A summary splits each step's wall into the device's busy time by kind (GEMMs, attention, communication,
the rest) and its idle time. On a GPU the device is the GPUs' kernels and copies (CUPTI's events on the
host's clock); idle is the device waiting for the host (launches, host syncs, Python). On CPU ranks the
device is the CPU's operators, each kind charged its own (self) time; idle is the Python and framework
time between top-level operators. `tools/plan.py --time --profile RUN_DIR` holds the split against the
step-time model's. The profiled steps end with the device synchronised, so their kernels fall inside
them; the steps around the window run as before.

`summarize` is pure: a Chrome trace's dict in, the summary out.
"""
from __future__ import annotations

import gzip
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional

import torch

STEP_RANGE = "moe_trainer.step "  # + the step number: the user annotation around each profiled step
KINDS = ("gemm", "attention", "communication", "other")
TOP = 20  # kernels (operators on a CPU) by their time in the window, named in the summary
NAME_CHARS = 160  # of each: a kernel's full name can run to thousands (its template arguments); the trace has it
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# by name, the first that matches (lower case): collectives before GEMMs (an NCCL kernel is no GEMM), attention
# before GEMMs (flash attention's kernels carry "gemm"-like names in some builds)
_COMM = ("nccl", "c10d::", "gloo", "all_to_all", "alltoall", "allreduce", "all_reduce", "allgather", "all_gather",
         "reduce_scatter", "record_param_comms", "shm_collective::")  # not "broadcast": aten::broadcast_tensors
_ATTENTION = ("flash", "fmha", "scaled_dot_product", "attention")
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_grouped_mm",
             "aten::_scaled_mm", "aten::_scaled_grouped_mm", "aten::mkldnn_linear", "mkldnn::_linear_pointwise"}
# GPU kernels by library; on CPU ranks the trainer's own kernels (kernels/cpu: oneDNN linears, the threaded
# expert FFN, whose time is its GEMMs) by their autograd functions' names
_GEMM_KERNELS = ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "cublas", "triton_tem_fused", "grouped_mm",
                 "onednnlinear", "threadedcpuexperts")


def _base(name: str) -> str:
    """A kernel's name without its template arguments and parameters: what it is, not what it is instantiated
    with (fbgemm's embedding kernels take `fbgemm_gpu::` types; a GEMM's epilogue may take an attention mask)."""
    n = name.removeprefix("void ")
    cut = [i for i in (n.find("<"), n.find("(")) if i > 0]
    return n[:min(cut)] if cut else n


def kind_of(name: str) -> str:
    """The kind a kernel or operator's time counts as, from its name."""
    n = _base(name).lower().replace("fbgemm", "")  # a library's name, not a GEMM
    if any(k in n for k in _COMM):
        return "communication"
    if any(k in n for k in _ATTENTION):
        return "attention"
    if name in _GEMM_OPS or (not name.startswith(("aten::", "mkldnn::")) and any(k in n for k in _GEMM_KERNELS)):
        return "gemm"
    return "other"


def _union(spans: list[tuple[float, float]]) -> float:
    """Length covered by the intervals (start, end)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


# composite kinds: an operator inside attention or a collective counts as that (the explicit attention's
# matmuls are attention's time, as flash attention's are on a GPU)
_ENCLOSING = ("attention", "communication")


def _self_times(ops: list[dict]) -> list[tuple[dict, float, bool, str]]:
    """Each CPU operator with its own time (its duration less its children's, children found by
    nesting on the same thread), whether it is top-level, and its kind (its enclosing composite's)."""
    out = []
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, children's time, top-level, kind]
        for e in events:
            while stack and e["ts"] >= stack[-1][1]:
                stack.pop()
            kind = stack[-1][4] if stack and stack[-1][4] in _ENCLOSING else kind_of(e["name"])
            if stack:
                stack[-1][2] += e["dur"]
            entry = [e, e["ts"] + e["dur"], 0.0, not stack, kind]
            stack.append(entry)
            out.append(entry)
    return [(e, max(0.0, e["dur"] - kids), top, kind) for e, _end, kids, top, kind in out]


def summarize(trace: dict) -> dict:
    """Per profiled step (the `moe_trainer.step <N>` ranges): wall, device busy and idle, the device's
    seconds by kind, and its kernels (GPU) or top-level operators (CPU); their means; and the TOP kernels
    (operators) by time, per step. Seconds throughout."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(STEP_RANGE)),
                   key=lambda e: e["ts"])
    device = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    on_gpu = bool(device)
    if on_gpu:  # kernels and copies do not nest: each its whole time, top-level
        work = [(e, float(e["dur"]), True, kind_of(e["name"])) for e in device]
    else:
        # the operators, and the ranges around calls the profiler cannot see into (the shared-memory collectives)
        work = _self_times([e for e in events if e.get("cat") == "cpu_op" or (
            e.get("cat") == "user_annotation" and kind_of(e["name"]) == "communication")])
    rows = []
    names: dict = defaultdict(lambda: [0.0, 0])  # (name, kind) -> [own time, count] over the window
    for s in steps:
        start, end = s["ts"], s["ts"] + s["dur"]
        inside = [w for w in work if start <= w[0]["ts"] < end]
        by_kind = dict.fromkeys(KINDS, 0.0)
        for e, own, _top, kind in inside:
            by_kind[kind] += own
            names[(e["name"], kind)][0] += own
            names[(e["name"], kind)][1] += 1
        busy = _union([(e["ts"], min(e["ts"] + e["dur"], end)) for e, _own, top, _k in inside if top])
        wall = s["dur"]
        rows.append({"step": int(s["name"][len(STEP_RANGE):]), "wall_s": wall / 1e6, "busy_s": busy / 1e6,
                     "idle_s": max(0.0, wall - busy) / 1e6, "kernels": sum(1 for w in inside if w[2]),
                     **{f"{k}_s": v / 1e6 for k, v in by_kind.items()}})
    n = max(1, len(rows))
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:TOP]
    return {"device": "gpu" if on_gpu else "cpu", "steps": rows, "mean": _mean(rows),
            "top": [{"name": name[:NAME_CHARS], "kind": kind, "s_per_step": t / 1e6 / n, "per_step": c / n}
                    for (name, kind), (t, c) in top]}


def _mean(rows: list[dict]) -> dict:
    if not rows:
        return {}
    keys = [k for k in rows[0] if k != "step"]
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


def trace_name(rank: int, first: int, last: int) -> str:
    return f"rank{rank}.steps{first}-{last}"


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def read_summaries(run_dir: Path) -> dict[str, dict]:
    """{file stem: summary} of every rank's profile in the run directory (empty when none)."""
    found = {}
    for path in sorted((Path(run_dir) / "profile").glob("*.summary.json")):
        found[path.name[:-len(".summary.json")]] = json.loads(path.read_text())
    return found


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".tmp{os.getpid()}.{path.name}")  # the same ending: export_chrome_trace gzips ".gz"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class StepProfiler:
    """Steps first..last under torch.profiler on this rank, when debug.profile_ranks names it.

        begin(step)   before the step: the profiler starts at the window's first step; the step's range opens
        end()         after it: the range closes; after the window's last step the trace and summary are written
        close()       the loop ended inside the window (SIGTERM, stop_at_step): what was recorded is written

    end() and close() return the summary when they write one (None otherwise). A profiler that cannot start or
    write (no CUPTI, a full disk) costs one line and the window, never the run: it is an observation."""

    def __init__(self, steps: list, ranks: Iterable[int], rank: int, device: torch.device, out_dir: Path):
        self.window = (steps[0], steps[1]) if steps and rank in set(ranks) else None
        self.rank, self.device, self.out_dir = rank, device, Path(out_dir)
        self.prof: Optional[torch.profiler.profile] = None
        self.range: Optional[torch.profiler.record_function] = None
        self.first = self.step = self.last = 0  # the first step recorded; the step in its range; the last one

    def begin(self, step: int) -> None:
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        if self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            try:
                self.prof = torch.profiler.profile(activities=activities)
                self.prof.start()
            except (RuntimeError, OSError) as e:
                return self._give_up("could not start", e)
            self.first = step  # the window's first step, or the first after a resume inside it
        self.step, self.range = step, torch.profiler.record_function(f"{STEP_RANGE}{step}")
        self.range.__enter__()

    def end(self) -> Optional[dict]:
        if self.range is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels inside its range (profiled steps only)
        self.range.__exit__(None, None, None)
        self.range, self.last = None, self.step
        return self.write() if self.step == self.window[1] else None

    def close(self) -> Optional[dict]:
        return self.write() if self.prof is not None else None

    def write(self) -> Optional[dict]:
        """Stop the profiler; the trace and its summary into <out_dir>/profile/, each written whole."""
        name = trace_name(self.rank, self.first, self.last)
        trace_path = self.out_dir / "profile" / f"{name}.json.gz"
        try:
            self.prof.stop()
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(trace_path, lambda p: self.prof.export_chrome_trace(str(p)))
            summary = summarize(read_trace(trace_path))
            summary.update(rank=self.rank, trace=trace_path.name)
            _write_atomic(trace_path.with_name(f"{name}.summary.json"),
                          lambda p: p.write_text(json.dumps(summary, indent=1) + "\n"))
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            return self._give_up(f"could not write {trace_path}", e)
        self.prof, self.window = None, None
        return summary

    def _give_up(self, what: str, e: Exception) -> None:
        print(f"profile rank {self.rank}: torch.profiler {what} ({e}); the run goes on unprofiled", flush=True)
        self.prof = self.range = self.window = None
