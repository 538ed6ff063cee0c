"""glibc allocator settings for CPU ranks."""
from __future__ import annotations


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
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
