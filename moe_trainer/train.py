"""Entry point: `deepspeed --num_gpus N --module moe_trainer.train --config configs/X.yaml [--set a.b=v ...]`.

Also works with torchrun, or as a plain single process.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import io
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from .checkpoint import CheckpointError
from .config import ConfigError, given_values, validate_layout
from .resolve import DataVocabError, load_config
from .data import DataError
from .data.loader import derived_tokenizer, resolve_tokenizer
from .hf import HFFormatError


DEFAULT_CONFIG = "configs/moe_tiny.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moe_trainer.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # no default here: on a resume, only a config file the command names counts as given (DEFAULT_CONFIG's
    # values must not count as changes to the saved config.yaml)
    ap.add_argument("--config", default=None, help=f"YAML run config (default: {DEFAULT_CONFIG})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="typed override, e.g. --set train.max_steps=20 (repeatable)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _single_process_env() -> None:
    """Without a launcher, act as a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def keep_build_cache_per_environment(environ=os.environ) -> None:
    """DeepSpeed JIT-builds its C++ ops into torch's extension cache, one per user by default
    (~/.cache/torch_extensions): two virtual environments on a machine then rebuild each other's
    ops (50-90 s of silence at every switch). Inside a virtual environment, unless the user chose
    a cache (TORCH_EXTENSIONS_DIR), the cache lives in it."""
    if "TORCH_EXTENSIONS_DIR" not in environ and sys.prefix != sys.base_prefix:
        environ["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")


def use_this_environments_ninja(environ=os.environ, executable: str = sys.executable) -> None:
    """torch JIT-builds C++ ops with the first `ninja` on PATH, and ninja's log keeps each command's
    hash: ninja 1.11 (a system's) and 1.13 (the pip `ninja` DeepSpeed installs into the environment)
    hash alike commands differently, so processes that find different ninjas rebuild the same op
    in turn (seen here: DeepSpeed's shared-memory op rebuilt 30 times in an hour of tests, and a
    rank killed mid-build left a lock every later rank waited on). The environment's own ninja,
    beside its python, goes first on PATH, for this process and the ones it starts."""
    bin_dir = os.path.dirname(executable)
    if not os.path.exists(os.path.join(bin_dir, "ninja")):
        return
    path = environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        environ["PATH"] = bin_dir + (os.pathsep + path if path else "")


def extension_dir(name: str) -> Path:
    """Where torch.utils.cpp_extension JIT-builds extension `name` (as its _get_build_directory
    decides, without making it): TORCH_EXTENSIONS_DIR/name, else the per-user cache's
    py<version>_<cpu|cuXY|rocmXY>/name."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        v = torch.version
        accel = f"rocm{v.hip.replace('.', '')}" if v.hip else f"cu{v.cuda.replace('.', '')}" if v.cuda else "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accel}")
    return Path(root) / name


def deepspeed_op_built(name: str = "deepspeed_shm_comm") -> bool:
    """Is DeepSpeed's JIT op `name` in the extension cache (so loading it takes a moment, not a build)?"""
    return (extension_dir(name) / f"{name}.so").is_file()


def build_cpu_kernels(say) -> None:
    """Our fused CPU kernels (kernels/cpu/extension.py), built or loaded; `say` announces a build."""
    from .kernels.cpu.extension import build_dir, enabled, kernels
    if enabled() and not (build_dir() / "moe_trainer_cpu_kernels.so").is_file():
        say(f"building moe_trainer's fused CPU kernels (once per checkout and machine, about 20 s) into {build_dir()}")
    kernels()


def announce_deepspeed_op(say) -> None:
    if not deepspeed_op_built():
        say(f"building DeepSpeed's shared-memory op (once per environment, about 40 s) into "
            f"{extension_dir('deepspeed_shm_comm').parent}")


def build_ops(say=lambda line: print(line, flush=True)) -> None:
    """Before a job (scripts/_env.sh): our CPU kernels and DeepSpeed's shared-memory op, each
    announced only when it is not built yet, so a job's ranks never race to build them."""
    use_this_environments_ninja()
    build_cpu_kernels(say)
    announce_deepspeed_op(say)
    from deepspeed.accelerator import get_accelerator
    get_accelerator().create_op_builder("ShareMemCommBuilder").load()


