"""The emulated link (`debug.link_gbps`, `debug.link_latency_us`; 0 = off): benchmarks and tests only.

Every expert-parallel all-to-all completes no earlier than latency + bytes / bandwidth after it was
issued, where bytes is the larger of what this rank sends to and receives from other ranks (a rank's
link carries both directions at once). The hold is a deadline: whoever completes the all-to-all
sleeps only for what is left of it (a sleep, no busy core), so an all-to-all issued before some
compute costs nothing more when the compute outlasts it; a blocking one sleeps the whole delay.
It models an NVLink or InfiniBand link scaled down to CPU ranks' compute speed, so that the
overlapped executor's hiding can be measured on them.
"""
from __future__ import annotations

import time

_GBPS = 0.0  # gigabits per second; 0: no bandwidth term
_LATENCY_S = 0.0


def configure(gbps: float = 0.0, latency_us: float = 0.0) -> None:
    global _GBPS, _LATENCY_S
    _GBPS, _LATENCY_S = float(gbps), float(latency_us) * 1e-6


def enabled() -> bool:
    return _GBPS > 0 or _LATENCY_S > 0


def now() -> float:
    """The link's clock (perf_counter seconds): when an all-to-all is issued. Only the emulated link reads
    it; the trainer's own timing goes through StepClock."""
    return time.perf_counter()


def deadline(issued: float, nbytes: int) -> float:
    """perf_counter time before which an all-to-all of `nbytes` issued at `issued` may not complete."""
    return issued + _LATENCY_S + (nbytes * 8 / (_GBPS * 1e9) if _GBPS > 0 else 0.0)


def hold(until: float) -> None:
    """Sleep until `until` (perf_counter seconds), if it is still ahead."""
    left = until - time.perf_counter()
    if left > 0:
        time.sleep(left)
