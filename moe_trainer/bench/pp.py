"""Pipeline-parallel benchmark (issue #5): bubble, activation memory per schedule, recomputation.

Three parts, each printing a markdown table (docs/BENCHMARKS_pp.md holds a run's output):

bubble     the real trainer under the deepspeed launcher (`--set parallel.pp=P --set debug.trace_pipeline=true`,
           global_batch_size = micro_batch_size * m, so m micro-batches per step) for every P x m; reads
           pipeline_trace.json (the last step): measured bubble, theoretical (p-1)/(m+p-1), and a
           compute-only bubble: the schedule replayed from the trace's own forward/backward box durations
           with the schedule's dependencies and zero transfer/scheduling delay (see `replay_bubble`).
memory     one process: every stage of a P-stage split (the stage's own layers, PipelineStage) runs its
           F/B order for m micro-batches under saved-tensor hooks; peak saved-activation bytes per stage
           under GPipe order and under 1F1B. Optionally (--real-gpipe) the trainer run with
           parallel.schedule=gpipe, to check which order it actually executed.
schedule   the executor itself on stages whose forward and backward take a fixed time without using a core
           (pp_schedule.py), over the shared-memory rings (eager, or under NCCL's rule) and gloo: the bubble of
           the schedule and the transport alone, next to (p-1)/(v m+p-1).
recompute  one process: for parallel.recompute none | selective | full, the largest micro-batch whose peak
           saved-activation bytes fit a fixed budget, and training tokens/s at that micro-batch
           (forward + backward + AdamW step, median of a few steps).

Usage: python -m moe_trainer.bench.pp [--parts bubble,memory,recompute,interleaved,schedule] [--pps 2,4]
                                      [--vs 1,2,4] [--ms 1,4,8,16] [--transports shm,shm-strict,gloo]
                                      [--out JSON] [--timeline PNG]

This module runs the trainer (bubble, interleaved, --real-gpipe) and is the command; the
measurements made in one process (activation memory per schedule, recomputation) live in
pp_memory.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .pp_memory import (CONFIG, INTERLEAVED_LAYERS, ROOT, bench_memory, bench_recompute, chunk_peaks, memory_table,
                        recompute_table)
from .pp_schedule import TRANSPORTS, bench_schedule, schedule_table
from .turns import free_port

# the trainer runs of the bubble part: moe_tiny (hidden 256, 1 dense + 3 MoE layers), short sequences
BUBBLE_SET = ["train.seq_len=128", "train.micro_batch_size=2", "train.max_steps=3", "train.warmup_steps=1",
              "train.eval_every=0", "train.checkpoint_every=0", "train.log_every=1", "train.resume=none",
              "metrics.tensorboard=false", "metrics.peak_tflops=1.0"]


# ----------------------------------------------------------------------------- bubble


def replay_bubble(events: list[list[dict]], schedule: str = "1f1b", chunks: int = 1) -> float:
    """Bubble of the schedule replayed with each stage's measured compute-box durations.

    Every op starts as soon as (a) the previous op of its stage has ended and (b) its input exists:
    F of virtual stage g = chunk * pp + s on micro i needs F(g-1, i), B(g, i) needs B(g+1, i) (the last
    virtual stage's B needs its own F, which the stage order already gives). Sends, receives and waiting
    for a descheduled neighbour cost nothing, so what remains is the bubble the schedule itself implies
    for these compute times (stage imbalance included). Same formula as pipeline_trace.measured_bubble:
    mean over stages of 1 - busy / span."""
    from ..parallel.pipeline import SCHEDULES
    pp = len(events)
    dur = [{("F" if e["kind"] == "forward" else "B", e["micro"], e.get("chunk", 0)): e["end"] - e["start"]
            for e in ev if e["kind"] in ("forward", "backward")} for ev in events]
    m = sum(1 for k in dur[0] if k[0] == "F") // chunks
    ops = [SCHEDULES[schedule](s, pp, m, chunks) for s in range(pp)]
    last = pp * chunks - 1
    end: dict = {}
    pos = [0] * pp
    clock = [0.0] * pp
    done = 0
    total = sum(len(o) for o in ops)
    while done < total:
        progressed = False
        for s in range(pp):
            while pos[s] < len(ops[s]):
                kind, i, c = ops[s][pos[s]]
                g = c * pp + s
                h = g - 1 if kind == "F" else g + 1  # the virtual stage whose op this one waits for
                dep = (h % pp, kind, i, h // pp) if 0 <= h <= last else None
                if dep is not None and dep not in end:
                    break
                start = max(clock[s], end[dep] if dep else 0.0)
                clock[s] = end[(s, kind, i, c)] = start + dur[s][(kind, i, c)]
                pos[s] += 1
                done += 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule replay deadlocked")
    span = max(clock)
    busy = [sum(d.values()) for d in dur]
    return sum(1.0 - b / span for b in busy) / pp


def executor_bubble(events: list[list[dict]], schedule: str = "1f1b", chunks: int = 1, strict: bool = True) -> float:
    """Bubble of the executor's own batches replayed with each stage's measured compute-box durations.

    Each rank runs p2p.comm_plan's sequence: post a batch, wait until it completes, run the operation.
    Transfers take no time, but a batch holds its rank until each transfer in it meets its partner: under
    NCCL's rule (`strict`) a transfer completes once both ends are posted; eager (gloo, the shared-memory
    rings, NCCL below its buffer size) a send completes when posted and a receive once its send was.
    replay_bubble lets every operation start once its input exists; here a rank also waits for what its
    batch pairs with that input (the receive of a later backward, the peer of a send), so a slow box
    delays the ranks it shares batches with. With equal boxes both give (p-1)/(v m+p-1)."""
    from ..parallel.p2p import chunk_peers, comm_plan
    from ..parallel.pipeline import schedule_units
    pp = len(events)
    dur = [{("F" if e["kind"] == "forward" else "B", e["micro"], e.get("chunk", 0)): e["end"] - e["start"]
            for e in ev if e["kind"] in ("forward", "backward")} for ev in events]
    m = sum(1 for k in dur[0] if k[0] == "F") // chunks
    plans, count = [], {}
    for s in range(pp):
        plan = []
        for batch, op in comm_plan(schedule_units(schedule, s, pp, m, chunks), chunk_peers(s, pp, chunks, list(range(pp)))):
            keys = []
            for t in batch:  # the n-th transfer on channel src -> dst meets the n-th posted for it
                src, dst = (s, t.peer) if t.send else (t.peer, s)
                n = count[(src, dst, t.send)] = count.get((src, dst, t.send), -1) + 1
                keys.append((src, dst, n, t.send))
            plan.append((keys, op))
        plans.append(plan)
    posted: dict = {}
    pos, clock = [0] * pp, [0.0] * pp
    while any(pos[s] < len(plans[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while pos[s] < len(plans[s]):
                keys, op = plans[s][pos[s]]
                for k in keys:
                    posted.setdefault(k, clock[s])
                done = []
                for src, dst, n, send in keys:
                    partner = (src, dst, n, not send)
                    if strict or not send:
                        if partner not in posted:
                            break
                        done.append(max(posted[partner], posted[(src, dst, n, send)]))
                    else:
                        done.append(posted[(src, dst, n, send)])
                else:
                    clock[s] = max([clock[s]] + done) + (dur[s][op] if op is not None else 0.0)
                    pos[s] += 1
                    moved = True
                    continue
                break
        if not moved:
            raise RuntimeError("executor replay deadlocked")
    span = max(clock)
    return sum(1.0 - sum(d.values()) / span for d in dur) / pp


def _env(threads: int = 1) -> dict:
    e = dict(os.environ)
    e.setdefault("DS_ACCELERATOR", "cpu")
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = str(threads)
    return e


def bubble_sets(pp: int, m: int, mbs: int, schedule: str = "1f1b", v: int = 1) -> list[str]:
    sets = [s for s in BUBBLE_SET if not s.startswith("train.micro_batch_size")]
    sets += [f"train.micro_batch_size={mbs}", f"train.global_batch_size={mbs * m}", f"parallel.pp={pp}",
             f"parallel.virtual_stages={v}", "debug.trace_pipeline=true"]
    if schedule != "1f1b":
        sets.append(f"parallel.schedule={schedule}")
    return sets


def run_trainer(pp: int, m: int, mbs: int, out_dir: Path, schedule: str = "1f1b", timeout: int = 600,
                v: int = 1, extra: tuple = ()) -> dict:
    sets = bubble_sets(pp, m, mbs, schedule, v) + list(extra)
    args = [f"--config={CONFIG}"] + [a for s in sets + [f"run.out_dir={out_dir}"] for a in ("--set", s)]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(pp), "--master_port", str(free_port()),
           "--module", "moe_trainer.train", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    trace_path = out_dir / "pipeline_trace.json"
    if proc.returncode != 0 or not trace_path.exists():
        raise RuntimeError(f"pp={pp} v={v} m={m} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    trace = json.loads(trace_path.read_text())
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in metrics if "step_time_s" in r]
    return {"trace": trace, "step_time_s": steps[-1]["step_time_s"] if steps else None,
            "tokens_per_s": steps[-1]["tokens_per_s"] if steps else None, "wall_s": wall}


def bench_bubble(pps: list[int], ms: list[int], mbs: int, tmp: Path, timeline: Path | None) -> list[dict]:
    from ..pipeline_trace import executed_order
    from ..parallel.pipeline import one_f_one_b
    rows, best = [], None
    for pp in pps:
        for m in ms:
            out = tmp / f"pp{pp}_m{m}"
            r = run_trainer(pp, m, mbs, out)
            tr = r["trace"]
            ev = tr["events"]
            busy = [sum(e["end"] - e["start"] for e in s if e["kind"] in ("forward", "backward")) for s in ev]
            fwd = [statistics.median([e["end"] - e["start"] for e in s if e["kind"] == "forward"]) for s in ev]
            bwd = [statistics.median([e["end"] - e["start"] for e in s if e["kind"] == "backward"]) for s in ev]
            order_ok = all(executed_order(s) == one_f_one_b(i, pp, m) for i, s in enumerate(ev))
            row = {"pp": pp, "m": m, "theoretical": tr["theoretical_bubble"], "measured": tr["measured_bubble"],
                   "compute_only": replay_bubble(ev), "step_time_s": r["step_time_s"],
                   "tokens_per_s": r["tokens_per_s"], "fwd_ms": [1e3 * x for x in fwd],
                   "bwd_ms": [1e3 * x for x in bwd], "busy_s": busy, "order_1f1b": order_ok,
                   "peak_in_flight": tr["peak_in_flight"], "run_dir": str(out)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "run_dir"}), flush=True)
            if pp == max(pps) and m == 8:
                best = out
    if timeline is not None and best is not None and (best / "pipeline_trace.png").exists():
        timeline.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(best / "pipeline_trace.png", timeline)
    return rows


def bubble_table(rows: list[dict]) -> str:
    out = ["| pp | m | theory (p-1)/(m+p-1) | measured | compute-only (replay) | step s | tokens/s | "
           "median F ms per stage | median B ms per stage | executed 1F1B |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['pp']} | {r['m']} | {100 * r['theoretical']:.1f}% | {100 * r['measured']:.1f}% | "
                   f"{100 * r['compute_only']:.1f}% | {r['step_time_s']:.3f} | {r['tokens_per_s']:.0f} | "
                   f"{' / '.join(f'{x:.0f}' for x in r['fwd_ms'])} | {' / '.join(f'{x:.0f}' for x in r['bwd_ms'])}"
                   f" | {'yes' if r['order_1f1b'] else 'NO'} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- interleaved (virtual stages)


def bench_interleaved(pps: list[int], vs: list[int], ms: list[int], mbs: int, seq: int, tmp: Path,
                      p2p: str = "shm") -> list[dict]:
    """The trainer with parallel.virtual_stages=v (its stages' transfers through `p2p`: shm or gloo):
    measured bubble (trace), the compute-only replay, the executor's batches replayed under NCCL's rule
    and (p-1)/(v m+p-1); and every rank's peak saved-activation bytes under that order (one process)."""
    from ..parallel.pipeline import one_f_one_b
    from ..pipeline_trace import executed_order
    rows = []
    for pp in pps:
        for v in vs:
            if pp * v > INTERLEAVED_LAYERS:
                continue
            for m in ms:
                if m % pp:
                    continue
                r = run_trainer(pp, m, mbs, tmp / f"pp{pp}_v{v}_m{m}", v=v,
                                extra=(f"model.num_hidden_layers={INTERLEAVED_LAYERS}", f"parallel.cpu_p2p={p2p}"))
                tr, ev = r["trace"], r["trace"]["events"]
                peaks = chunk_peaks(pp, v, m, mbs, seq)
                row = {"pp": pp, "v": v, "m": m, "theoretical": tr["theoretical_bubble"],
                       "measured": tr["measured_bubble"], "compute_only": replay_bubble(ev, chunks=v),
                       "executor_model": executor_bubble(ev, chunks=v), "p2p": p2p,
                       "step_time_s": r["step_time_s"], "peak_in_flight": tr["peak_in_flight"],
                       "peak_act_mib": [x / 2 ** 20 for x in peaks],
                       "order_ok": all(executed_order(s) == one_f_one_b(i, pp, m, v) for i, s in enumerate(ev))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def interleaved_table(rows: list[dict]) -> str:
    out = ["| pp | v | m | (p-1)/(v m+p-1) | measured | compute-only replay | executor replay | step s | "
           "chunk activations in flight per rank | peak saved MiB per rank |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['pp']} | {r['v']} | {r['m']} | {100 * r['theoretical']:.1f}% | {100 * r['measured']:.1f}% | "
                   f"{100 * r['compute_only']:.1f}% | {100 * r['executor_model']:.1f}% | {r['step_time_s']:.2f} | "
                   f"{r['peak_in_flight']} | "
                   f"{', '.join(f'{x:.1f}' for x in r['peak_act_mib'])} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- the trainer with parallel.schedule=gpipe


def real_gpipe(pp: int, m: int, mbs: int, tmp: Path) -> dict:
    """The trainer with parallel.schedule=gpipe: which order did it execute?"""
    from ..pipeline_trace import executed_order, peak_in_flight_measured
    from ..parallel.pipeline import gpipe, one_f_one_b
    r = run_trainer(pp, m, mbs, tmp / f"pp{pp}_m{m}_gpipe", schedule="gpipe")
    ev = r["trace"]["events"]
    res = {"pp": pp, "m": m, "executed_gpipe": all(executed_order(s) == gpipe(i, pp, m) for i, s in enumerate(ev)),
           "executed_1f1b": all(executed_order(s) == one_f_one_b(i, pp, m) for i, s in enumerate(ev)),
           "peak_in_flight": [peak_in_flight_measured(s) for s in ev], "measured_bubble": r["trace"]["measured_bubble"]}
    print(json.dumps(res), flush=True)
    return res


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="bubble,memory,recompute")
    ap.add_argument("--pps", default="2,4")
    ap.add_argument("--vs", default="1,2,4", help="virtual stages of the interleaved part")
    ap.add_argument("--ms", default="1,4,8,16")
    ap.add_argument("--mbs", type=int, default=4, help="micro-batch of the trainer runs (bubble part)")
    ap.add_argument("--mem-pp", type=int, default=4)
    ap.add_argument("--mem-m", type=int, default=8)
    ap.add_argument("--mem-mbs", type=int, default=2)
    ap.add_argument("--mem-seq", type=int, default=128)
    ap.add_argument("--real-gpipe", action="store_true", help="also run the trainer with parallel.schedule=gpipe")
    ap.add_argument("--seq", type=int, default=512, help="sequence length of the recompute part")
    ap.add_argument("--budget-mbs", type=int, default=4, help="the budget = `none`'s saved bytes at this batch")
    ap.add_argument("--max-mbs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="training steps per recompute measurement")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the in-process parts")
    ap.add_argument("--p2p", default="shm", choices=("shm", "gloo"),
                    help="interleaved part: the trainer's parallel.cpu_p2p")
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    help="point-to-point of the schedule part: shm, shm-strict (NCCL's rule), gloo")
    ap.add_argument("--stage-ms", type=float, default=60.0,
                    help="schedule part: a stage's forward (ms), split over its v chunks; backward 2x")
    ap.add_argument("--steps-schedule", type=int, default=6, help="schedule part: executor steps per run")
    ap.add_argument("--out", default="", help="write every row as JSON here")
    ap.add_argument("--timeline", default="", help="copy the largest-pp m=8 trace PNG here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    parts = a.parts.split(",")
    result: dict = {"threads": a.threads}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as tmp:
        tmp = Path(tmp)
        if "bubble" in parts:
            t0 = time.perf_counter()
            rows = bench_bubble([int(x) for x in a.pps.split(",")], [int(x) for x in a.ms.split(",")], a.mbs, tmp,
                                Path(a.timeline) if a.timeline else None)
            result["bubble"] = [{k: v for k, v in r.items() if k != "run_dir"} for r in rows]
            print(f"\n## Bubble ({time.perf_counter() - t0:.0f} s)\n\n{bubble_table(rows)}\n", flush=True)
        if "memory" in parts:
            t0 = time.perf_counter()
            rows = bench_memory(a.mem_pp, a.mem_m, a.mem_mbs, a.mem_seq)
            result["memory"] = rows
            print(f"\n## Activation memory, pp {a.mem_pp}, m {a.mem_m}, micro-batch {a.mem_mbs} x {a.mem_seq} "
                  f"({time.perf_counter() - t0:.0f} s)\n\n{memory_table(rows)}\n", flush=True)
            if a.real_gpipe:
                g = result["real_gpipe"] = real_gpipe(a.mem_pp, a.mem_m, a.mbs, tmp)
                print(f"trainer with parallel.schedule=gpipe, pp {g['pp']} m {g['m']}: executed "
                      f"{'GPipe' if g['executed_gpipe'] else '1F1B' if g['executed_1f1b'] else 'another'} order, "
                      f"peak in flight per stage {g['peak_in_flight']}\n", flush=True)
        if "interleaved" in parts:
            t0 = time.perf_counter()
            rows = bench_interleaved([int(x) for x in a.pps.split(",")], [int(x) for x in a.vs.split(",")],
                                     [int(x) for x in a.ms.split(",")], a.mbs, a.mem_seq, tmp, a.p2p)
            result["interleaved"] = rows
            print(f"\n## Interleaved 1F1B, {INTERLEAVED_LAYERS} layers ({time.perf_counter() - t0:.0f} s)\n\n"
                  f"{interleaved_table(rows)}\n", flush=True)
        if "schedule" in parts:
            t0 = time.perf_counter()
            transports = a.transports.split(",")
            rows = bench_schedule([int(x) for x in a.pps.split(",")], [int(x) for x in a.vs.split(",")],
                                  [int(x) for x in a.ms.split(",")], transports, a.stage_ms / 1e3, a.steps_schedule)
            result["schedule"] = {"stage_forward_ms": a.stage_ms, "rows": rows}
            print(f"\n## The executor on held stages: forward {a.stage_ms:g} ms per stage, backward 2x "
                  f"({time.perf_counter() - t0:.0f} s)\n\n{schedule_table(rows, transports)}\n", flush=True)
        if "recompute" in parts:
            t0 = time.perf_counter()
            rows, budget = bench_recompute(a.budget_mbs, a.seq, a.steps, a.max_mbs)
            result["recompute"] = {"budget": budget, "rows": rows}
            print(f"\n## Recompute ({time.perf_counter() - t0:.0f} s)\n\n"
                  f"{recompute_table(rows, budget, a.budget_mbs, a.seq)}\n", flush=True)
    result["total_s"] = time.perf_counter() - t_all
    print(f"total {result['total_s']:.0f} s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
