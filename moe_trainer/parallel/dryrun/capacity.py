"""Capacity: where a simulated rank's peak fake-CUDA bytes live, and whether they fit the card.

`SiteMeter` is the dry run's MemoryMeter that also names the code behind the bytes: every storage
of at least `min_bytes` is tagged, when it is created, with the call site that made it (the
innermost moe_trainer frame outside SKIP; in the autograd engine's device thread, where backward ops run, the
frame of the main thread that called backward and the autograd node running). At each new peak it
keeps the live bytes per site, so a rank's report can list what held the memory at its peak.

`verdict` turns a finished dry run into the capacity check: the rank whose peak is over the card,
one sentence with its peak, the largest call sites at that peak and the settings that the planner,
calibrated by that rank's measured peak / plan ratio, says would bring it under.
"""
from __future__ import annotations

import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .fake_cuda import MemoryMeter, call_site

GB = 1e9
TAG_BYTES = 1 << 20  # storages below this size are counted but not tagged (a stack walk each)
TOP_SITES = 4  # call sites the sentence names
# frames a site skips: the dry run itself, and the kernels and layers every model calls (the model's
# line that called them says more)
SKIP = ("/parallel/dryrun/", "/kernels/", "/models/layers.py")


def _main_thread_site() -> str:
    """The site a backward op belongs to when the autograd engine runs it on its device thread: the
    moe_trainer frame of the main thread (blocked in .backward()), and the node being run."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    where = "?"
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/moe_trainer/" in path and not any(skip in path for skip in SKIP):
            where = "moe_trainer/" + path.split("/moe_trainer/", 1)[1] + f":{frame.f_lineno}"
            break
        frame = frame.f_back
    node = torch._C._current_autograd_node()
    return f"{where} (backward: {node.name()})" if node is not None else f"{where} (backward)"


def tensor_site() -> str:
    """Where the tensor being created comes from (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return _main_thread_site()
    site = call_site(SKIP)
    node = torch._C._current_autograd_node()
    return f"{site} (backward: {node.name()})" if node is not None else site


@dataclass(frozen=True)
class Site:
    """Bytes that one call site held live at a rank's peak."""

    site: str
    bytes: int
    tensors: int

    def as_json(self) -> dict:
        return {"site": self.site, "bytes": self.bytes, "tensors": self.tensors}


class SiteMeter(MemoryMeter):
    """MemoryMeter with the live bytes per call site, and their split at the peak (module docstring)."""

    def __init__(self, min_bytes: int = TAG_BYTES):
        super().__init__()
        self.min_bytes = min_bytes
        self._site_of: dict[int, tuple[str, int]] = {}  # storage key -> (site, epoch it was made in)
        self._epoch = 0  # one per reset: a rank's sites count its own storages only
        self._live: Counter = Counter()  # site -> bytes live (this epoch)
        self._count: Counter = Counter()  # site -> storages live (this epoch)
        self._at_peak: tuple[int, dict, dict] = (0, {}, {})  # (peak, bytes per site, count per site)
        self._best: tuple[int, dict, dict] = (-1, {}, {})  # the highest peak since the last take

    def reset(self) -> None:
        self._keep_best()
        super().reset()
        self._epoch += 1
        self._live, self._count = Counter(), Counter()
        self._at_peak = (0, {}, {})

    def _hold(self, storage) -> int:
        new = storage._cdata not in self._bytes
        if new and storage.nbytes() >= self.min_bytes:  # tagged before it counts, so a new peak sees it
            site = tensor_site()
            self._site_of[storage._cdata] = (site, self._epoch)
            self._live[site] += storage.nbytes()
            self._count[site] += 1
        return super()._hold(storage)

    def _raise_top(self) -> None:
        super()._raise_top()
        if self.peak - self._at_peak[0] >= self.min_bytes:  # within 1 MiB of the peak is close enough
            self._at_peak = (self.peak, dict(self._live), dict(self._count))

    def _release(self, key: int) -> None:
        tagged = self._site_of.get(key) if self._refs[key] == 1 else None
        if tagged is not None:
            del self._site_of[key]
            site, epoch = tagged
            if epoch == self._epoch:
                self._live[site] -= self._bytes[key]
                self._count[site] -= 1
        super()._release(key)

    def _keep_best(self) -> None:
        if self._at_peak[0] > self._best[0]:
            self._best = self._at_peak

    def take_peak_sites(self, top: int = 30) -> list[Site]:
        """The call sites that held the most bytes at the highest peak since the last take (over the
        passes a rank ran), largest first; then start over for the next rank."""
        self._keep_best()
        _, live, count = self._best
        self._best, self._at_peak = (-1, {}, {}), (0, {}, {})
        sites = [Site(s, b, count.get(s, 0)) for s, b in live.items() if b > 0]
        return sorted(sites, key=lambda s: -s.bytes)[:top]


# ----------------------------------------------------------------------------- a steady step's state

def prime_optimizer_state(engine) -> None:
    """Adam's moments (and step counter) for every parameter the wrapped torch optimizer steps, as
    torch's Adam makes them lazily in its first step: a dry run trains one step, whose backward
    would otherwise peak without them, lower than every step after it does. The values do not
    matter (fake tensors); the state is what the first step's own initialisation would create."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed wraps the torch optimizer
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if state:
                continue
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# ----------------------------------------------------------------------------- the verdict

@dataclass(frozen=True)
class Knob:
    """One setting the planner says would bring the run under the card."""

    overrides: tuple  # what to --set
    bytes: float  # the planner's heaviest rank with it, scaled by the measured peak / plan

    def text(self) -> str:
        return " ".join(f"--set {o}" for o in self.overrides) + f" (about {self.bytes / GB:.1f} GB)"


def _planned_peak(config: str, overrides: Sequence[str], world: int) -> Optional[float]:
    """The planner's heaviest rank for `config` + `overrides` at `world` GPUs, None if that layout is
    not valid (a pp that does not divide, a micro-batch that does not divide the batch)."""
    from ...config import ConfigError
    from ...resolve import load_config
    from ...plan import PlanError, make_plan
    try:
        cfg = load_config(config, list(overrides))
        if cfg.train.dtype == "auto":
            cfg.train.dtype = "bf16"
        return make_plan(cfg, world).peak_bytes
    except (ConfigError, PlanError):
        return None


def knobs(config: str, overrides: Sequence[str], world: int, limit: float, ratio: float) -> list[Knob]:
    """For each knob (micro-batch, recomputation, pipeline stages), the least change that the planner,
    scaled by `ratio` (the rank's measured peak / its plan), puts under `limit` bytes."""
    from ...resolve import load_config
    cfg = load_config(config, list(overrides))
    base = list(overrides) + (["parallel.micro_batches=0"] if cfg.parallel.micro_batches else [])
    tries: list[list[tuple]] = [
        [(f"train.micro_batch_size={mbs}",) for mbs in _halvings(cfg.train.micro_batch_size)],
        [("parallel.recompute=full",)] if cfg.parallel.recompute != "full" else [],
        [(f"parallel.pp={pp}",) for pp in _doublings(cfg.parallel.pp, cfg.model.num_hidden_layers)],
    ]
    found = []
    for options in tries:
        for option in options:
            peak = _planned_peak(config, base + list(option), world)
            if peak is not None and peak * ratio <= limit:
                found.append(Knob(option, peak * ratio))
                break
    return found


def _halvings(n: int) -> list[int]:
    out = []
    while n > 1:
        n //= 2
        out.append(n)
    return out


def _doublings(pp: int, layers: int) -> list[int]:
    out = []
    while pp * 2 <= layers:
        pp *= 2
        out.append(pp)
    return out


def _sites_text(sites: Sequence[dict]) -> str:
    return ", ".join(f"{s['site']} {s['bytes'] / GB:.1f} GB ({s['tensors']} tensor{'s' if s['tensors'] != 1 else ''})"
                     for s in sites[:TOP_SITES])


def verdict(run, limit_gb: float, config: str, overrides: Sequence[str],
            find_knobs: Callable = knobs) -> Optional[str]:
    """One sentence for the heaviest rank over `limit_gb` (None when every rank fits): its peak beside
    the card and the plan, the call sites that held the most at its peak, and the knobs that would
    bring it under."""
    limit = limit_gb * GB
    over = sorted((rep for rep in run.ranks.values() if rep.peak_bytes > limit), key=lambda rep: -rep.peak_bytes)
    if not over:
        return None
    rep = over[0]
    others = f" (and {len(over) - 1} other rank{'s' if len(over) > 2 else ''} over it)" if len(over) > 1 else ""
    ratio = rep.peak_bytes / rep.plan_bytes if rep.plan_bytes else 1.0
    found = find_knobs(config, overrides, run.world, limit, ratio)
    if found:
        fix = "it would fit with " + (", ".join(k.text() for k in found[:-1]) + " or " if len(found) > 1 else "") + \
            found[-1].text()
    else:
        fix = ("no single knob brings it under (micro-batch down to 1, full recomputation, pipeline stages up to "
               "the layer count): more GPUs per replica (tp, ep) or a larger card")
    return (f"rank {rep.rank} ({rep.role}) peaks at {rep.peak_bytes / GB:.1f} GB, more than --gpu-memory-gb "
            f"{limit_gb:g}{others} (the planner's estimate for its stage: {rep.plan_bytes / GB:.1f} GB); most "
            f"held at the peak: {_sites_text(rep.peak_sites)}; {fix}.")


def capacity_line(run, limit_gb: float, config: str, overrides: Sequence[str]) -> str:
    """The heaviest rank that ran against the card, beside the planner's verdict for the same card."""
    rep = max(run.ranks.values(), key=lambda r: r.peak_bytes)
    planned = _planned_peak(config, overrides, run.world)
    fits = "fits" if rep.peak_bytes <= limit_gb * GB else "does NOT fit"
    plan = "" if planned is None else (f"; the planner's heaviest rank: {planned / GB:.1f} GB, "
                                       f"{'fits' if planned <= limit_gb * GB else 'does NOT fit'}")
    return (f"capacity: the heaviest rank that ran (rank {rep.rank}) peaks at {rep.peak_bytes / GB:.1f} GB and "
            f"{fits} in --gpu-memory-gb {limit_gb:g}{plan}")
