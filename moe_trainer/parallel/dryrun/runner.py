"""One simulated rank at a time: the real Trainer built on fake CUDA tensors under NCCL's rules,
two steps of its training loop (every micro-batch of the schedule), a checkpoint saved and reloaded.

The code that runs is the real run's: moe_trainer.train.make_trainer (device, kernels, DeepSpeed's
init_process_group with the rank's device bound, so the mesh's groups are communicator splits), the
Trainer (model, parallelize, pipeline stage, DeepSpeed's engine and ZeRO-1, the pipeline executor),
its loop `Trainer.train` for two steps with the replica check, logging (straggler naming, expert
metrics) and evaluation at every step, the EP dispatcher and checkpoint.save / checkpoint.load.
What the dry run puts in their place, and why, is all here:
- the process group: torch's fake backend behind nccl_rules.NcclRules, made where DeepSpeed makes
  NCCL's (`fake_backend`), with DeepSpeed's device_id;
- run_dir.check_shared: met by construction (`one_run_directory`);
- `materialize` (models/init.py): uninitialised fake tensors on the rank's device (fake_cuda.py);
- SDPA: the memory-efficient kernel's op, output and log-sum-exp only (`fused_attention`), as a GPU
  runs it; torch without CUDA would take its math path under fake CUDA and materialise the scores;
- F.rms_norm: what the fused CUDA kernel keeps for its backward (`fused_rms_norm`), not the CPU
  build's composite with its fp32 copies;
- the optimizer's state (Adam's moments), made before the step as every later step finds it
  (`capacity.prime_optimizer_state`), so the peak is a steady step's, not the first's;
- the EP dispatcher's one host read, the split sizes: a seeded skewed routing, some sizes zero, or
  the balanced expectation (routing.py), since fake tensors carry no routing;
- the checkpoint's bytes: each part file gets its real header and a hole the size of its data
  (a sparse file), its digest is the header's; a reload reads the headers, runs the box arithmetic
  and takes fake tensors of each stored shape. Every simulated rank reloads once all have saved;
  with some ranks only, the others' parts are absent, so the whole-model key check and the
  coverage check are off (partial_checkpoint). The loop's own checkpoint at its last step is this
  save (`Simulator.save`: the simulated ranks share one directory, one after another).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ["DS_ACCELERATOR"] = "cuda"  # before deepspeed is imported: its CUDA accelerator, NCCL's path

import torch

from .fake_cuda import (
    CudaShim,
    FakeCudaMode,
    fake_module_conversion,
    fused_attention,
    fused_rms_norm,
    install_meter,
    materialize_without_init,
    quiet_fake_tensor_logs,
)
from .capacity import SiteMeter, prime_optimizer_state
from .crossrank import check_all
from .loop import LOOP, STEPS, fake_backend, run_loop
from .nccl_rules import NcclRules, RuleError
from .routing import ROUTINGS, drawn_replacement, routed_dispatch

MODES = ("all", "roles")


class DryRunError(RuntimeError):
    """Bad input, or a failure the dry run found: one sentence."""


@dataclass
class RankReport:
    rank: int
    stage: int
    role: str
    peak_bytes: int
    plan_bytes: int
    intra_node_bytes: int
    inter_node_bytes: int
    collectives: dict
    host_reads: int
    seconds: float
    micro_batches_run: list  # the schedule's count, or the two shorter runs extrapolated from
    peak_sites: list = field(default_factory=list)  # [{site, bytes, tensors}] live at the peak, largest first
    bound_device: str = ""  # the device its process group was bound to (DeepSpeed's device_id)
    group_creations: dict = field(default_factory=dict)  # "split" / "new_group" -> how many it entered
    split_sizes: dict = field(default_factory=dict)  # EP split sizes drawn ("splits"), how many were 0 ("zero")


    def as_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "rank"}


@dataclass
class DryRun:
    world: int
    gpus_per_node: int
    groups: dict
    micro_batches: int = 0  # the schedule's, per optimizer step
    ranks: dict = field(default_factory=dict)  # rank -> RankReport

    def as_json(self) -> dict:
        return {"world": self.world, "gpus_per_node": self.gpus_per_node, "groups": self.groups,
                "micro_batches": self.micro_batches,
                "ranks": {str(r): rep.as_json() for r, rep in sorted(self.ranks.items())}}


# ----------------------------------------------------------------------------- which ranks run

def role_of(layout, rank: int, coords) -> tuple:
    """What makes a rank's program differ: its pipeline stage (first / last, MoE layers or not all
    follow from it) and, under tp, whether it is tp rank 0 (it writes the replicated weights)."""
    c = coords(rank, layout)
    return (c["pp"], c["tp"] == 0)


def choose_ranks(spec: str, layout, world: int) -> list[int]:
    """`all`, `roles` (the lowest rank of each role), or a comma list of ranks (with rank 0)."""
    from ..mesh import coords
    if spec == "all":
        return list(range(world))
    if spec == "roles":
        seen: dict = {}
        for r in range(world):
            seen.setdefault(role_of(layout, r, coords), r)
        return sorted(seen.values())
    try:
        ranks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise DryRunError(f"--ranks must be all, roles or a comma list of ranks, not {spec!r}.") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise DryRunError(f"--ranks {spec}: ranks must lie in 0..{world - 1}.")
    return sorted(set(ranks) | {0})  # rank 0 writes the checkpoint's state.json, which every reload reads


# ----------------------------------------------------------------------------- stand-ins (see the docstring)

def write_sparse_safetensors(path, tensors, metadata=None) -> str:
    """tensor_file.write_safetensors without the bytes: the real header, then a hole as long as the
    data. Returns the header's sha256 (the data is not there to hash)."""
    import hashlib

    from ...tensor_file import _size, header_bytes
    head = header_bytes(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + sum(_size(t.shape, t.dtype) for t in tensors.values()))
    return hashlib.sha256(head).hexdigest()


