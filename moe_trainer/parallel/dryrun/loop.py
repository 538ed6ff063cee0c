"""A simulated rank's process group and training loop, as a launched rank has them.

- `fake_backend`: torch.distributed.init_process_group as DeepSpeed calls it for NCCL (on a CUDA
  accelerator with the rank's GPU as device_id, so the mesh's groups are communicator splits), made
  with torch's fake backend.
- `run_loop`: the Trainer's own loop for STEPS steps, with the checks and observers it runs at some
  steps (replica check, logging with straggler naming and expert metrics, evaluation) at every step.
"""
from __future__ import annotations

import contextlib
import io

import torch
import torch.distributed as dist

from .nccl_rules import RuleError

STEPS = 2  # loop steps a rank runs: the second is a steady step (a straggler check needs one before it)
# the loop's checks and observers at every step, so their collectives run under the rules too
LOOP = ["train.log_every=1", "train.eval_every=1", "train.eval_batches=1", "train.replica_check_every=1",
        f"train.stop_at_step={STEPS}",
        "metrics.tensorboard=false"]  # rank 0's event files: no collective, and no values to histogram


@contextlib.contextmanager
def fake_backend(rank: int, world: int, device: torch.device, bound: list):
    """torch.distributed.init_process_group, as DeepSpeed calls it for NCCL (with device_id, the rank's
    GPU, on a CUDA accelerator), made with torch's fake backend at this rank and world on a HashStore
    (the collective watch clones it). The device DeepSpeed bound goes into `bound`; it must be the
    rank's own (NCCL's communicators live on it)."""
    base = dist.init_process_group

    def init(backend=None, init_method=None, timeout=None, world_size=-1, rank_=-1, store=None,
             group_name="", pg_options=None, device_id=None, **kwargs):
        if device_id is not None and torch.device(device_id) != device:
            raise RuleError(f"NCCL rule broken (a rank binds its own GPU): rank {rank} binds {device_id} to its "
                            f"process group, not {device}.")
        bound.append(device_id)
        base("fake", store=dist.HashStore(), rank=rank, world_size=world, device_id=device_id,
             **({"timeout": timeout} if timeout is not None else {}))

    dist.init_process_group = init
    try:
        yield
    finally:
        dist.init_process_group = base


def run_loop(trainer, mark, save) -> int:
    """trainer.train() for STEPS steps (train.stop_at_step), its console lines kept out of the report;
    `mark()` at each training step's start and end, `save()` in place of its checkpoint. Returns the
    step the loop ended at."""
    base_step = trainer.train_step

    def train_step():
        mark()
        try:
            return base_step()
        finally:
            mark()

    trainer.train_step, trainer.save_checkpoint = train_step, save
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return trainer.step
