"""The training loop around a DeepSpeed ZeRO-1 engine.

The trainer does not know which model it trains: it gets one from the registry
by model.arch, applies the layout's parallelism, and drives steps. Order of a
step: data -> forward/backward per micro-batch -> optimizer step -> expert-bias
update from globally summed counts (expert_load/tracker.py) -> metrics -> eval -> checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from . import checkpoint, run_dir
from .restart import RESTART_ENV
from .faults import (Faults, ReplicaCheck, SpikeGuard, owner_drift, owner_partitions, parse_faults, repair_from_owners,
                     straggler_events)
from .config import Config, Layout, TrainConfig
from .data import DataError, MixtureSource, open_run_data, run_data_dir
from .data.documents import document_ids, document_positions
from .expert_load.tracker import ExpertLoadTracker
from .hf import load_initial_weights
from .metrics import Interval, MetricSink, StepClock, peak_memory_gb, peak_tflops, train_flops_per_token
from .models.init import materialize
from .compile import compile_regions, forward_waits_timed
from .models.registry import build_model
from .noise_scale import NoiseScaleMeter
from .parallel.comm import (CommCounter, all_reduce_small, count_deepspeed_collectives, enable_shm_transport,
                            route_deepspeed_collectives)
from .parallel.context import shard_sequence
from .parallel.launch import progress
from .parallel.mesh import DeepSpeedMPU, Mesh
from .parallel.pipeline import PipelineExecutor, Trace, build_stage
from .kernels.cpu.shm_alltoall import P2P_RING_BYTES, RING_BYTES, SMALL_RING_BYTES
from .parallel.parallelize import parallelize
from .parallel.zero import build_engine, set_lr


class TrainingHalted(RuntimeError):
    """Training stopped by policy (e.g. repeated non-finite losses): one sentence, exit 3."""


class NothingLeft(Exception):
    """The run already reached train.max_steps: one sentence, exit 0."""


def get_lr(step: int, t: TrainConfig) -> float:
    """Linear warm-up to train.lr, then cosine decay to train.min_lr at max_steps."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def loss_keys(m) -> list[str]:
    keys = ["lm"]
    if m.arch == "deepseek_v3" and m.num_nextn_predict_layers:
        keys.append("mtp")
    if m.arch == "deepseek_v3" and (m.seq_aux_loss_alpha > 0 or m.router_z_loss_coef > 0):
        keys.append("aux")
    return keys


@dataclass
class StepTimes:
    data: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    pipeline_wait: float = 0.0

    def as_dict(self) -> dict:
        return {f"time.{k}_s": v for k, v in self.__dict__.items()}