@contextlib.contextmanager
def rank0_listing(sent: list, rank: int):
    """checkpoint_pick sends rank 0's view of the checkpoints to the other ranks as its length, then
    its bytes, and each receiving rank sizes its buffer by the length it got. Fake tensors carry no
    values, so a simulated rank takes the k-th listing rank 0 sent (rank 0 runs first: choose_ranks)
    and makes the same two broadcasts a GPU rank makes, of the same sizes."""
    import torch.distributed as dist

    from ... import checkpoint_pick
    base, calls = checkpoint_pick._broadcast, [0]

    def emulated(obj, r, device):
        k, calls[0] = calls[0], calls[0] + 1
        if r == 0:
            del sent[k:]
            sent.append(obj)
            return base(obj, r, device)
        obj = sent[k] if k < len(sent) else [True, []]
        data = json.dumps(obj).encode()
        dist.broadcast(torch.zeros(1, dtype=torch.int64, device=device), src=0)
        dist.broadcast(torch.empty(len(data), dtype=torch.uint8, device=device), src=0)
        return obj

    checkpoint_pick._broadcast = emulated
    try:
        yield
    finally:
        checkpoint_pick._broadcast = base


@contextlib.contextmanager
def one_run_directory():
    """run_dir.check_shared (every rank sees the marker rank 0 leaves) is met by construction: the
    simulated ranks share this process's one directory, one after another, so rank 0's marker would
    be gone before a later rank looks for it."""
    from ... import run_dir
    base = run_dir.check_shared
    run_dir.check_shared = lambda out, rank, world, device: None
    try:
        yield
    finally:
        run_dir.check_shared = base


@contextlib.contextmanager
def partial_checkpoint():
    """A reload from the parts of some ranks only: the whole model's keys are not all there, and a
    block whose every fragment lies in a part not written reads as an uninitialised block."""
    from ...checkpoint import Index
    base_fits, base_block = Index.check_fits, Index.block

    def block(self, key, offsets=None, sizes=None):
        if key in self.pieces:
            return base_block(self, key, offsets, sizes)
        return torch.empty(sizes)

    Index.check_fits, Index.block = (lambda self, expected, error=None: None), block
    try:
        yield
    finally:
        Index.check_fits, Index.block = base_fits, base_block


