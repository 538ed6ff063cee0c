"""The training loop around a DeepSpeed ZeRO-1 engine.

The trainer does not know which model it trains: it gets one from the registry
by model.arch, applies the layout's parallelism, and drives steps. Order of a
step (Trainer.train, Trainer.train_step): guards before the step (injected faults,
the replica check) -> data -> forward/backward per micro-batch -> optimizer step ->
losses reduced, expert-bias update from globally summed counts (expert_load/tracker.py)
-> guards after the step (NaN, spike) -> metrics -> eval -> checkpoint.

Two components hang off the loop at fixed points: guards.Guards (every fault guard:
injection, NaN, spike, replica check and repair, owner rollback, stragglers) and
observers.Observers (metrics, TensorBoard, noise scale, expert-load summaries, profiled steps).
"""
from __future__ import annotations

import functools
import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from . import checkpoint, checkpoint_pick, run_dir
from .config import Config, Layout, TrainConfig
from .data import DataError, MixtureSource, open_run_data, run_data_dir
from .data.documents import document_ids, document_positions
from .expert_load.tracker import ExpertLoadTracker
from .parallel.slots import Replacer, SlotExperts
from .moe.balance import skewed_biases
from .init_from import load_initial_weights
from .guards import Guards, TrainingHalted  # noqa: F401 (TrainingHalted: moe_trainer.train catches it here)
from .metrics import StepClock, peak_tflops
from .models.init import materialize
from .compile import compile_regions
from .models.registry import build_model, moe_layers
from .observers import Observers
from .parallel.comm import (CommCounter, all_reduce_small, count_deepspeed_collectives, enable_shm_transport,
                            route_deepspeed_collectives)