# DeepSpeed's init_distributed prints "DeepSpeed ...deepspeed_shm_comm_op built successfully" on every CPU rank at
# every start, built or loaded from the cache: the console gets it from each node's first rank only
DEEPSPEED_OP_LINE = "built successfully"


class _DropLines(io.TextIOBase):
    """A stdout that passes whole lines on, except those holding `text`."""

    def __init__(self, out, text: str):
        self.out, self.text, self.held = out, text, ""

    def write(self, s: str) -> int:
        *lines, self.held = (self.held + s).split("\n")
        for line in lines:
            if self.text not in line:
                self.out.write(line + "\n")
        return len(s)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def printed_once_per_node(text: str, first_here: bool):
    """Inside the block, lines printed holding `text` reach the console from this node's first rank only."""
    if first_here:
        yield
        return
    quiet = _DropLines(sys.stdout, text)
    with contextlib.redirect_stdout(quiet):
        yield
    if quiet.held and text not in quiet.held:
        sys.stdout.write(quiet.held)


def local_world_size() -> int:
    """The ranks the launcher started on this node: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's
    LOCAL_SIZE (its launcher sets no LOCAL_WORLD_SIZE), else the whole world (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or os.environ.get("WORLD_SIZE", "1"))


def cores() -> int:
    """The cores this process may run on (its affinity: a cpuset or taskset counts, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(device_type: str, rank: int) -> None:
    """On CPU ranks, unless OMP_NUM_THREADS says otherwise: split this machine's cores between the
    ranks running on it. Those are the launcher's local ranks, except when several "nodes" of a
    hostfile are one machine (a rehearsal: deepspeed --no_ssh --node_rank k per node): each
    launcher then counts only its own ranks, every rank took cores / (its node's ranks) threads,
    and the machine ran 2-20x oversubscribed. So the ranks count each other by host name (one
    gather at start) and take cores / (ranks on this machine). Collective."""
    import socket

    import torch
    import torch.distributed as dist
    if device_type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    here = hosts.count(socket.gethostname())
    torch.set_num_threads(max(1, cores() // here))
    if rank == 0 and here > local_world_size():
        print(f"threads: {here} ranks of {len(hosts)} share this machine's {cores()} cores (its launcher started "
              f"{local_world_size()}): {torch.get_num_threads()} per rank (OMP_NUM_THREADS sets it)", flush=True)


def resolve_device_settings(cfg, device) -> None:
    """train.dtype auto -> bf16 on accelerators, fp32 on CPU ranks; parallel.overlap auto (where it runs:
    resolve.check_overlap) -> a2a on accelerators where the run stays eager, none where it compiles and on
    CPU ranks (resolve.overlap_runs); train.compile auto -> on CUDA only (the run directory's config.yaml
    records the values used); fp32 matmuls on CUDA run as TF32."""
    import torch
    from .resolve import settle_overlap
    if cfg.train.dtype == "auto":
        cfg.train.dtype = "fp32" if device.type == "cpu" else "bf16"
    # on NCCL the transfers run on their own stream, beside the other micro-batch's compute; between CPU
    # ranks on the shared-memory rings the exchange runs when it is waited for, on the rank's own thread, so
    # there is nothing to hide and the pairing only costs (0.91x without a link, docs/BENCHMARKS.md); a CPU
    # run asks for it with parallel.overlap=a2a (the benches, the tests)
    settle_overlap(cfg, device.type)
    if cfg.train.compile == "auto":
        # an overlapped run (parallel.overlap a2a, asked for) compiles its sub-layer regions (compile.py) only
        # when train.compile is true: no GPU has measured them yet. Nor a run with redundant slots: a new copy
        # layout may recompile the MoE layers (CPU ranks, copies rotated every step: 5 of 13 moves, 0.7-3.6 s each)
        cfg.train.compile = device.type == "cuda" and cfg.parallel.overlap == "none" and not cfg.parallel.redundant_slots
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores for fp32 GEMMs


def check_gpus(ds_accelerator: str, local_rank: int, rank: int) -> None:
    """One sentence (ConfigError) instead of a crash deep in DeepSpeed or NCCL: CUDA asked for
    (DS_ACCELERATOR=cuda) where torch sees no GPU, or more ranks on this node than it has GPUs."""
    import torch
    if ds_accelerator == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"rank {rank}: DS_ACCELERATOR=cuda asks for CUDA, but torch {torch.__version__} sees no "
                          f"GPU here (torch.cuda.is_available() is False); unset it to train on CPU ranks.")
    if torch.cuda.is_available() and ds_accelerator in ("", "cuda") and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"rank {rank} is local rank {local_rank} of its node, which has "
                          f"{torch.cuda.device_count()} GPU(s): launch at most that many processes per node "
                          f"(deepspeed --num_gpus / torchrun --nproc-per-node).")


def make_trainer(cfg, layout, start=None):
    """This rank's Trainer, the process set up as a launched rank: device, threads, allocator,
    kernels and the process group (the launcher's environment, or _single_process_env's).
    `start`: run_dir.plan_start's decision (None: the trainer makes it)."""
    import torch

    from . import kernels
    from .parallel.mesh import build_mesh
    from .trainer import Trainer

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    check_gpus(os.environ.get("DS_ACCELERATOR", ""), local_rank, int(os.environ.get("RANK", 0)))
    from deepspeed.accelerator import get_accelerator
    accel = get_accelerator()
    accel.set_device(local_rank)
    device = torch.device(accel.device_name(local_rank))
    resolve_device_settings(cfg, device)
    backend = kernels.select(device)  # before the model is built: its modules keep this choice
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"kernels: {backend.name} ({kernels.ENV}={os.environ.get(kernels.ENV, 'auto')}, device {device.type})",
              flush=True)
    if device.type == "cpu" and cfg.train.keep_freed_memory:
        from .kernels.cpu.allocator import keep_freed_memory
        keep_freed_memory()
    first_here = local_rank == 0  # says what this node builds (the others wait on the build's lock)
    say = (lambda line: print(line, flush=True)) if first_here else (lambda line: None)
    if backend.name == "cpu":  # built before any collective can wait on it
        build_cpu_kernels(say)
    if device.type == "cpu":  # init_distributed builds it
        announce_deepspeed_op(say)
    with printed_once_per_node(DEEPSPEED_OP_LINE, first_here):
        join_distributed(cfg.parallel.timeout_s)
    set_threads(device.type, int(os.environ["RANK"]))
    return Trainer(cfg, build_mesh(layout, int(os.environ["RANK"]), timeout_s=cfg.parallel.timeout_s), device, start)


