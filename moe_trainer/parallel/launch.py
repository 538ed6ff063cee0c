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


def keep_freed_memory() -> bool:
    """On glibc, stop handing freed memory back to the OS (CPU ranks).

    By default glibc serves every allocation above its mmap threshold (at most
    32 MB) with a fresh mmap and unmaps it on free, so each training step pays
    page faults to zero the same large buffers again (the optimizer's fp32
    copies, expert gradients): on a 2-core machine that was a third of a bf16
    step. With mmap off for the main arena and trimming only above 2 GB, freed
    blocks are reused, as tcmalloc or jemalloc would. The price is some
    fragmentation: the heap grows for the first few steps and peak RSS was
    5-20% higher on moe_bench (tests/test_cpu_memory.py checks that it stops
    growing). Returns False (and changes nothing) where the C library is not
    glibc.
    """
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
