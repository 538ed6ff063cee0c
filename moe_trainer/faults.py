"""Faults a long run meets: injected on purpose (debug.faults), and caught when they are real.

- Injection, for tests and the drill: `debug.faults=[KIND@STEP[:RANK], ...]`, steps 1-based as the
  console prints them. Each fault fires once per run directory (faults.jsonl records it), so a
  rollback or a restart does not fire it again. Unset, the trainer holds no Faults object and
  makes no call here.
- Silent data corruption: ReplicaCheck compares an exact checksum of every parameter across the
  ranks that should hold the same copy (dense weights over dp x cp, experts over their
  expert-data-parallel group), one small all-gather per check, and repairs a copy that differs by
  gathering the weights again from the ZeRO-1 owners' fp32 partitions. The owners' partitions have
  no replica under ZeRO-1; what is observable is that between a step's end and the next step's
  update each owner's fp32 partition, rounded to the model's dtype, is bit for bit its own slice of
  the model copy (owner_drift). A partition that differs while every replica agrees is the corrupt
  one: the trainer rolls back to the last good checkpoint.
- Loss spikes: SpikeGuard flags a loss or gradient norm far above its recent history; the trainer
  rolls back to the last checkpoint before the spike and skips the batches that led into it
  (PaLM's remedy).
- Stragglers: straggler_events names the ranks whose compute time per step is far above the median.
"""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

KINDS = ("bitflip", "bitflip_master", "spike", "hang", "slow", "kill", "nan")
# what one rank suffers; spike and nan are the whole step's
NEEDS_RANK = ("bitflip", "bitflip_master", "hang", "slow", "kill")
SPIKE_LR_FACTOR = 1000.0
SLOW_SECONDS = 0.3
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<rank>\d+))?$")