class NeverJoined(RuntimeError):
    """The process group did not form: ranks of the world never reached the rendezvous."""


def join_distributed(timeout_s: float) -> None:
    """init_distributed, with a rendezvous that times out said as such: which ranks never joined
    (a node whose launcher never started) and after how long, not a failed collective."""
    from torch.distributed import DistError

    from .parallel.launch import init_distributed
    started = time.time()
    try:
        init_distributed(timeout_s)
    except (DistError, RuntimeError) as e:
        if not isinstance(e, DistError) and not is_gloo_failure(e):
            raise
        raise NeverJoined(never_joined_line(str(e), time.time() - started, timeout_s)) from None


def never_joined_line(error: str, waited_s: float, timeout_s: float) -> str:
    """One sentence for a rendezvous that timed out. The store's host (rank 0) knows how many ranks
    joined; every rank knows which ranks its own node's launcher started (a launcher gives each
    node a contiguous block: RANK - LOCAL_RANK onwards), so the others are the ones to look at."""
    import re
    world = int(os.environ.get("WORLD_SIZE", "1"))
    first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    mine = range(first, first + local_world_size())
    others = [r for r in range(world) if r not in mine]
    joined = re.search(r"(\d+)/(\d+) clients joined", error)
    count = f"{joined[1]} of {joined[2]} ranks joined; " if joined else ""
    node = os.environ.get("CROSS_RANK") or os.environ.get("GROUP_RANK")  # DeepSpeed's launcher, torchrun
    here = f"{f'node {node}' if node else 'this node'} started {_span(list(mine))}"
    missing = f"{_span(others)}, outside this node," if others else f"some of {_span(list(mine))}"
    return (f"the process group did not form after {waited_s:.0f} s (parallel.timeout_s={timeout_s:g}): {count}"
            f"{missing} never joined the rendezvous at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} ({here}); start every node's launcher (deepspeed --node_rank N, "
            f"or torchrun per node) with the same master address and port.")