@contextlib.contextmanager
def fake_checkpoint_bytes(written: dict, covered: bool = True):
    """checkpoint.py writes sparse parts (digests into `written`) and reads fake tensors back, and the
    expert-load files of the log steps are sparse too;
    covered=False: a block need not be covered by the parts present (they are some ranks' only)."""
    from ... import checkpoint
    from ...tensor_file import TensorFile
    base_write, base_get, base_covered, base_rng = (checkpoint.write_safetensors, TensorFile.get,
                                                    checkpoint._covered, torch.set_rng_state)

    import safetensors.torch as expert_files  # expert_load/files.py imports save_file from it at each write
    base_save_file = expert_files.save_file

    def write(path, tensors, metadata=None):
        written[Path(path).name] = write_sparse_safetensors(path, tensors, metadata)
        return written[Path(path).name]

    def get(self, name):
        dtype, shape, _, _ = self.entries[name]
        return torch.empty(shape, dtype=dtype)

    checkpoint.write_safetensors, TensorFile.get = write, get
    # the expert-load file of a log step (expert_load/files.py): its header, the counts a hole too
    expert_files.save_file = lambda tensors, path, metadata=None: write_sparse_safetensors(path, tensors, metadata)
    if not covered:
        checkpoint._covered = lambda pieces, offsets, sizes: True
    torch.set_rng_state = lambda state: None
    try:
        yield
    finally:
        checkpoint.write_safetensors, TensorFile.get = base_write, base_get
        expert_files.save_file = base_save_file
        checkpoint._covered, torch.set_rng_state = base_covered, base_rng


# ----------------------------------------------------------------------------- one rank

