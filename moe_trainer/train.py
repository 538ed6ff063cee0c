"""Entry point: `deepspeed --num_gpus N --module moe_trainer.train --config configs/X.yaml [--set a.b=v ...]`.

Also works with torchrun, or as a plain single process.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from .checkpoint import CheckpointError
from .config import ConfigError, given_keys, load_config, validate_layout
from .data import DataError
from .hf import HFFormatError


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="moe_trainer.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/moe_tiny.yaml", help="YAML run config (default: %(default)s)")
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


def _set_threads(device_type: str) -> None:
    """On CPU ranks, split the cores between the ranks of this node."""
    import torch
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def make_trainer(cfg, layout, start=None):
    """This rank's Trainer, the process set up as a launched rank: device, threads, allocator,
    kernels and the process group (the launcher's environment, or _single_process_env's).
    `start`: run_dir.plan_start's decision (None: the trainer makes it)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from .parallel.launch import init_distributed, keep_freed_memory
    from .parallel.mesh import build_mesh
    from .trainer import Trainer

    accel = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accel.set_device(local_rank)
    device = torch.device(accel.device_name(local_rank))
    _set_threads(device.type)
    if device.type == "cpu" and cfg.train.keep_freed_memory:
        keep_freed_memory()
    if device.type == "cpu":  # build (first run on a machine, ~20 s) before any collective can wait on it
        from .cpu_kernels import kernels
        kernels()
    init_distributed(cfg.parallel.timeout_s)
    return Trainer(cfg, build_mesh(layout, int(os.environ["RANK"])), device, start)


def report_error(message: str, rank: int, world: int, same_on_every_rank: bool) -> None:
    """Print a one-sentence error once per job, not once per rank.

    same_on_every_rank (checks of the config and the run directory, which every rank makes
    alike before any process group): rank 0 prints it; the others wait a moment so that the
    launcher, which ends every rank once one fails, does not end rank 0 before it has printed.
    Otherwise the first rank of this node to report that message prints it (a marker file
    named by the launcher's process, port and message): the rank that failed, once."""
    if same_on_every_rank or world == 1:
        if rank == 0:
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


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(args.config, args.overrides)
        _single_process_env()
        from .run_dir import plan_start
        # the run directory's config.yaml decides a resume: every rank reads it alike
        start = plan_start(cfg, given_keys(args.config, args.overrides), warn=rank == 0)
        cfg = start.cfg
        layout = validate_layout(cfg, world)
    except ConfigError as e:
        report_error(f"config error: {e}", rank, world, same_on_every_rank=True)
        return 2
    except CheckpointError as e:
        report_error(f"error: {e}", rank, world, same_on_every_rank=True)
        return 2
    if rank == 0:
        print(f"moe_trainer: {cfg.model.arch} on {world} rank(s) into {os.path.abspath(cfg.run.out_dir)}; "
              f"setting up kernels, the process group, the model and the DeepSpeed engine", flush=True)
    from .parallel.launch import shutdown_distributed
    from .trainer import TrainingHalted

    try:
        trainer = make_trainer(cfg, layout, start)
        trainer.train()
    except (DataError, CheckpointError, ConfigError, HFFormatError) as e:
        report_error(f"error: {e}", rank, world, same_on_every_rank=False)
        return 2
    except TrainingHalted as e:
        report_error(f"error: {e}", rank, world, same_on_every_rank=False)
        return 3
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