def _span(ranks: list[int]) -> str:
    """"rank 3", "ranks 4-7" (a contiguous block) or "ranks 1, 5"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


# what gloo's own waits raise as a plain RuntimeError (work.wait() past the group's timeout, a peer gone)
GLOO_FAILURES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "gloo/transport")


def is_gloo_failure(e: BaseException) -> bool:
    return any(s in str(e) for s in GLOO_FAILURES)


def report_error(message: str, rank: int, world: int, same_on_every_rank: bool) -> None:
    """Print a one-sentence error once per job, not once per rank.

    same_on_every_rank (checks of the config and the run directory, which every rank makes
    alike before any process group): the first rank of every node prints it (each node's
    launcher has its own log: node 1's would otherwise hold only an exit code); the others wait
    a moment so that the launcher, which ends every rank once one fails, does not end the printing
    one first.
    Otherwise the first rank of this node to report that message prints it (a marker file
    named by the launcher's process, port and message): the rank that failed, once."""
    if same_on_every_rank or world == 1:
        if rank == 0 or os.environ.get("LOCAL_RANK", "0") == "0":
            print(message, file=sys.stderr, flush=True)
        elif same_on_every_rank:
            time.sleep(2)
        return
    key = f"{os.getppid()}|{os.environ.get('MASTER_PORT')}|{message}"
    marks = Path(tempfile.gettempdir()) / f"moe_trainer-errors-{os.getuid()}"
    marks.mkdir(exist_ok=True)
    for old in marks.iterdir():  # markers of finished jobs
        if time.time() - old.stat().st_mtime > 3600:
            old.unlink(missing_ok=True)
    try:
        os.close(os.open(marks / hashlib.sha256(key.encode()).hexdigest()[:24], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return  # another rank of this job printed it
    print(message if rank == 0 else f"{message} (rank {rank})", file=sys.stderr, flush=True)


def plan_command(argv: list[str]):
    """plan_run for a trainer command line (the arguments after `--module moe_trainer.train`), in
    the process that launches it: the start its ranks will make, without warnings; None when the
    arguments are wrong (the ranks say so)."""
    try:
        return plan_run(parse_args(argv), rank=0, warn=False)
    except (ConfigError, CheckpointError, DataError, HFFormatError, SystemExit):
        return None


def plan_run(args, rank: int, warn: bool = True):
    """This start (run_dir.Start): the config to run with, and the checkpoint it resumes. The data must
    be there. The run directory's config.yaml decides a resume (every rank reads it alike). A resume
    that continues that config.yaml takes its model from it and its weights from the checkpoint, so it
    never reads train.init_from (the directory may be gone by then); any other start checks it, and a
    Hugging Face directory's config.json gives the model section (the Trainer reads its weights only
    if no checkpoint is resumed)."""
    from .run_dir import plan_start
    # what the command writes itself: a --config it names and its --sets, with their values (auto stays auto)
    given = given_values(args.config, args.overrides)
    config = args.config or DEFAULT_CONFIG
    start = None
    try:  # the config as the command gives it, enough to find the checkpoint
        cfg = _command_config(config, args.overrides, check_data=True)
        start = plan_start(cfg, given, warn=warn and rank == 0)
    except DataVocabError:
        # the command alone cannot resolve vocab_size auto, as on a resume whose data keys are the saved
        # config.yaml's (a mixture's data.tokenizer): the merge resolves it; not a resume: decided below
        try:
            cfg = _command_config(config, args.overrides, resolve_data=False)
        except ConfigError:
            cfg = None
        start = plan_start(cfg, given, warn=warn and rank == 0) if cfg is not None else None
        start = start if start is not None and start.from_saved else None
    except ConfigError:
        pass  # e.g. a model section that only the init_from directory's config.json completes: decided below
    if start is None or (not start.from_saved and cfg.train.init_from):  # else the first reading stands
        cfg = _command_config(config, args.overrides, check_data=True, read_init_from=True)
        warned = start.warned if start is not None else set()
        start = plan_start(cfg, given, warn=warn and start is None and rank == 0)
        start.warned |= warned
    # the command's, not start.cfg's (a merge keeps the saved value where the command says auto):
    # Trainer.find_checkpoint verifies by it
    start.resume = cfg.train.resume
    resolve_tokenizer(start.cfg.data)  # the banner names it and config.yaml records it
    return start


def _command_config(config, overrides, **kw):
    """load_config of the command; a data.tokenizer naming the data's own tokenizer (what config.yaml
    records, e.g. a --config of an earlier run's config.yaml) counts as not given: it is derived."""
    cfg = load_config(config, overrides, **kw)
    if derived_tokenizer(cfg.data):
        cfg.data.tokenizer = ""
    return cfg


def check_inputs(start) -> None:
    """What every rank reads later, checked before the process group, the model and the engine (a
    truncated file would otherwise be found after a minute of set-up): train.init_from's headers,
    key set and shapes, and its tokenizer against the data's; on a resume, the tokenizer the run
    directory recorded against the data's."""
    from .data.agreement import check_same_tokenizer
    from .init_from import check_source, tokenizer_dir
    cfg = start.cfg
    # a mixture's sources share one tokenizer (config.py checks them together): the first stands for all
    data_path = cfg.data.path or (str(cfg.data.sources[0]["path"]) if cfg.data.sources else "")
    if start.checkpoint is None and cfg.train.init_from:
        check_source(cfg.model, Path(cfg.train.init_from))
        theirs = tokenizer_dir(Path(cfg.train.init_from))
        if theirs is not None:
            check_same_tokenizer(f"train.init_from {cfg.train.init_from}", theirs, data_path, cfg.data.tokenizer)
    out = Path(cfg.run.out_dir)
    if start.checkpoint is not None and (out / "tokenizer.json").is_file():
        check_same_tokenizer(f"the run directory {out}", out, data_path, cfg.data.tokenizer,
                             remedy="resume on the data it trained on (its data.path), or start a new run.out_dir")


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    keep_build_cache_per_environment()
    use_this_environments_ninja()
    try:
        start = plan_run(args, rank)
        _single_process_env()
        cfg = start.cfg
        layout = validate_layout(cfg, world, local_world_size())
    except ConfigError as e:
        report_error(f"config error: {e}", rank, world, same_on_every_rank=True)
        return 2
    except CheckpointError as e:
        report_error(f"error: {e}", rank, world, same_on_every_rank=True)
        return 2
    try:
        check_inputs(start)
    except (DataError, HFFormatError) as e:
        report_error(f"error: {e}", rank, world, same_on_every_rank=True)
        return 2
    if rank == 0:
        print(f"moe_trainer: {cfg.model.arch} on {world} rank(s) into {os.path.abspath(cfg.run.out_dir)}; "
              f"setting up kernels, the process group, the model and the DeepSpeed engine", flush=True)
    from torch.distributed import DistError

    from .kernels import KernelConfigError
    from .parallel.launch import report_collective_failure, shutdown_distributed
    from .trainer import NothingLeft, TrainingHalted

    try:
        trainer = make_trainer(cfg, layout, start)
        trainer.train()
    except NothingLeft as e:  # the ranks verified the finished run's checkpoint: before the engine
        if rank == 0:
            print(e, flush=True)
        shutdown_distributed()
        return 0
    except (DataError, CheckpointError, ConfigError, HFFormatError, KernelConfigError) as e:
        report_error(f"error: {e}", rank, world, same_on_every_rank=False)
        return 2
    except TrainingHalted as e:
        report_error(f"error: {e}", rank, world, same_on_every_rank=False)
        return 3
    except NeverJoined as e:  # no process group, no watch thread: this node's first rank says it
        report_error(f"error: {e}", rank, world, same_on_every_rank=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(4)
    except (DistError, RuntimeError) as e:  # a collective timed out or a peer went away (gloo, the CPU rings;
        # on NCCL the watchdog thread sees it instead, and launch.CollectiveWatch ends the job with the same line)
        if not isinstance(e, DistError) and not is_gloo_failure(e):
            raise
        report_collective_failure(e, rank, cfg.parallel.timeout_s)  # one line per job, naming the rank
        # end here, as the watch thread does: tearing down a process group whose peer is stopped can abort
        # in C++ ("terminate called without an active exception") and turn exit 4 into 250
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(4)
    shutdown_distributed()
    if rank == 0:
        print(f"run directory: {os.path.abspath(cfg.run.out_dir)}")
        print(f"tensorboard:   tensorboard --logdir {os.path.abspath(os.path.join(cfg.run.out_dir, 'tensorboard'))}")
    return 0


def exit_without_final_collection(code: int) -> None:
    """sys.exit(code) with every live object frozen first: the interpreter's teardown then skips
    its last full garbage collection, which walks the whole heap torch._dynamo and the inductor
    leave behind (1.5-2 s per rank on a laptop core). Files, atexit handlers and the streams
    are still closed and flushed as usual."""
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    exit_without_final_collection(main())