class Simulator:
    """Runs the chosen ranks of one config and world in this process, one after another."""

    def __init__(self, config: str, overrides: list[str], world: int, gpus_per_node: int,
                 micro_batches: str = "auto", routing: str = "skewed"):
        from ...config import ConfigError, validate_layout
        from ...resolve import load_config
        if world < 1 or gpus_per_node < 1:
            raise DryRunError(f"--world ({world}) and --gpus-per-node ({gpus_per_node}) must be positive.")
        if world % gpus_per_node and world > gpus_per_node:
            raise DryRunError(f"--gpus-per-node {gpus_per_node} must divide --world {world}.")
        if micro_batches not in ("auto", "all"):
            raise DryRunError(f"--micro-batches must be auto or all, not {micro_batches!r}.")
        if routing not in ROUTINGS:
            raise DryRunError(f"--routing must be one of {', '.join(ROUTINGS)}, not {routing!r}.")
        self.routing = routing
        self.config, self.world, self.gpus_per_node = config, world, min(gpus_per_node, world)
        self.micro_batches = micro_batches
        self.workdir = Path(tempfile.mkdtemp(prefix="moe_trainer_dry_run_"))
        self.overrides = list(overrides) + [f"run.out_dir={self.workdir / 'run'}", "train.checkpoint_every=0",
                                            "parallel.cpu_alltoall=gloo", "parallel.cpu_p2p=gloo",
                                            "debug.profile_steps=[]"] + LOOP  # fake kernels: nothing to profile
        try:
            self.base_cfg = load_config(config, self.overrides)
            self.layout = validate_layout(self.base_cfg, world, self.gpus_per_node)
        except ConfigError as e:
            raise DryRunError(f"config error: {e}") from None
        self.meter = SiteMeter()
        self.cuda = CudaShim(self.gpus_per_node, self.meter)
        self.rules = NcclRules(world, self.gpus_per_node)
        self.written: dict = {}  # part file -> the digest its writer returned
        self.kept: dict = {}  # rank -> (trainer, its fake mode), reloaded once every part is written
        self.checkpoint_dir: Path | None = None
        self.bound: list = []  # the device each rank's process group was bound to
        self.splits: dict = {}  # rank -> {"splits": sizes drawn, "zero": of them zero}
        self.listings: list = []  # the checkpoint listings rank 0 sent, in order (rank0_listing)
        self._prepare_process()

    def _prepare_process(self) -> None:
        from .cuda_guard import install_cuda_guard
        install_cuda_guard(self.gpus_per_node)
        self.cuda.install()
        install_meter(self.meter)
        quiet_fake_tensor_logs()
        self.rules.install()
        import logging

        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)

    def plan_bytes(self) -> list[int]:
        """The planner's per-rank estimate of each stage (states + activations, ZeRO-1, mixed precision
        for bf16), for the dtype a CUDA run resolves train.dtype auto to."""
        from ...resolve import load_config
        from ...plan import make_plan
        cfg = load_config(self.config, self.overrides)
        if cfg.train.dtype == "auto":
            cfg.train.dtype = "bf16"
        plan = make_plan(cfg, self.world)
        return [int(s.total) for s in plan.stages]

    def probe_sizes(self) -> tuple[int, int] | None:
        """The two shorter schedules a rank runs instead of the full one (`micro_batches` "auto"), or
        None to run every micro-batch. Every micro-batch of a step has the same shapes, so traffic and
        collective counts are linear in the count: fixed per step + per micro-batch. Runs of k1 and k2
        micro-batches give both terms exactly. The peak is the full schedule's once k1 covers the most
        micro-batches a stage holds in flight: pp under 1F1B; under interleaved 1F1B the warm-up of
        stage 0 ((pp - 1) * 2 + (v - 1) * pp chunks) fits in 2 pp micro-batches, which keep the count a
        multiple of pp as the interleaved order needs."""
        m, pp, v = self.layout.grad_accum, self.layout.pp, self.base_cfg.parallel.virtual_stages
        k1, k2 = (2 * pp, 3 * pp) if v > 1 else (pp, pp + 1)
        if self.micro_batches == "all" or m <= k2:
            return None
        return k1, k2

    def run_rank(self, rank: int) -> RankReport:
        t0 = time.perf_counter()
        sizes = self.probe_sizes()
        if sizes is None:
            built, step, save, peak = self._run_pass(rank, self.overrides, keep=True)
        else:
            k1, k2 = sizes
            m = self.layout.grad_accum
            per_step = self.base_cfg.train.global_batch_size // m
            probe = self.workdir / "probe"  # its own run directory: the kept pass starts from a fresh one
            _, step1, _, peak1 = self._run_pass(
                rank, self.overrides + [f"train.global_batch_size={per_step * k1}", "parallel.micro_batches=0",
                                        f"run.out_dir={probe}"], keep=False)
            shutil.rmtree(probe, ignore_errors=True)
            built, step2, save, peak2 = self._run_pass(
                rank, self.overrides + [f"train.global_batch_size={per_step * k2}", "parallel.micro_batches=0"], keep=True)
            step, peak = extrapolate(step1, step2, k1, k2, m, rank), max(peak1, peak2)
        traffic = combine(step, save)
        stage = built.coord["pp"]
        return RankReport(rank, stage, _role_text(built), peak, self.plan_bytes()[stage],
                          traffic["intra_node_bytes"], traffic["inter_node_bytes"], traffic["collectives"],
                          traffic["host_reads"], time.perf_counter() - t0,
                          list(sizes) if sizes else [self.layout.grad_accum],
                          peak_sites=[site.as_json() for site in self.meter.take_peak_sites()],
                          bound_device=str(self.bound[-1]), group_creations=self.rules.creation_counts(rank),
                          split_sizes=dict(self.splits[rank]))

    def _run_pass(self, rank: int, overrides: list[str], keep: bool):
        """Builds rank `rank`'s trainer from `overrides`, runs STEPS steps of its loop and its checkpoint
        at the last, and with `keep` keeps it for the reload. Returns (its mesh, the traffic of its set-up
        and its last training step, the checkpoint's traffic, its peak bytes)."""
        from ... import trainer as trainer_module
        from ...config import validate_layout
        from ...resolve import load_config, settle_overlap
        from ...train import make_trainer
        from .. import mesh as mesh_module
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(self.world),
                           "LOCAL_RANK": str(rank % self.gpus_per_node),
                           "LOCAL_WORLD_SIZE": str(self.gpus_per_node), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "29500"})
        cfg = load_config(self.config, overrides)
        settle_overlap(cfg, "cuda")  # as a CUDA run resolves it (train.resolve_device_settings)
        if cfg.train.compile == "auto":  # a GPU run's default; the dry run walks the eager path (compiled
            cfg.train.compile = False    # regions make the same collectives, as functional ones)
        layout = validate_layout(cfg, self.world, self.gpus_per_node)
        gc.collect()  # earlier ranks' garbage is freed now, not inside this rank's count
        self.meter.reset()
        log = self.rules.begin_rank(rank)
        device = torch.device("cuda", rank % self.gpus_per_node)
        built: list = []
        base_build = mesh_module.build_mesh

        def build_mesh(*args, **kwargs):  # the mesh the trainer gets, kept to name its groups
            built.append(base_build(*args, **kwargs))
            return built[-1]

        mode = FakeCudaMode(on_functional_collective=self.rules.functional)
        marks: list = []  # (calls, transfers, host reads) so far, at each train_step's start and end

        def mark():
            marks.append((len(log.calls), len(log.p2p), sum(mode.host_reads.values())))

        base_materialize, base_term = trainer_module.materialize, signal.getsignal(signal.SIGTERM)
        self.splits[rank] = {}
        try:
            mesh_module.build_mesh = build_mesh
            with mode, fake_module_conversion(), fused_attention(), fused_rms_norm(), one_run_directory(), rank0_listing(self.listings, rank), \
                    fake_backend(rank, self.world, device, self.bound), fake_checkpoint_bytes(self.written), \
                    routed_dispatch(cfg.model, self.routing, cfg.run.seed, self.splits[rank]), \
                    drawn_replacement(cfg.run.seed):
                trainer_module.materialize = materialize_without_init(
                    device, torch.bfloat16 if cfg.train.dtype in ("bf16", "auto") else None)
                trainer = make_trainer(cfg, layout)
                prime_optimizer_state(trainer.engine)  # the first step's peak is a later step's (capacity.py)
                if run_loop(trainer, mark, lambda: (mark(), self.save(trainer))) != STEPS:
                    raise DryRunError(f"rank {rank}: the training loop stopped at step {trainer.step}, not {STEPS}.")
            if keep:
                self.kept[rank] = (trainer, mode)
            kinds = {pg: kind for kind, pg in reversed(list(built[0].groups.items())) if pg is not None}
            kinds.update({pg: "self" for pg in getattr(mesh_module, "_SINGLE", {}).values()})
            if built[0].single is not None:
                kinds[built[0].single] = "self"
            self.rules.end_rank(kinds)
        finally:
            trainer_module.materialize = base_materialize
            mesh_module.build_mesh = base_build
            signal.signal(signal.SIGTERM, base_term)
            with mode:  # its barrier's tensor is on the bound device
                self._teardown(mesh_module)
        if not keep:
            del trainer
        reads = sum(mode.host_reads.values())
        # reported: the set-up (before the first step), the last training step (steady: the optimizer's
        # state exists), the checkpoint; the loop's checks, logging and evaluation run under the rules only
        (c0, p0, h0), (c1, p1, h1), (c2, p2, h2), save_at = marks[0], marks[-3], marks[-2], marks[-1]
        step = combine(self.rules.traffic(rank, calls=slice(0, c0), p2p=slice(0, p0)),
                       self.rules.traffic(rank, calls=slice(c1, c2), p2p=slice(p1, p2)))
        step["host_reads"] = h0 + h2 - h1
        save = self.rules.traffic(rank, calls=slice(save_at[0], None), p2p=slice(save_at[1], None))
        save["host_reads"] = reads - save_at[2]
        return built[0], step, save, self.meter.peak

    def save(self, trainer) -> None:
        """checkpoint.save as every rank runs it. Rank 0, simulated first, renamed its directory into
        place; a later rank's part is moved there beside it."""
        from ... import checkpoint
        rank = trainer.mesh.rank
        root = trainer.out_dir / "checkpoints"
        tmp, final = root / f".step_{trainer.step}.tmp", root / f"step_{trainer.step}"
        if rank != 0:
            tmp.mkdir(parents=True, exist_ok=True)
        checkpoint.save(trainer)
        if rank != 0:
            final.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / checkpoint.part_name(rank), final / checkpoint.part_name(rank))
            shutil.rmtree(tmp, ignore_errors=True)
        self.checkpoint_dir = final

    def reload_all(self, complete: bool) -> None:
        """checkpoint.load on every simulated rank, once every part is on disk. `complete` (every rank
        ran): the manifest lists the whole world and every check runs. Otherwise it lists the parts that
        exist, and the checks that need the others' (every key present, every element covered) are off."""
        from ... import checkpoint
        final = self.checkpoint_dir
        files = {name: {"bytes": (final / name).stat().st_size, "sha256": digest}
                 for name, digest in sorted(self.written.items()) if (final / name).is_file()}
        state = final / "state.json"
        files[state.name] = {"bytes": state.stat().st_size, "sha256": checkpoint.sha256(state)}
        manifest = {"step": STEPS, "world": self.world, "files": files}
        (final / checkpoint.MANIFEST).write_text(json.dumps(manifest, indent=1))
        problem = checkpoint.verify(final, read=("state.json",))
        if problem:
            raise DryRunError(f"the checkpoint the ranks wrote does not verify: {problem}.")
        for rank, (trainer, mode) in sorted(self.kept.items()):
            partial = contextlib.nullcontext() if complete else partial_checkpoint()
            try:
                with mode, fake_module_conversion(), fake_checkpoint_bytes(self.written, covered=complete), partial:
                    step = checkpoint.load(final, trainer)
            except (RuntimeError, ValueError, TypeError, IndexError, KeyError) as e:
                raise op_failure(e, rank) from e
            if step != trainer.step:
                raise DryRunError(f"rank {rank}: the checkpoint it reloaded is at step {step}, not {trainer.step}.")

    def _teardown(self, mesh_module) -> None:
        """The process group and every registry that holds this rank's groups."""
        from ..launch import shutdown_distributed
        shutdown_distributed()  # the real run's end: its collective watch stopped, a barrier, the groups gone
        getattr(mesh_module, "_SINGLE", {}).clear()
        from deepspeed.utils import groups
        for name in dir(groups):
            value = getattr(groups, name)
            if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")) and isinstance(value, dict):
                value.clear()
            elif name.startswith("_") and name.endswith("_GROUP") and value is not None and not callable(value):
                setattr(groups, name, None)

    def check_across_ranks(self, ranks: list[int]) -> None:
        """crossrank.check_all over the ranks that ran, each standing for every rank of its role."""
        from ..mesh import coords, group_ranks
        by_role = {role_of(self.layout, r, coords): r for r in sorted(ranks, reverse=True)}  # the lowest wins
        stand_in = {r: r if r in ranks else by_role.get(role_of(self.layout, r, coords)) for r in range(self.world)}
        check_all(self.rules.logs, {r: s for r, s in stand_in.items() if s is not None}, group_ranks(self.layout),
                  self.world)

    def run(self, ranks: list[int], mode: str, progress=None) -> DryRun:
        from ..mesh import group_ranks
        groups = {k: v for k, v in group_ranks(self.layout).items() if k in ("tp", "cp", "pp", "ep", "edp", "dp")}
        out = DryRun(self.world, self.gpus_per_node, groups, self.layout.grad_accum)
        try:
            for r in ranks:
                try:
                    out.ranks[r] = self.run_rank(r)
                except (RuleError, DryRunError):
                    raise
                except (RuntimeError, ValueError, TypeError, IndexError) as e:
                    raise op_failure(e, r) from e
                if progress:
                    progress(out.ranks[r])
            complete = len(ranks) == self.world
            self.check_across_ranks(ranks)
            self.reload_all(complete)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return out