class FaultSpecError(ValueError):
    """A debug.faults entry that does not parse: one sentence."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # 1-based, as the console prints steps
    rank: Optional[int]  # None: every rank takes part (spike, nan)

    @property
    def spec(self) -> str:
        return f"{self.kind}@{self.step}" + (f":{self.rank}" if self.rank is not None else "")


def parse_faults(items, world: Optional[int] = None) -> list[Fault]:
    """`["bitflip@3:1", "spike@9"]` -> Faults, or FaultSpecError naming the entry."""
    out = []
    for item in items or []:
        m = _SPEC.match(str(item).strip())
        if not m or m["kind"] not in KINDS:
            raise FaultSpecError(f"debug.faults entry {item!r} must be KIND@STEP[:RANK] with KIND one of "
                                 f"{', '.join(KINDS)} (e.g. bitflip@3:1, spike@9).")
        kind, step = m["kind"], int(m["step"])
        rank = int(m["rank"]) if m["rank"] is not None else (0 if kind in NEEDS_RANK else None)
        if step < 1:
            raise FaultSpecError(f"debug.faults entry {item!r}: steps count from 1.")
        if kind not in NEEDS_RANK and m["rank"] is not None:
            raise FaultSpecError(f"debug.faults entry {item!r}: {kind} acts on the whole step; drop ':{rank}'.")
        if world is not None and rank is not None and rank >= world:
            raise FaultSpecError(f"debug.faults entry {item!r} names rank {rank}, but the world has {world} rank(s).")
        out.append(Fault(kind, step, rank))
    return out


class Faults:
    """The run's planned faults for this rank, each fired at most once per run directory."""

    RECORD = "faults.jsonl"

    def __init__(self, faults: list[Fault], out_dir: Path, rank: int):
        self.rank = rank
        self.path = Path(out_dir) / self.RECORD
        fired = set()
        if self.path.is_file():  # written before this start by the ranks that fired them
            for line in self.path.read_text().splitlines():
                try:
                    fired.add(json.loads(line)["fault"])
                except (ValueError, KeyError):
                    continue  # a line cut short by a kill: that fault fired
        self.pending = [f for f in faults if f.spec not in fired]
        self.slow_from: Optional[int] = None

    def _take(self, kind: str, step: int) -> Optional[Fault]:
        """The pending fault of `kind` at `step` for this rank, marked fired (every rank that takes
        part marks it in memory; one writes the record)."""
        for f in self.pending:
            if f.kind == kind and f.step == step and f.rank in (None, self.rank):
                self.pending.remove(f)
                if f.rank == self.rank or (f.rank is None and self.rank == 0):
                    with open(self.path, "a") as fh:
                        fh.write(json.dumps({"fault": f.spec, "rank": self.rank, "time": time.time()}) + "\n")
                        fh.flush()
                        os.fsync(fh.fileno())  # kill and hang come next: the record must be on disk first
                return f
        for f in list(self.pending):  # faults for other ranks at this step: fired there, not here
            if f.kind == kind and f.step == step:
                self.pending.remove(f)
        return None

    def lr_factor(self, step: int) -> float:
        """spike@S: step S's learning rate times 1,000, on every rank alike."""
        return SPIKE_LR_FACTOR if self._take("spike", step) else 1.0

    def poison(self, step: int) -> bool:
        """nan@S: step S's loss made non-finite."""
        return self._take("nan", step) is not None

    def before_step(self, step: int) -> None:
        """kill, hang and slow, at the start of step S on their rank."""
        if self._take("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._take("hang", step):
            threading.Event().wait()  # stalls here, alive, until the job is ended from outside
        if self._take("slow", step):
            self.slow_from = step

    def slow_delay(self, step: int) -> float:
        """slow@S:R: the seconds rank R loses on each step from S on (spent where it loads its batch)."""
        return SLOW_SECONDS if self.slow_from is not None and step >= self.slow_from else 0.0

    def after_update(self, step: int, model: torch.nn.Module) -> Optional[str]:
        """bitflip@S:R: after step S's update, the highest exponent bit of one element of a dense
        weight of rank R flipped. Returns the parameter's name."""
        if not self._take("bitflip", step):
            return None
        # a dense matrix every forward reads (an embedding's row 0 may belong to a token that never occurs)
        name, p = next((n, p) for n, p in model.named_parameters()
                       if p.is_floating_point() and p.dim() == 2 and "embed" not in n and getattr(p, "allreduce", True))
        bits = {torch.float32: (torch.int32, 1 << 30), torch.bfloat16: (torch.int16, 1 << 14),
                torch.float16: (torch.int16, 1 << 14)}
        int_dtype, mask = bits[p.dtype]
        with torch.no_grad():
            flat = p.data.view(-1).view(int_dtype)
            flat[0] ^= mask
        return name


    def after_update_master(self, step: int, engine) -> Optional[int]:
        """bitflip_master@S:R: after step S's update, the highest exponent bit of the first element
        of rank R's fp32 master partition (the ZeRO-1 owner's copy, of the first param group)
        flipped. Returns the element count of that partition."""
        if not self._take("bitflip_master", step):
            return None
        master, _ = owner_partitions(engine)[0]
        with torch.no_grad():
            master.data.view(-1).view(torch.int32)[0] ^= 1 << 30
        return master.numel()


# ----------------------------------------------------------------------------- replica check

def checksums(params: list[torch.Tensor]) -> torch.Tensor:
    """(len(params),) int64 on the parameters' device: each parameter's bits summed as integers,
    exact and the same for the same bytes whatever the reduction order."""
    if not params:
        return torch.zeros(0, dtype=torch.int64)
    views = {4: torch.int32, 2: torch.int16, 8: torch.int64}
    return torch.stack([torch.sum(p.detach().reshape(-1).view(views[p.element_size()]), dtype=torch.int64)
                        for p in params])


class ReplicaCheck:
    """Every `every` steps, before the step's forward: do the data-parallel replicas hold the same
    weights? Dense parameters are compared over dp x cp, experts over their expert-data-parallel
    group, by one all-gather of per-parameter checksums each."""

    def __init__(self, model: torch.nn.Module, mesh, every: int):
        self.every, self.mesh = every, mesh
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.sets = []  # (group, names, params) of the parameters replicated over that group
        for kind, expert in (("dpcp", False), ("edp", True)):
            group = mesh.group(kind)
            chosen = [(n, p) for n, p in named if (getattr(p, "allreduce", True) is False) == expert]
            if group is not None and chosen:
                self.sets.append((group, mesh.size(kind), [n for n, _ in chosen], [p for _, p in chosen]))

    def due(self, step: int) -> bool:
        return bool(self.every) and step > 0 and step % self.every == 0

    def mismatched(self) -> torch.Tensor:
        """A () int64 on the device: 1 where this rank's replica groups disagree. Collective over
        each replica group."""
        flag = None
        for group, size, _, params in self.sets:
            mine = checksums(params)
            rows = torch.empty(size * mine.numel(), dtype=mine.dtype, device=mine.device)
            dist.all_gather_into_tensor(rows, mine, group=group)
            bad = (rows.view(size, -1) != mine).any().to(torch.int64)
            flag = bad if flag is None else torch.maximum(flag, bad)
        return flag if flag is not None else torch.zeros((), dtype=torch.int64)

    def local_sums(self) -> list[torch.Tensor]:
        return [checksums(params) for _, _, _, params in self.sets]

    def changed(self, before: list[torch.Tensor]) -> list[str]:
        """The names of this rank's parameters whose bits differ from `before`. Host sync."""
        out = []
        for (_, _, names, _), old, new in zip(self.sets, before, self.local_sums()):
            out += [names[i] for i in (old != new).nonzero().flatten().tolist()]
        return out


def owner_partitions(engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fp32 master partition, this rank's slice of the flat model copy) per optimizer param group:
    DeepSpeedZeroOptimizer's and BF16_Optimizer's names for the same two tensors."""
    from .parallel.zero import fp32_partitions, uses_bf16_optimizer
    opt = engine.optimizer
    copies = opt.bf16_partitioned_groups if uses_bf16_optimizer(engine) else opt.parallel_partitioned_bit16_groups
    return [(master, copies[i][dist.get_rank(group=opt.real_dp_process_group[i])])
            for i, master in enumerate(fp32_partitions(engine))]


def owner_drift(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A () int64 on the device: 1 where an owner's fp32 partition, rounded to the model's dtype (what
    the step's end copies into the model), differs in any bit from its slice of the model copy. No
    collective; one pass over this rank's partitions."""
    ints = {4: torch.int32, 2: torch.int16}
    flag = torch.zeros((), dtype=torch.int64, device=pairs[0][0].device if pairs else None)
    for master, copy in pairs:
        rounded = master.detach().to(copy.dtype).view(ints[copy.element_size()])
        flag = torch.maximum(flag, (rounded != copy.detach().view(ints[copy.element_size()])).any().to(torch.int64))
    return flag


def repair_from_owners(engine) -> None:
    """Every rank's weights gathered again from the ZeRO-1 owners' fp32 partitions (DeepSpeed's
    update_lp_params, on DeepSpeedZeroOptimizer and BF16_Optimizer alike): what the step's own
    all-gather does, so a repaired copy holds exactly the bits a clean one does. Collective."""
    engine.optimizer.update_lp_params()


# ----------------------------------------------------------------------------- loss spikes

@dataclass(frozen=True)
class SpikeRule:
    """A spike: the loss above `loss_ratio` x the median of the last `window` steps, or the gradient
    norm above `grad_ratio` x theirs, once `min_history` steps are known."""

    window: int = 16
    min_history: int = 8
    loss_ratio: float = 2.0
    grad_ratio: float = 10.0


class SpikeGuard:
    def __init__(self, rule: SpikeRule = SpikeRule()):
        self.rule = rule
        self.losses: deque = deque(maxlen=rule.window)
        self.norms: deque = deque(maxlen=rule.window)

    def check(self, loss: float, grad_norm: Optional[float]) -> Optional[str]:
        """A sentence if this step spiked (its values then stay out of the history), else None."""
        r = self.rule
        reason = None
        if len(self.losses) >= r.min_history and loss > r.loss_ratio * statistics.median(self.losses):
            reason = f"loss {loss:.4g} > {r.loss_ratio:g} x the median {statistics.median(self.losses):.4g} of " \
                     f"the last {len(self.losses)} steps"
        elif grad_norm is not None and len(self.norms) >= r.min_history and \
                grad_norm > r.grad_ratio * statistics.median(self.norms):
            reason = f"gradient norm {grad_norm:.4g} > {r.grad_ratio:g} x the median " \
                     f"{statistics.median(self.norms):.4g} of the last {len(self.norms)} steps"
        if reason is None:
            self.losses.append(loss)
            if grad_norm is not None:
                self.norms.append(grad_norm)
        return reason

    def reset(self) -> None:
        self.losses.clear()
        self.norms.clear()

    def state_dict(self) -> dict:
        """The history (global values: reduced losses, the global gradient norm), so that a resumed
        run judges its first step as the uninterrupted run would."""
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, state: dict) -> None:
        self.reset()
        self.losses.extend(float(x) for x in state["losses"])
        self.norms.extend(float(x) for x in state["norms"])


# ----------------------------------------------------------------------------- stragglers

def straggler_events(times: list[float], step: int, factor: float) -> list[dict]:
    """Ranks whose compute time this step is above `factor` x the median of all ranks'."""
    median = statistics.median(times)
    if median <= 0:
        return []
    return [{"event": "straggler", "rank": r, "step": step, "ratio": round(t / median, 3)}
            for r, t in enumerate(times) if t > factor * median]