class Trainer:
    def __init__(self, cfg: Config, mesh: Mesh, device: torch.device, start: Optional[run_dir.Start] = None):
        """`start`: what moe_trainer.train decided before the process group (the checkpoint to
        resume, the config's changes); None decides it here (find_checkpoint), counting every key as given."""
        self.cfg, self.mesh, self.device, self.start = cfg, mesh, device, start
        planned = start is not None  # a training start (moe_trainer.train), not a tool's (reshard, dry run)
        self.layout: Layout = mesh.layout
        self.is_logger = mesh.rank == 0
        self.out_dir = Path(cfg.run.out_dir)
        self.dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
        t = cfg.train
        # val_data: {name: batches}, one per mixture source (or data.val_sources entry), or data.path's one
        self.data_index, self.train_data, self.val_data = open_run_data(cfg.data, t.seq_len, cfg.run.seed,
                                                                        cfg.model.vocab_size)
        self.eos_id = self.data_index.get("eos_id") if cfg.data.document_mask else None  # documents end there
        if cfg.data.document_mask and self.eos_id is None:
            what = cfg.data.path or ("data.sources" if cfg.data.sources else "the default corpus")
            raise DataError(f"data.document_mask needs the data's end-of-text id, which the index of {what} does "
                            f"not give; prepare it again with tools/prepare_data.py, or set data.document_mask: false.")
        # built on the meta device; parallelism slices it and this rank materialises only its
        # stage, its experts and its TP shards (models/init.py)
        self.clock = StepClock(device)  # phase and transfer times: CUDA events on a GPU
        self.comm = CommCounter(self.clock, device)  # its in-graph counts on the device (compiled layers)
        self.model = parallelize(build_model(cfg.model, cfg.run.seed, materialized=False), cfg, mesh, self.comm)
        shm = cfg.parallel.cpu_alltoall == "shm" and dist.is_initialized() and self.layout.world > 1
        if shm:
            self._enable_shm_collectives()
        self.pipelined = self.layout.pp > 1
        if self.pipelined and cfg.parallel.cpu_p2p == "shm" and dist.is_initialized():
            # the stages' transfers through /dev/shm rings (CPU ranks of one host; a no-op on NCCL); the
            # stage group's small all-reduces (losses, expert counts) follow them on the same rings, in
            # the same order on every rank, as on one NCCL communicator
            enable_shm_transport(mesh.group("pp"), ring_bytes=P2P_RING_BYTES, timeout_s=cfg.parallel.timeout_s)
        if self.pipelined:
            self.model = build_stage(self.model, cfg, mesh.coord["pp"], t.seq_len)
        materialize(self.model, cfg.run.seed, cfg.model.initializer_range)
        # decided once, before any weights are read: a resume never reads train.init_from (at 671B a
        # whole Hugging Face checkpoint, which may be gone by then); init_from is read when no
        # checkpoint is usable, auto-resume's fallback past damaged ones included
        self.resume_from = self.find_checkpoint()
        if planned and self.resume_from is not None and checkpoint.step_of(self.resume_from) >= t.max_steps:
            raise NothingLeft(run_dir.finished_sentence(cfg, self.resume_from))  # before the engine is built
        if t.init_from and self.resume_from is None:
            load_initial_weights(self.model, t.init_from)
        if t.compile:  # after the weights are in place, before the engine wraps the model
            regions = compile_regions(self.model, backend=t.compile_backend)
            if self.is_logger:  # each region compiles at its first call: step 1's time holds the compile
                print(f"torch.compile ({t.compile_backend}): {len(regions)} regions on this stage "
                      f"({', '.join(regions)}); they compile at their first call, in step 1", flush=True)
        self.engine = build_engine(self.model, cfg, self.layout, mpu=DeepSpeedMPU(mesh))
        if shm:
            route_deepspeed_collectives()
        # ZeRO's gradient reductions and parameter gathers, counted like the all-to-alls
        # (where edp and dpcp are one group, at ep 1, its traffic counts as dp)
        count_deepspeed_collectives(self.comm, {mesh.group("edp"): "edp", mesh.group("dpcp"): "dp"})
        self.executor = self._build_executor() if self.pipelined else None
        # the critical batch size, measured on the logged steps (metrics.noise_scale; noise_scale.py)
        self.noise_meter = NoiseScaleMeter(self.engine, mesh, self.layout.grad_accum,
                                           t.micro_batch_size * t.seq_len / self.layout.cp,
                                           t.global_batch_size * t.seq_len, cfg.metrics.noise_scale_alpha,
                                           cfg.metrics.noise_scale, every=t.log_every, last=t.max_steps)
        self.noise = self.noise_meter.noise
        self.expert_load = ExpertLoadTracker(cfg.model, self.model, mesh, device)
        self.loss_keys = loss_keys(cfg.model)
        self.step = 0
        self.sink: Optional[MetricSink] = None
        self.flops_per_token = train_flops_per_token(cfg.model, t.seq_len)
        self.peak, self.peak_source = peak_tflops(cfg.metrics.peak_tflops, self.dtype, device)
        self._stopping = False
        self._term = False
        self._nan_skips = 0
        # the faults of a long run (faults.py); None when unset, so the loop makes no call for them
        self.faults = (Faults(parse_faults(cfg.debug.faults, self.layout.world), self.out_dir, mesh.rank)
                       if cfg.debug.faults else None)
        self.replicas = ReplicaCheck(self.engine.module, mesh, t.replica_check_every)
        self.replicas = self.replicas if self.replicas.sets and t.replica_check_every else None
        self.owners = owner_partitions(self.engine) if self.replicas else None  # (fp32 master, model slice)
        self.last_checked: Optional[int] = None  # the newest step whose state passed the replica check
        self.spikes = SpikeGuard() if t.spike_guard else None
        self.rolled_back_to: Optional[int] = None  # the checkpoint step of the last rollback
        self.data_offset = 0  # batches skipped by rollbacks: step s trains on sample position s + offset
        self.sink_steps = 0  # steps this process has logged
        self.interval = Interval()  # the steps since the last log step: their figures are logged as means

    # ------------------------------------------------------------------ setup
    def _enable_shm_collectives(self) -> None:
        """Shared-memory transports for the groups whose collectives are not the EP all-to-alls:
        DeepSpeed's ZeRO reductions and gathers over the data-parallel and expert-data-parallel
        groups (large rings: megabytes of gradients), its norm all-reduce over the model-parallel
        group and our per-step loss, expert-count and noise-scale all-reduces and stop flag (small
        rings). Collective, in the same order on every rank; a group any of whose ranks cannot use
        shared memory stays on gloo. Once the engine exists, route_deepspeed_collectives() sends
        deepspeed.comm's calls on these groups there."""
        t = self.cfg.parallel.timeout_s
        enabled = []  # kinds with the same ranks share one process group (build_mesh): one transport each
        for kind, ring in (("dpcp", RING_BYTES), ("edp", RING_BYTES), ("mp", SMALL_RING_BYTES)):
            group = self.mesh.group(kind)
            if group is not None and all(group is not g for g in enabled):
                enable_shm_transport(group, ring_bytes=ring, timeout_s=t)
                enabled.append(group)
        enable_shm_transport(None, ring_bytes=SMALL_RING_BYTES, timeout_s=t)

    def find_checkpoint(self) -> Optional[Path]:
        """The checkpoint this start resumes, or None. Decides the start if moe_trainer.train did not
        (plan_start chose a checkpoint from its manifest and sizes); each rank then checks the
        checksums of the files its model's blocks are read from, and all agree: a damaged one is
        refused, and train.resume=auto falls back to an older one or to none. Collective."""
        if self.start is None:
            self.start = run_dir.plan_start(self.cfg, None, warn=self.is_logger)
            self.start.resume = self.cfg.train.resume
        if self.start.checkpoint is None:
            return None
        resume = "auto" if self.start.resume == "auto" else str(self.start.checkpoint)
        found = checkpoint.find_resume(self.out_dir, resume, warn=self.is_logger,
                                       files_read=lambda path: checkpoint.files_to_read(path, self.model,
                                                                                        self.mesh.rank),
                                       any_rank=self.any_rank, warned=self.start.warned)
        if found != self.start.checkpoint:  # the checksums refused plan_start's pick: the run directory's
            self.start.checkpoint = found   # history and the console say what this start really resumes
            self.start.fresh_over = found is None and (self.out_dir / "config.yaml").is_file()
        return found

    def prepare_run_dir(self) -> None:
        """Rank 0 records the start (config_history.jsonl, config.yaml, the tokenizer, the MFU peak)
        and says what it decided."""
        if self.is_logger:
            run_dir.set_aside_records(self.start)
            run_dir.print_lines(run_dir.describe(self.start))
            run_dir.record_start(self.start, self.layout.world, (self.peak, self.peak_source),
                                 run_data_dir(self.cfg.data))
        if dist.is_initialized() and self.layout.world > 1:  # its barriers: rank 0's records are written
            run_dir.check_shared(self.out_dir, self.mesh.rank, self.layout.world, self.device)

    def open_sink(self) -> None:
        """After resuming: metrics past the resumed step (from the interrupted run) are dropped. A job
        that moe_trainer.restart started again says so in a restart row."""
        if self.is_logger:
            self.sink = MetricSink(self.out_dir, self.cfg.metrics.tensorboard, self.cfg.train.max_steps,
                                   resume_step=self.step)
            restart = os.environ.get(RESTART_ENV)  # read once, at start: set by the restart wrapper
            if restart:
                attempt, code = restart.split(":")
                self.sink.log(self.step, {"event": "restart", "attempt": int(attempt), "exit_code": int(code),
                                          "resumed_from": str(self.resume_from) if self.resume_from else None},
                              tb_prefix="events/restart/")

    def barrier(self) -> None:
        if dist.is_initialized() and self.layout.world > 1:
            dist.barrier()

    def maybe_resume(self) -> None:
        """Load the checkpoint find_checkpoint chose, if any."""
        if self.resume_from is not None:
            self.step = checkpoint.load(self.resume_from, self)
            if self.is_logger:
                print(f"resumed from {self.resume_from} at step {self.step}", flush=True)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict:
        self.prepare_run_dir()
        self.maybe_resume()
        if self.is_logger:
            print(run_dir.banner(self, self.start), flush=True)
        self.open_sink()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        t = self.cfg.train
        last = {}
        while self.step < t.max_steps and not self._stopping:
            progress(self.step + 1, "start")  # heartbeats: a hung rank is named by where it stopped
            if self.faults:
                self.faults.before_step(self.step + 1)
            if self.replicas and self.replicas.due(self.step):
                progress(self.step + 1, "replica check")
                self.check_replicas()
            progress(self.step + 1, "forward, backward and optimizer")
            record = self.train_step()
            self.step += 1
            self.interval.add(self.step_figures(record))
            progress(self.step, "losses, logging and evaluation")
            if self.faults:
                self.flip_bit()
            self.check_finite(record)
            if self.spikes and not record["skipped"] and self.guard_spike(record):
                continue  # rolled back: the step counter is the checkpoint's now
            self._stopping = self.any_rank(self._term) or self.step == t.stop_at_step
            if self.step % t.log_every == 0 or self.step == t.max_steps or record["skipped"]:
                last = self.log(record)
            if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.max_steps):
                losses = self.evaluate_sources()
                last.update(losses)
                if self.sink:
                    self.sink.log(self.step, losses)
                    print(f"step {self.step}/{t.max_steps} | " + " | ".join(f"{k} {v:.4f}" for k, v in losses.items()),
                          flush=True)
            if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or self.step == t.max_steps \
                    or self._stopping:
                progress(self.step, "checkpoint")
                self.save_checkpoint()
        if self.pipelined and self.trace.enabled:
            self.write_pipeline_trace()
        if self.sink:
            self.sink.close()
        if self._term and self.is_logger:
            print(f"stopped by SIGTERM after step {self.step}; checkpoint written, resume with train.resume=auto",
                  flush=True)
        return last

    def save_checkpoint(self) -> None:
        """checkpoint.save (collective), and one console line from rank 0: step, path, size, seconds."""
        started = time.perf_counter()
        path = checkpoint.save(self)
        if path is not None:
            files = json.loads((path / checkpoint.MANIFEST).read_text())["files"]
            size = sum(f["bytes"] for f in files.values())
            print(f"checkpoint step {self.step}: {path} ({size / 1e6:,.1f} MB in {len(files)} files, "
                  f"{time.perf_counter() - started:.1f} s)", flush=True)

    # ------------------------------------------------------------------ failures
    def _on_sigterm(self, signum, frame) -> None:
        """Schedulers send SIGTERM before preemption: finish this step, checkpoint, exit."""
        self._term = True

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is true on any (one tiny all-reduce per step)."""
        if not (dist.is_initialized() and self.layout.world > 1):
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        all_reduce_small(t, op="max")
        return bool(t.item())  # host sync

    def check_finite(self, record: dict) -> None:
        """NaN/inf loss policy: the optimizer skipped the step (DeepSpeed skips
        non-finite gradient norms); allow max_nan_skips in a row, then stop with a
        checkpoint of the last good state (unchanged by the skipped steps)."""
        if not record["skipped"]:
            self._nan_skips = 0
            return
        self._nan_skips += 1
        limit = self.cfg.train.max_nan_skips
        if self.is_logger:
            print(f"warning: step {self.step}: non-finite loss ({record['losses']['lm']}); step skipped "
                  f"({self._nan_skips} in a row, train.max_nan_skips={limit})", file=sys.stderr, flush=True)
        if self._nan_skips > limit:
            self.step -= self._nan_skips  # the weights are those after the last good step
            self.save_checkpoint()
            raise TrainingHalted(f"stopped at step {self.step + self._nan_skips}: {self._nan_skips} non-finite "
                                 f"losses in a row (train.max_nan_skips={limit}); the last good state is "
                                 f"checkpoint step_{self.step}.")

    # ------------------------------------------------------------------ faults that do not kill
    def flip_bit(self) -> None:
        """bitflip@S:R and bitflip_master@S:R, right after step S's update."""
        name = self.faults.after_update(self.step, self.engine.module)
        if name is not None:
            print(f"fault injected: rank {self.mesh.rank}: one bit flipped in {name} after step {self.step}",
                  file=sys.stderr, flush=True)
        if self.faults.after_update_master(self.step, self.engine) is not None:
            print(f"fault injected: rank {self.mesh.rank}: one bit flipped in its ZeRO-1 fp32 master partition "
                  f"after step {self.step}", file=sys.stderr, flush=True)

    def check_replicas(self) -> None:
        """Before this step's forward: do the replicas agree, and does every ZeRO-1 owner's fp32
        partition still match the model copy it wrote? A replica that differs is repaired from the
        owners' partitions (and the ranks whose copy changed are named); an owner's partition that
        differs while every replica agrees is the corrupt copy, with nothing to repair it from: the
        run rolls back. Collective; one host sync (a single fault at a time: a replica that differs
        in the owner's own slice explains that owner's drift too, so the repair comes first)."""
        flags = torch.stack([self.replicas.mismatched(), owner_drift(self.owners)]).to(torch.float32)
        if self.layout.world > 1:
            all_reduce_small(flags, op="max")
        replica_bad, owner_bad = flags.tolist()  # host sync, once per check
        if replica_bad:
            self.repair_replicas()
        elif owner_bad:
            self.roll_back_corrupt_owner()
        else:
            self.last_checked = self.step

    def repair_replicas(self) -> None:
        """Every rank's weights gathered again from the owners' partitions; the ranks whose copy
        changed are named. Collective."""
        before = self.replicas.local_sums()
        repair_from_owners(self.engine)
        changed = self.replicas.changed(before)
        reports = [None] * self.layout.world
        dist.all_gather_object(reports, changed)
        ranks = [r for r, names in enumerate(reports) if names]
        params = sorted({n for names in reports for n in names})
        if self.is_logger:
            event = {"event": "replica_mismatch", "ranks": ranks, "params": params, "action": "repaired"}
            print(f"replica mismatch before step {self.step + 1}: rank(s) {ranks} held a copy that differs in "
                  f"{len(params)} parameter(s) ({', '.join(params[:3])}{', ...' if len(params) > 3 else ''}); "
                  f"repaired from the ZeRO-1 owners' partitions", file=sys.stderr, flush=True)
            if self.sink:
                self.sink.log(self.step, event)

    def roll_back_corrupt_owner(self) -> None:
        """An owner's fp32 partition differs from the weights every replica holds: back to the newest
        checkpoint at or before the last step that passed the check (the state after it was written
        is the one that check saw), the same batches replayed. Collective."""
        mine = bool(owner_drift(self.owners).item())  # host sync, on this rare path only
        reports = [None] * self.layout.world
        dist.all_gather_object(reports, mine)
        ranks = [r for r, bad in enumerate(reports) if bad]
        found_at = self.step
        reason = (f"the ZeRO-1 fp32 master partition of rank(s) {ranks} differs from the weights every replica "
                  f"holds (found before step {found_at + 1})")
        at_most = self.last_checked if self.last_checked is not None else found_at - 1
        found = checkpoint.find_resume(self.out_dir, "auto", warn=self.is_logger, at_most=at_most,
                                       files_read=lambda path: checkpoint.files_to_read(path, self.model,
                                                                                        self.mesh.rank),
                                       any_rank=self.any_rank)
        if found is None:
            raise TrainingHalted(f"stopped before step {found_at + 1}: {reason}, and no checkpoint from step "
                                 f"{at_most} or before is there to roll back to.")
        self.step = checkpoint.load(found, self)  # the batches after it are trained again, not skipped
        if self.spikes:
            self.spikes.reset()
        event = {"event": "rollback", "to": self.step, "skipped_steps": [], "ranks": ranks,
                 "cause": "owner_partition", "reason": reason}
        if self.is_logger:
            print(f"{reason}; rolled back to {found}, training steps {self.step + 1}-{found_at} again",
                  file=sys.stderr, flush=True)
            if self.sink:
                self.sink.log(found_at, event, tb_prefix="events/rollback/")

    def guard_spike(self, record: dict) -> bool:
        """A loss or gradient-norm spike (the same on every rank: both are reduced) rolls the run
        back to the last checkpoint before it, skipping the batches that led into it; a second
        spike before a newer checkpoint stops the run. True if it rolled back."""
        norm = self.engine.get_global_grad_norm()
        reason = self.spikes.check(record["losses"]["lm"], float(norm) if norm is not None else None)  # host sync
        if reason is None:
            return False
        spiked = self.step
        if self.rolled_back_to is not None and not (self.out_dir / "checkpoints" /
                                                    f"step_{self.rolled_back_to}").is_dir():
            self.rolled_back_to = None  # pruned: a newer checkpoint came after the last rollback
        found = checkpoint.find_resume(self.out_dir, "auto", warn=self.is_logger, at_most=spiked - 2,
                                       files_read=lambda path: checkpoint.files_to_read(path, self.model,
                                                                                        self.mesh.rank),
                                       any_rank=self.any_rank)
        if self.rolled_back_to is not None and (found is None or checkpoint.step_of(found) <= self.rolled_back_to):
            raise TrainingHalted(f"stopped at step {spiked}: {reason}, again after rolling back to step "
                                 f"{self.rolled_back_to}; the last good state is "
                                 f"{found if found is not None else 'not in a checkpoint'}.")
        if found is None:  # nothing to go back to (train.checkpoint_every 0, or none written yet): say so
            if self.is_logger:
                print(f"warning: loss spike at step {spiked}: {reason}; no checkpoint from before it to roll back "
                      f"to, training on", file=sys.stderr, flush=True)
                if self.sink:
                    self.sink.log(spiked, {"event": "spike", "reason": reason, "action": "none: no checkpoint"})
            return False
        skip_from = checkpoint.step_of(found) + 1
        self.step = checkpoint.load(found, self)  # restores data_offset as it was then
        self.data_offset += spiked - self.step  # and skips the batches of steps skip_from..spiked
        self.rolled_back_to = self.step
        self.spikes.reset()
        event = {"event": "rollback", "to": self.step, "skipped_steps": [skip_from, spiked], "reason": reason}
        if self.is_logger:
            print(f"loss spike at step {spiked}: {reason}; rolled back to {found} and skipping the batches of "
                  f"steps {skip_from}-{spiked}", file=sys.stderr, flush=True)
            if self.sink:
                self.sink.log(spiked, event, tb_prefix="events/rollback/")
        return True

    def micro_batch(self, micro: int, source=None, step: Optional[int] = None):
        """(inputs, labels, positions, documents) of this rank's micro-batch: every tp rank of
        a data-parallel rank reads the same rows; a cp rank keeps its two chunks. Training batches
        are at sample position step + data_offset (batches a rollback skipped stay skipped).
        documents: None, or with data.document_mask the (B, T) int32 document ids of the whole
        window (a cp rank's attention picks its chunks' rows); data.position_reset makes the
        positions (B, T), restarting at each document."""
        t = self.cfg.train
        if source is None and self.faults and micro == 0:
            time.sleep(self.faults.slow_delay(self.step + 1))  # slow@S:R: this rank's batch comes late
        position = self.step + self.data_offset if step is None else step
        source = source or self.train_data
        batch = source.micro_batch(position, micro, t.global_batch_size,
                                   t.micro_batch_size, self.mesh.dp_rank, self.layout.dp)
        if self.device.type != "cpu":  # page-locked, so the copy runs asynchronously to the host
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        positions = torch.arange(t.seq_len, device=self.device)
        documents = None
        if self.eos_id is not None:  # on the device, from the whole window
            documents = document_ids(inputs, self.eos_id)
            if self.cfg.data.position_reset:
                positions = document_positions(documents)
        if self.layout.cp > 1:
            cp, i = self.layout.cp, self.mesh.index("cp")
            inputs, labels = shard_sequence(inputs, cp, i), shard_sequence(labels, cp, i)
            positions = shard_sequence(positions, cp, i, dim=positions.dim() - 1)
        return inputs, labels, positions, documents

    def _build_executor(self) -> PipelineExecutor:
        t, m, p = self.cfg.train, self.cfg.model, self.cfg.parallel
        width = m.hidden_size * (2 if m.arch == "deepseek_v3" and m.num_nextn_predict_layers else 1)
        tokens = t.seq_len // p.cp // (p.tp if p.tp > 1 and p.sequence_parallel else 1)  # a sequence shard
        self.trace = Trace(enabled=self.cfg.debug.trace_pipeline)
        return PipelineExecutor(self.engine, self.model, self.mesh, self.layout.grad_accum,
                                (t.micro_batch_size, tokens, width), self.dtype, self.device, schedule=p.schedule,
                                trace=self.trace, counter=self.comm, clock=self.clock)

    def train_step(self) -> dict:
        spike = self.faults.lr_factor(self.step + 1) if self.faults else 1.0  # spike@S: a diverging update
        set_lr(self.engine, get_lr(self.step, self.cfg.train) * spike)
        self.noise_meter.begin(self.step + 1)
        poison = self._poisoned()
        if self.pipelined:
            return self.pipeline_step(poison)
        t0 = time.perf_counter()
        sums: dict[str, torch.Tensor] = {}
        marks = []  # per micro-batch: (start, data, forward, backward, optimizer) clock marks
        for micro in range(self.layout.grad_accum):
            ta = self.clock.mark()
            batch = self.micro_batch(micro)  # (inputs, labels, positions, documents)
            tb = self.clock.mark()
            out = self.engine(*batch)
            if poison:
                out.loss, out.losses["lm"] = out.loss * float("nan"), out.losses["lm"] * float("nan")
            tc = self.clock.mark()
            self.engine.backward(out.loss)
            td = self.clock.mark()
            self.engine.step()  # the optimizer step happens at the accumulation boundary
            marks.append((ta, tb, tc, td, self.clock.mark()))
            for k, v in out.losses.items():
                sums[k] = sums.get(k, 0.0) + v.float()
        record = self.finish_step(sums, StepTimes(), t0)  # ends in a host sync: every mark is done now
        times = record["times"]
        for ta, tb, tc, td, te in marks:
            times.data += self.clock.seconds(ta, tb)
            times.forward += self.clock.seconds(tb, tc)
            times.backward += self.clock.seconds(tc, td)
            times.optimizer += self.clock.seconds(td, te)
        return record

    def _poisoned(self) -> bool:
        """This step's loss made non-finite on the last rank (debug.inject_nan_steps, or nan@S)."""
        steps = self.cfg.debug.inject_nan_steps
        planned = bool(steps) and (self.step + 1) in steps
        fault = self.faults is not None and self.faults.poison(self.step + 1)
        return (planned or fault) and self.mesh.rank == self.layout.world - 1

    def finish_step(self, sums: dict, times: StepTimes, t0: float) -> dict:
        losses = self.reduce_losses({k: v / self.layout.grad_accum for k, v in sums.items()})
        skipped = not all(math.isfinite(v) for v in losses.values())
        self.noise_meter.end(skipped, self.device)
        expert = self.expert_load.update_bias(apply=not skipped)
        step_time = time.perf_counter() - t0  # after reduce_losses' host sync: the step's kernels are done
        return {"losses": losses, "times": times, "step_time": step_time, "expert": expert,
                "comm": self.comm.reset(self.clock), "skipped": skipped}

    def pipeline_step(self, poison: bool) -> dict:
        if self.trace.enabled:
            self.barrier()  # a common start, so the trace's stages line up (only when tracing)
        t0 = time.perf_counter()
        self.trace.start(self.clock)
        self.executor.poison = poison
        res = self.executor.step(self.micro_batch)
        record = self.finish_step(res.losses, StepTimes(), t0)  # ends in a host sync: every mark is done now
        times = record["times"]
        times.forward, times.backward, times.pipeline_wait = (res.seconds(self.clock, k)
                                                              for k in ("forward", "backward", "wait"))
        self.trace.resolve()
        return record

    def write_pipeline_trace(self) -> None:
        """Gather the last step's events of one pipeline (data-parallel index 0) to rank 0."""
        events = [None] * self.layout.world
        dist.all_gather_object(events, (self.mesh.coord, self.trace.events))
        if self.is_logger:
            from .pipeline_trace import write_trace
            stages = [ev for coord, ev in events if coord["dp"] == 0 and coord["tp"] == 0 and coord["cp"] == 0]
            v = self.cfg.parallel.virtual_stages
            summary = write_trace(self.out_dir, stages, self.layout.grad_accum, self.step,
                                  schedule=self.cfg.parallel.schedule, chunks=v)
            print(f"pipeline bubble: {100 * summary['measured_bubble']:.1f}% measured, "
                  f"{100 * summary['theoretical_bubble']:.1f}% theoretical (p-1)/({'v*' if v > 1 else ''}m+p-1); "
                  f"trace in {self.out_dir / 'pipeline_trace.json'}", flush=True)

    def reduce_losses(self, values: dict) -> dict[str, float]:
        """Loss components summed over pipeline stages (each stage adds what it
        computed: the last stage the LM and MTP losses, every stage its MoE aux
        losses), then averaged over data-parallel ranks."""
        vec = torch.stack([torch.as_tensor(values.get(k, 0.0), dtype=torch.float32, device=self.device).detach()
                           .reshape(()) for k in self.loss_keys])
        if self.mesh.group("pp") is not None:
            all_reduce_small(vec, self.mesh.group("pp"))
        if self.mesh.group("dpcp") is not None:  # cp ranks hold equal shards: their mean is the mean
            all_reduce_small(vec, self.mesh.group("dpcp"))
            vec /= self.mesh.size("dpcp")
        return dict(zip(self.loss_keys, vec.tolist()))  # .tolist(): host sync, once per step

    # ------------------------------------------------------------------ eval and logging
    def evaluate_sources(self) -> dict[str, float]:
        """{"val_loss": ...} and, for a mixture, "val_loss/<name>" per validation set; val_loss is then
        their mean weighted as the mixture draws them (plain mean over data.val_sources)."""
        losses = {name: self.evaluate(val) for name, val in self.val_data.items()}
        if not self.cfg.data.sources:
            return {"val_loss": next(iter(losses.values()))}
        weights = {e["name"]: e["weight"] for e in self.cfg.data.sources}
        if self.cfg.data.val_sources:
            weights = {name: 1.0 for name in losses}
        total = sum(weights[n] for n in losses)
        return {"val_loss": sum(weights[n] * v for n, v in losses.items()) / total,
                **{f"val_loss/{n}": v for n, v in losses.items()}}

    @torch.no_grad()
    def evaluate(self, val=None) -> float:
        val = val if val is not None else next(iter(self.val_data.values()))
        t = self.cfg.train
        model = self.engine.module
        model.eval()
        total = torch.zeros((), device=self.device)
        for b in range(t.eval_batches):
            def get_batch(micro: int, b=b):
                return self.micro_batch(micro, val, b)
            if self.pipelined:
                total += self.executor.forward_only(get_batch).get("lm", 0.0)
            else:
                for micro in range(self.layout.grad_accum):
                    total += model(*get_batch(micro)).losses["lm"].float()
        model.train()
        return self.reduce_losses({"lm": total / (t.eval_batches * self.layout.grad_accum)})["lm"]

    def step_figures(self, r: dict) -> dict:
        """The step's time and its split (what Interval averages between log steps)."""
        seconds = r["comm"].get("seconds", {})
        # the split's share of the dispatch/combine all-to-alls (forward and backward)
        ep_kinds = ("dispatch", "combine")
        a2a = sum(s for k, s in seconds.items() if k.startswith(ep_kinds))
        out = {"step_time_s": r["step_time"], **r["times"].as_dict()}
        # inside compiled layers (train.compile) the all-to-alls are counted but not timed (no clock
        # mark in a graph): then no figure rather than 0
        moved = any(k.startswith(ep_kinds) for k in r["comm"].get("sent", {}))
        if any(k.startswith(ep_kinds) for k in seconds) or not moved:
            out["time.all_to_all_s"] = a2a
        return out

    def log(self, r: dict) -> dict:
        """The log step's record: throughput, MFU and the step-time split as means over the steps
        since the last log step (`interval_steps` of them), this step's own time beside them."""
        t = self.cfg.train
        tokens = t.global_batch_size * t.seq_len
        steps, means = self.interval.take()  # this step included: the loop adds every step before it logs
        step_time = means["step_time_s"]
        tflops = self.flops_per_token * tokens / self.layout.world / step_time / 1e12
        record = {"loss": r["losses"]["lm"], "skipped": int(r["skipped"]),
                  **{f"loss_{k}": v for k, v in r["losses"].items() if k != "lm"},
                  "lr": get_lr(self.step - 1, t), "grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
                  "tokens_per_s": tokens / step_time, "tokens_per_s_per_rank": tokens / step_time / self.layout.world,
                  "tflops_per_rank": tflops, "mfu": tflops / self.peak, "peak_tflops": self.peak,
                  "memory_gb": peak_memory_gb(self.device), **means, "interval_steps": steps,
                  "step_time_last_s": r["step_time"], "tokens_per_s_last": tokens / r["step_time"]}
        record["global_batch_tokens"] = tokens
        record["source_samples"] = self.source_samples()
        if self.noise.steps:
            record.update({"noise_scale_tokens": self.noise.value, "noise.grad_sq": self.noise.grad_sq,
                           "noise.trace_sigma": self.noise.trace_sigma})
        if r["expert"] is not None:
            record.update(self.expert_load.metrics(r["expert"], self.sink, self.out_dir, self.step))
        for kind, sent in r["comm"]["sent"].items():  # this rank's bytes in the last step
            record[f"comm.{kind}_sent_bytes"] = sent
            record[f"comm.{kind}_received_bytes"] = r["comm"]["received"][kind]
        for kind, s in r["comm"].get("seconds", {}).items():  # this rank's seconds in the last step
            record[f"comm.{kind}_s"] = s
        if self.layout.world > 1 and self.sink_steps > 0:  # a process's first step pays its one-time costs
            self.name_stragglers(r)
        self.sink_steps += 1
        if self.sink:
            self.sink.log(self.step, record)
            self.sink.progress(self.step, record)
        return record

    def source_samples(self) -> dict[str, int]:
        """{source name: training samples drawn from it so far}: global samples [0, data position *
        global batch), the batches a rollback skipped included (they were drawn)."""
        drawn = (self.step + self.data_offset) * self.cfg.train.global_batch_size
        if isinstance(self.train_data, MixtureSource):
            return self.train_data.drawn(drawn)
        return {next(iter(self.val_data)): drawn}

    def name_stragglers(self, r: dict) -> None:
        """Every rank's own compute time this step, gathered at log steps; ranks far above the median
        are named. Its own: loading its batches and its forward passes, less the time it spent inside
        the forward's collectives (the expert all-to-alls), where a rank waits for its slowest peer,
        so that at ep > 1 a straggler's EP peers do not look slow too. The backward is left out: ZeRO's
        bucketed gradient reduction runs inside it, where every rank waits for the slowest."""
        times = r["times"]
        waits = sum(s for kind, s in r["comm"].get("seconds", {}).items()
                    if not kind.endswith("_grad") and not kind.startswith("pp_"))
        # compiled at ep > 1 the waits are inside graphs, untimed: the forward is left out on every rank
        forward = times.forward - waits if forward_waits_timed(self.cfg) else 0.0
        mine = torch.tensor([max(times.data + forward, 0.0)], device=self.device)
        every = torch.empty(self.layout.world, device=self.device)
        dist.all_gather_into_tensor(every, mine)
        if not self.is_logger:
            return
        seconds = every.tolist()  # host sync, at log steps only
        if self.sink and self.sink.tb is not None and self.layout.world <= 64:
            for rank, t in enumerate(seconds):
                self.sink.tb.add_scalar(f"rank_time/{rank}", t, self.step)
        for event in straggler_events(seconds, self.step, self.cfg.train.straggler_factor):
            print(f"straggler at step {self.step}: rank {event['rank']} computed {event['ratio']}x the median "
                  f"rank's time", file=sys.stderr, flush=True)
            if self.sink:
                self.sink.log(self.step, {k: v for k, v in event.items() if k != "step"}, tb_prefix="events/straggler/")
