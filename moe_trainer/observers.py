"""What the training loop reports, as one component: it watches the steps and changes nothing.

    open(step, resumed_from)   the metric sink (metrics.jsonl, TensorBoard), a restart row if restarted
    add_step(record)           every step: its time split, averaged over the steps to the next log step; a profiled
                               window's last step: its trace and split written, a line, a `profile` event row
    begin_step(step)           before a step: the noise scale's hooks, on the steps that measure it; the profiler's
                               range (debug.profile_steps, profiling.py)
    noise_scale(skipped)       after a step: the gradient noise scale's estimate (collective, on logged steps)
    step_record(...)           at log steps: throughput, MFU, losses, noise scale, expert load, bytes
    write(step, record)        rank 0 writes it (metrics.jsonl, TensorBoard, the console)
    event(step, row)           an event row (rollback, replica_mismatch, straggler, nan, ...)

Only rank 0 holds a sink; every rank runs the collectives (noise scale, expert load).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from .config import Config
from .metrics import Interval, MetricSink, peak_memory_gb, train_flops_per_token
from .noise_scale import NoiseScaleMeter
from .parallel.mesh import Mesh
from .profiling import StepProfiler
from .run_dir import RESTART_ENV


class Observers:
    def __init__(self, cfg: Config, mesh: Mesh, engine, expert_load, device: torch.device, peak: float):
        t = cfg.train
        self.cfg, self.mesh, self.layout, self.engine, self.device = cfg, mesh, mesh.layout, engine, device
        self.out_dir = Path(cfg.run.out_dir)
        self.is_logger = mesh.rank == 0
        # the critical batch size, measured on the logged steps (metrics.noise_scale; noise_scale.py)
        self.noise_meter = NoiseScaleMeter(engine, mesh, self.layout.grad_accum,
                                           t.micro_batch_size * t.seq_len / self.layout.cp,
                                           t.global_batch_size * t.seq_len, cfg.metrics.noise_scale_alpha,
                                           cfg.metrics.noise_scale, every=t.log_every, last=t.max_steps)
        self.noise = self.noise_meter.noise
        self.expert_load = expert_load  # the trainer's ExpertLoadTracker: its summaries at log steps
        self.flops_per_token = train_flops_per_token(cfg.model, t.seq_len)
        self.peak = peak
        self.sink: Optional[MetricSink] = None
        self.sink_steps = 0  # steps this process has logged
        self.interval = Interval()  # the steps since the last log step: their figures are logged as means
        self.profiler = StepProfiler(cfg.debug.profile_steps, cfg.debug.profile_ranks, mesh.rank, device, self.out_dir)

    def open(self, step: int, resumed_from: Optional[Path]) -> None:
        """After resuming: metrics past the resumed step (from the interrupted run) are dropped. A job
        that moe_trainer.restart started again says so in a restart row."""
        if not self.is_logger:
            return
        window = self.cfg.debug.profile_steps
        if window and window[1] <= step:
            print(f"debug.profile_steps {window}: the run resumed at step {step}, after the window; nothing is "
                  f"profiled", flush=True)
        self.sink = MetricSink(self.out_dir, self.cfg.metrics.tensorboard, self.cfg.train.max_steps,
                               resume_step=step)
        restart = os.environ.get(RESTART_ENV)  # read once, at start: set by the restart wrapper
        if restart:
            attempt, code = restart.split(":")
            self.sink.log(step, {"event": "restart", "attempt": int(attempt), "exit_code": int(code),
                                 "resumed_from": str(resumed_from) if resumed_from else None},
                          tb_prefix="events/restart/")

    def close(self) -> None:
        self.report_profile(self.profiler.close())  # the loop stopped inside the profiled window
        if self.sink:
            self.sink.close()

    def event(self, step: int, row: dict, tb_prefix: str = "") -> None:
        if self.sink:
            self.sink.log(step, row, tb_prefix=tb_prefix)

    # ------------------------------------------------------------------ every step
    def add_step(self, r: dict) -> None:
        self.interval.add(self.step_figures(r))
        self.report_profile(self.profiler.end())

    def report_profile(self, summary: Optional[dict]) -> None:
        """A profiled rank's window, written (profiling.StepProfiler): one console line from each profiled rank;
        rank 0's means also as a `profile` event row."""
        if summary is None:
            return
        m, steps = summary["mean"], summary["steps"]
        kinds = ", ".join(f"{k} {m[f'{k}_s']:.3f}" for k in ("gemm", "attention", "communication", "other"))
        print(f"profile rank {self.mesh.rank} steps {steps[0]['step']}-{steps[-1]['step']}: {m['wall_s']:.3f} s a "
              f"step, the {summary['device']} busy {m['busy_s']:.3f} s ({kinds}), idle {m['idle_s']:.3f} s, "
              f"{m['kernels']:.0f} kernels; trace {self.out_dir}/profile/{summary['trace']}", flush=True)
        self.event(steps[-1]["step"], {"event": "profile", "rank": self.mesh.rank, "device": summary["device"],
                                       **{f"profile.{k}": v for k, v in m.items()}})

    def step_figures(self, r: dict) -> dict:
        """The step's time and its split (what Interval averages between log steps)."""
        seconds = r["comm"].get("seconds", {})
        # the split's share of the dispatch/combine all-to-alls (forward and backward); overlapped ones
        # (parallel.overlap=a2a, a2a_async.py) are timed from issue to completion as "overlapped_<kind>",
        # and the time a rank waited for them as "a2a_wait"
        ep_kinds = ("dispatch", "combine", "overlapped_")
        blocking = sum(s for k, s in seconds.items() if k.startswith(ep_kinds[:2]))
        a2a = blocking + sum(s for k, s in seconds.items() if k.startswith(ep_kinds[2]))
        out = {"step_time_s": r["step_time"], **r["times"].as_dict()}
        # inside compiled layers (train.compile) the all-to-alls are counted but not timed (no clock
        # mark in a graph): then no figure rather than 0
        moved = any(k.startswith(ep_kinds) for k in r["comm"].get("sent", {}))
        if any(k.startswith(ep_kinds) for k in seconds) or not moved:
            out["time.all_to_all_s"] = a2a
            # the split tools/plan.py --time predicts: a blocking all-to-all's whole time is exposed wait,
            # an overlapped one's only the time a rank waited for it; the rest is compute
            exposed = blocking + seconds.get("a2a_wait", 0.0)
            out["time.compute_s"] = max(0.0, out["time.forward_s"] + out["time.backward_s"] - exposed)
            out["time.exposed_all_to_all_s"] = exposed
        return out

    def begin_step(self, step: int) -> None:
        """Before step `step`'s first forward: the noise scale's hooks, on the steps that measure it; the
        profiler's range around the step, in the profiled window."""
        self.profiler.begin(step)
        self.noise_meter.begin(step)

    def noise_scale(self, skipped: bool) -> None:
        """After the optimizer step: the gradient noise scale's estimate, on the steps that measure it
        (collective then, on every rank alike)."""
        self.noise_meter.end(skipped, self.device)

    # ------------------------------------------------------------------ log steps
    def step_record(self, r: dict, step: int, lr: float, source_samples: dict) -> dict:
        """The log step's record: throughput, MFU and the step-time split as means over the steps
        since the last log step (`interval_steps` of them), this step's own time beside them."""
        t = self.cfg.train
        tokens = t.global_batch_size * t.seq_len
        steps, means = self.interval.take()  # this step included: the loop adds every step before it logs
        step_time = means["step_time_s"]
        tflops = self.flops_per_token * tokens / self.layout.world / step_time / 1e12
        record = {"loss": r["losses"]["lm"], "skipped": int(r["skipped"]),
                  **{f"loss_{k}": v for k, v in r["losses"].items() if k != "lm"},
                  "lr": lr, "grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
                  "tokens_per_s": tokens / step_time, "tokens_per_s_per_rank": tokens / step_time / self.layout.world,
                  "tflops_per_rank": tflops, "mfu": tflops / self.peak, "peak_tflops": self.peak,
                  "memory_gb": peak_memory_gb(self.device), **means, "interval_steps": steps,
                  "step_time_last_s": r["step_time"], "tokens_per_s_last": tokens / r["step_time"]}
        record["global_batch_tokens"] = tokens
        record["source_samples"] = source_samples
        if self.noise.steps:
            record.update({"noise_scale_tokens": self.noise.value, "noise.grad_sq": self.noise.grad_sq,
                           "noise.trace_sigma": self.noise.trace_sigma})
        if r["expert"] is not None:
            record.update(self.expert_load.metrics(r["expert"], self.sink, self.out_dir, step))
        for kind, sent in r["comm"]["sent"].items():  # this rank's bytes in the last step
            record[f"comm.{kind}_sent_bytes"] = sent
            record[f"comm.{kind}_received_bytes"] = r["comm"]["received"][kind]
        for kind, s in r["comm"].get("seconds", {}).items():  # this rank's seconds in the last step
            record[f"comm.{kind}_s"] = s
        return record

    def write(self, step: int, record: dict) -> None:
        self.sink_steps += 1
        if self.sink:
            self.sink.log(step, record)
            self.sink.progress(step, record)
