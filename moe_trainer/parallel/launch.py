"""Process-group start-up on any accelerator (DeepSpeed picks gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def init_distributed(timeout_s: int) -> None:
    """deepspeed.init_distributed with the collective timeout, then tidy up after it.

    torchrun does not set LOCAL_SIZE, which DeepSpeed's CPU shared-memory op
    reads (it crashes without it); copy it from LOCAL_WORLD_SIZE.
    """
    import deepspeed
    if "LOCAL_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))
    dist.barrier()  # every rank has mapped every peer's shared-memory segment by now
    unlink_shm_segment(dist.get_rank())


def shutdown_distributed() -> None:
    """End a finished run on every rank together: a barrier, then the process group torn down.

    Ranks that simply exit leave their peers' gloo connections to break under them; a
    rank still tearing down its own process group (e.g. rank 0 after writing the pipeline
    trace) could then abort in C++ ("terminate called without an active exception",
    exit -6) after a run that succeeded."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def unlink_shm_segment(rank: int) -> None:
    """DeepSpeed's CPU accelerator never unlinks its ~66 MB /dev/shm workspace per
    rank, so every launch leaks RAM until reboot. Once all ranks have mapped it
    the name can go; the mappings stay valid."""
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}"
            f"_{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