def extrapolate(t1: dict, t2: dict, k1: int, k2: int, m: int, rank: int) -> dict:
    """The full schedule's traffic from runs of k1 and k2 micro-batches: every number (bytes, each
    collective count) is fixed + per_micro_batch * k. A number that does not step evenly between the
    two runs is not linear in the count, and the shortcut would be a guess: one sentence instead."""
    def value(name, a, b):
        step, rest = divmod(b - a, k2 - k1)
        if rest or step < 0:
            raise DryRunError(f"rank {rank}: {name} is {a} with {k1} micro-batches and {b} with {k2}, not linear in "
                              f"the micro-batch count; rerun with --micro-batches all.")
        return a + step * (m - k1)

    out = {}
    for key in t1.keys() | t2.keys():
        if isinstance(t1.get(key, t2.get(key)), dict):
            a, b = t1.get(key, {}), t2.get(key, {})
            out[key] = {k: value(k, a.get(k, 0), b.get(k, 0)) for k in sorted(a.keys() | b.keys())}
        else:
            out[key] = value(key, t1.get(key, 0), t2.get(key, 0))
    return out


def combine(a: dict, b: dict) -> dict:
    """Two traffic records (the step's, the checkpoint's) as one: numbers and counts added."""
    out = {}
    for key in a.keys() | b.keys():
        x, y = a.get(key), b.get(key)
        if isinstance(x if x is not None else y, dict):
            x, y = x or {}, y or {}
            out[key] = {k: x.get(k, 0) + y.get(k, 0) for k in sorted(x.keys() | y.keys())}
        else:
            out[key] = (x or 0) + (y or 0)
    return out


