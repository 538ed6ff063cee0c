"""train.keep_freed_memory: on glibc, large freed tensors are reused instead of being
unmapped and page-faulted in again on the next step (kernels.cpu.allocator.keep_freed_memory)."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    if sys.argv[1] == "on":
        from moe_trainer.kernels.cpu.allocator import keep_freed_memory
        assert keep_freed_memory()
    faults, rss = [], []
    for _ in range(30):
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(16 << 20)  # 64 MiB: above glibc's largest mmap threshold (32 MiB)
        x.fill_(1.0)
        del x
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
        rss.append(int(open("/proc/self/statm").read().split()[1]))
    print(*faults, rss[14], rss[29])
""")


def _faults(mode: str) -> tuple[list[int], int]:
    """Page faults of each of 30 allocate-fill-free rounds, and resident pages grown over the last 15."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    *faults, rss15, rss30 = [int(x) for x in out.stdout.split()]
    return faults, rss30 - rss15


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt")
def test_freed_tensors_are_reused_without_page_faults():
    pages = (64 << 20) // 4096
    (off, _), (on, grown) = _faults("off"), _faults("on")
    # glibc's default: every 64 MiB tensor is a fresh mapping, faulted in page by page
    assert min(off[-10:]) > pages // 2, off
    # kept: once the heap has grown (a few rounds, while glibc's per-thread cache holds the
    # small blocks that separate the large ones), the same memory comes back already mapped
    assert max(on[-10:]) < pages // 20, on
    assert grown < pages // 20, grown  # and the process stops growing