from .parallel.context import shard_sequence
from .parallel.launch import progress
from .parallel.mesh import DeepSpeedMPU, Mesh
from .parallel.pipeline import PipelineExecutor, Trace, build_stage
from .kernels.cpu.shm_alltoall import P2P_RING_BYTES, RING_BYTES, SMALL_RING_BYTES
from .parallel import link
from .parallel.overlap import OverlapExecutor
from .parallel.parallelize import parallelize
from .parallel.surrogate import reduce_after_backwards
from .parallel.zero import build_engine, set_lr


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
    # parallel.replace_every at the step boundary before this step: the copies' refresh, a decision's moves
    # (Replacer.after_step's wall; it synchronises the device at a decision)
    replacement: float = 0.0

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
        if cfg.debug.route_skew:  # skewed routing on purpose (a resume reads the biases saved instead)
            for _, layer in moe_layers(self.model):
                layer.gate.e_score_correction_bias.copy_(skewed_biases(cfg.model.n_routed_experts, cfg.debug.route_skew))
        # decided once, before any weights are read: a resume never reads train.init_from (at 671B a
        # whole Hugging Face checkpoint, which may be gone by then); init_from is read when no
        # checkpoint is usable, auto-resume's fallback past damaged ones included
        self.resume_from = self.find_checkpoint()
        if planned and self.resume_from is not None and checkpoint.step_of(self.resume_from) >= t.max_steps:
            raise NothingLeft(run_dir.finished_sentence(cfg, self.resume_from))  # before the engine is built
        if t.init_from and self.resume_from is None:
            load_initial_weights(self.model, t.init_from)
        if t.compile is True:  # (auto was resolved by train.resolve_device_settings) after the weights are
            # in place, before the engine wraps the model
            # overlapped (parallel.overlap=a2a): the MoE layers by sub-layer region, as its stages call them
            regions = compile_regions(self.model, backend=t.compile_backend, overlap=cfg.parallel.overlap == "a2a")
            if self.is_logger:  # each region compiles at its first call: step 1's time holds the compile
                print(f"torch.compile ({t.compile_backend}): {len(regions)} regions on this stage "
                      f"({', '.join(regions)}); they compile at their first call, in step 1", flush=True)
        self.engine = build_engine(self.model, cfg, self.layout, mpu=DeepSpeedMPU(mesh))
        if shm:
            route_deepspeed_collectives()
        # ZeRO's gradient reductions and parameter gathers, counted like the all-to-alls
        # (where edp and dpcp are one group, at ep 1, its traffic counts as dp)
        count_deepspeed_collectives(self.comm, {mesh.group("edp"): "edp", mesh.group("dpcp"): "dp"})
        link.configure(cfg.debug.link_gbps, cfg.debug.link_latency_us)
        self.expert_load = ExpertLoadTracker(cfg.model, self.model, mesh, device)  # and the bias update
        self.slots, self.replacer = None, None  # slot-owned experts that move (parallel.replace_every)
        if cfg.parallel.replace_every:
            grad_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 and cfg.train.grad_accum_dtype == "bf16" \
                else torch.float32  # the copies' gradient sums accumulate as the run's gradients do
            self.slots = SlotExperts(self.expert_load.moe, len(self.expert_load.layer_ids), cfg.model.n_routed_experts,
                                     mesh, cfg.parallel.redundant_slots, device, grad_dtype)
        # with redundant slots, after the step's last backward: the copies' gradients to their owners
        self.before_reduce = functools.partial(self.slots.hand_back, self.engine) \
            if cfg.parallel.redundant_slots else None
        self.executor = self._build_executor() if self.pipelined else None
        # parallel.overlap=a2a: micro-batch pairs with their all-to-alls overlapped (pp > 1: in the executor)
        self.overlap = OverlapExecutor(self.engine, self.engine.module, self.layout.grad_accum, mesh.group("ep"),
                                       self.comm, self.clock, cfg.parallel.recompute, self.before_reduce) \
            if cfg.parallel.overlap == "a2a" and not self.pipelined else None
        self.loss_keys = loss_keys(cfg.model)
        self.step = 0
        self.peak, self.peak_source = peak_tflops(cfg.metrics.peak_tflops, self.dtype, device)
        if self.slots is not None:
            self.replacer = Replacer(cfg, self.slots, self.engine, device, self.peak)
        self._stopping = False
        self._term = False
        self._replacing = 0.0  # the last step boundary's re-placement wall, charged to the next step
        self.data_offset = 0  # batches skipped by rollbacks: step s trains on sample position s + offset
        # the two components the loop calls at fixed points: what it reports, and what guards it
        self.observers = Observers(cfg, mesh, self.engine, self.expert_load, device, self.peak)
        self.guards = Guards(self)
        self.faults = self.guards.faults  # injection (slow@S:R) where a micro-batch is read

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
        (plan_start chose a checkpoint from its manifest and sizes); rank 0's choice then holds for
        every rank, and the checksums of its files, hashed once over the ranks, refuse a damaged one:
        train.resume=auto falls back to an older one or to none (checkpoint_pick). Collective."""
        if self.start is None:
            self.start = run_dir.plan_start(self.cfg, None, warn=self.is_logger)
            self.start.resume = self.cfg.train.resume
        resume = "none" if self.start.checkpoint is None else \
            "auto" if self.start.resume == "auto" else str(self.start.checkpoint)
        found = checkpoint_pick.pick(self.out_dir, resume, self.mesh.rank, self.layout.world, self.device,
                                     warn=self.is_logger, warned=self.start.warned)
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
        self.observers.open(self.step, self.resume_from)

    def barrier(self) -> None:
        if dist.is_initialized() and self.layout.world > 1:
            dist.barrier()

    def maybe_resume(self) -> None:
        """Load the checkpoint find_checkpoint chose, if any."""
        if self.resume_from is not None:
            self.step = checkpoint.load(self.resume_from, self)
            self.guards.load_state_dict(checkpoint.read_state(self.resume_from).get("guards", {}))
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
            self.guards.before_step(self.step + 1)  # injected kill/hang/slow; the replica check when due
            progress(self.step + 1, "forward, backward and optimizer")
            record = self.train_step()
            self.step += 1
            self.observers.add_step(record)
            progress(self.step, "losses, logging and evaluation")
            if self.guards.after_step(record):  # bit flips, the NaN policy, the spike guard
                continue  # rolled back: the step counter is the checkpoint's now
            if self.replacer is not None:  # a step boundary: the experts may move (collective)
                started = time.perf_counter()
                event = self.replacer.after_step(self.step, record["expert"])
                # no step's clock runs here: its wall goes into the next step's time (finish_step), as its
                # traffic goes into the next step's counters
                self._replacing = time.perf_counter() - started
                if event is not None:
                    self.observers.event(self.step, event)
            self._stopping = self.any_rank(self._term) or self.step == t.stop_at_step
            if self.step % t.log_every == 0 or self.step == t.max_steps or record["skipped"]:
                last = self.log(record)
            if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.max_steps):
                last.update(self.evaluate_and_log())
            if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or self.step == t.max_steps \
                    or self._stopping:
                if self.guards.before_checkpoint():  # replicas compared before they are saved
                    continue  # rolled back instead
                progress(self.step, "checkpoint")
                self.save_checkpoint()
        if self.pipelined and self.trace.enabled:
            self.write_pipeline_trace()
        self.observers.close()
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
                                trace=self.trace, counter=self.comm, clock=self.clock,
                                overlap=(self.mesh.group("ep"), p.recompute) if p.overlap == "a2a" else None,
                                before_reduce=self.before_reduce)

    def train_step(self) -> dict:
        set_lr(self.engine, get_lr(self.step, self.cfg.train) * self.guards.lr_factor(self.step + 1))
        poison = self.guards.poisoned(self.step + 1)
        self.observers.begin_step(self.step + 1)
        if self.pipelined:
            return self.pipeline_step(poison)
        if self.overlap is not None:
            return self.overlap_step(poison)
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
            if self.before_reduce is None:
                self.engine.backward(out.loss)
            else:  # the boundary after before_reduce, not in the last backward
                last = micro + 1 == self.layout.grad_accum
                self.engine.set_gradient_accumulation_boundary(False)
                self.engine.backward(out.loss)
                if last:
                    reduce_after_backwards(self.engine, self.before_reduce)
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

    def finish_step(self, sums: dict, times: StepTimes, t0: float) -> dict:
        losses = self.reduce_losses({k: v / self.layout.grad_accum for k, v in sums.items()})
        skipped = not all(math.isfinite(v) for v in losses.values())
        self.observers.noise_scale(skipped)
        expert = self.expert_load.update_bias(apply=not skipped)
        step_time = time.perf_counter() - t0  # after reduce_losses' host sync: the step's kernels are done
        times.replacement, self._replacing = self._replacing, 0.0
        step_time += times.replacement
        return {"losses": losses, "times": times, "step_time": step_time, "expert": expert,
                "comm": self.comm.reset(self.clock), "skipped": skipped}

    def overlap_step(self, poison: bool) -> dict:
        t0 = time.perf_counter()
        self.overlap.poison = poison
        sums, spans = self.overlap.step(self.micro_batch)
        record = self.finish_step(sums, StepTimes(), t0)  # ends in a host sync: every mark is done now
        times = record["times"]
        times.data, times.forward, times.backward = (sum(self.clock.seconds(a, b) for a, b in spans[k])
                                                     for k in ("data", "forward", "backward"))
        return record

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

    def evaluate_and_log(self) -> dict[str, float]:
        losses = self.evaluate_sources()
        if self.is_logger:
            self.observers.event(self.step, losses)
            shown = " | ".join(f"{k} {v:.4f}" for k, v in losses.items())
            print(f"step {self.step}/{self.cfg.train.max_steps} | {shown}", flush=True)
        return losses

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

    def log(self, r: dict) -> dict:
        """The log step's record (observers.step_record), the stragglers named, the record written."""
        record = self.observers.step_record(r, self.step, get_lr(self.step - 1, self.cfg.train), self.source_samples())
        if self.layout.world > 1 and self.observers.sink_steps > 0:  # a process's first step pays its one-time costs
            self.guards.at_log_step(r)
        self.observers.write(self.step, record)
        return record

    def source_samples(self) -> dict[str, int]:
        """{source name: training samples drawn from it so far}: global samples [0, data position *
        global batch), the batches a rollback skipped included (they were drawn)."""
        drawn = (self.step + self.data_offset) * self.cfg.train.global_batch_size
        if isinstance(self.train_data, MixtureSource):
            return self.train_data.drawn(drawn)
        return {next(iter(self.val_data)): drawn}