def _role_text(mesh) -> str:
    L, c = mesh.layout, mesh.coord
    parts = [f"stage {c['pp']}/{L.pp}"]
    if mesh.is_first_stage:
        parts.append("first")
    if mesh.is_last_stage:
        parts.append("last")
    return " ".join(parts)


def format_report(run: DryRun) -> str:
    """One line per rank that ran: peak fake-CUDA memory beside the planner's, traffic, counts."""
    lines = [f"dry run: world {run.world}, {run.gpus_per_node} GPUs per node; {len(run.ranks)} rank(s) ran"]
    for r, rep in sorted(run.ranks.items()):
        ratio = rep.peak_bytes / rep.plan_bytes if rep.plan_bytes else float("nan")
        counts = ", ".join(f"{k} {v}" for k, v in rep.collectives.items())
        lines.append(f"rank {r} ({rep.role}): peak {rep.peak_bytes / 1e9:.3f} GB, plan {rep.plan_bytes / 1e9:.3f} GB "
                     f"({ratio:.2f}x); sent {rep.intra_node_bytes / 1e6:.1f} MB inside its node, "
                     f"{rep.inter_node_bytes / 1e6:.1f} MB across nodes; {rep.host_reads} host reads; "
                     f"{rep.seconds:.1f} s{_probe_text(rep, run)}")
        lines.append(f"  collectives: {counts}")
        made = rep.group_creations
        lines.append(f"  process group bound to {rep.bound_device}; groups made by {made.get('split', 0)} communicator "
                     f"splits and {made.get('new_group', 0)} new_group calls"
                     + (f"; EP split sizes drawn {rep.split_sizes['splits']}, {rep.split_sizes['zero']} of them 0"
                        if rep.split_sizes.get("splits") else ""))
    return "\n".join(lines)


def _probe_text(rep: RankReport, run: DryRun) -> str:
    if len(rep.micro_batches_run) == 1:
        return ""
    k1, k2 = rep.micro_batches_run
    return f" (ran {k1} and {k2} micro-batches; traffic and counts extrapolated to the schedule's {run.micro_batches})"


def op_failure(e: BaseException, rank: int) -> DryRunError:
    """An op that failed under fake CUDA as one sentence: which check (devices inside an op, or shapes and
    the grouped GEMM's alignment), the rank, and the innermost moe_trainer frame of the traceback."""
    site, tb = "?", e.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/moe_trainer/" in path and "/parallel/dryrun/" not in path:
            site = "moe_trainer/" + path.split("/moe_trainer/", 1)[1] + f":{tb.tb_lineno}"
        tb = tb.tb_next
    text = " ".join(str(e).split())[:300].rstrip(".")
    rule = "tensors of one op on one device" if "device" in text.lower() else "shapes and alignment of an op"
    return DryRunError(f"check failed ({rule}): rank {rank} at {site}: {text}.")
