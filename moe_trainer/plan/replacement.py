"""A run's measured expert load in the step-time model: the busiest EP rank's share as the experts sit
at home (natural), and what online re-placement (parallel.replace_every, parallel.redundant_slots)
makes of it at any ep, with the traffic it costs (time.Replacement).

The load is a run directory's expert_load/ files (expert_load/files.py): per logging interval, the
tokens routed to each expert of each MoE layer. Expert ids do not depend on the layout, so one run's
load places its experts at any ep that divides them.

Re-placement is replayed as the trainer's Replacer decides (moe/placement/online.py's `replan`): the
files are grouped into the intervals between decisions (a file at step N in interval (N - 1) //
replace_every); each decision places the experts on one interval's summed load, relabeled against the
placement before it, and is held against the next interval's files, which it did not see. So the
figure is out of sample, as a run meets it. The owned slots are placed by EPLB's greedy
(eplb_reference), fast enough for 256 experts at every ep the layout search tries; the Replacer's own
search (rebalance_experts) is never worse per layer, so the planner's share is an upper bound of the
trainer's, up to the copies' greedy fill after it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .params import PlanError
from .time import Replacement, step_time

DECISIONS = 4  # the last decisions replayed: the moves and shares in steady state, in seconds for 671B


@dataclass(frozen=True)
class MeasuredLoad:
    """A run's expert load: (step, counts (MoE layers, experts) float64) per file, by step."""

    run_dir: str
    records: tuple

    @property
    def experts(self) -> int:
        return self.records[0][1].shape[1]


def read_load(run_dir: str) -> MeasuredLoad:
    """Every readable expert_load/ file of a run directory (PlanError, one sentence, where none is)."""
    from ..expert_load.files import ExpertLoadError, iter_expert_load, list_expert_load_files
    if not Path(run_dir).is_dir():
        raise PlanError(f"--load {run_dir} is not a run directory.")
    try:
        records = [(r.step, r.counts.double()) for r in iter_expert_load(list_expert_load_files(run_dir))]
    except ExpertLoadError as e:
        raise PlanError(f"--load {run_dir}: {e}") from None
    if not records:
        raise PlanError(f"--load {run_dir} has no readable expert_load/ files (a MoE run writes them).")
    return MeasuredLoad(run_dir, tuple(records))


def _check_ep(load: MeasuredLoad, ep: int) -> None:
    if load.experts % ep:
        raise PlanError(f"--load {load.run_dir} counts {load.experts} experts, which ep {ep} does not divide.")


def natural_imbalance(load: MeasuredLoad, ep: int) -> float:
    """The busiest EP rank's load over the mean with the experts at home (expert e on rank e // (E / ep)):
    per file and MoE layer, averaged over layers and files."""
    from ..moe.placement.online import home_row
    _check_ep(load, ep)
    n_layers, e = load.records[0][1].shape
    home, none = [home_row(e)] * n_layers, [[] for _ in range(n_layers)]
    return sum(_share(counts, home, none, ep) for _, counts in load.records) / len(load.records)


@dataclass(frozen=True)
class Replaced:
    """Re-placement replayed on a run's load at one ep."""

    imbalance: float  # the busiest EP rank's share under the placements, on the files they did not see
    replacement: Replacement  # their traffic, per MoE layer (time.replacement_seconds charges it)
    decisions: int  # replayed
    applied: int  # of them, those that paid (all without a rule)
    in_sample: bool  # the run logged one interval only: placed and held against the same load

    def source(self, every: int, redundant: int) -> str:
        copies = f" with {redundant} redundant slot{'s' * (redundant > 1)} a rank" if redundant else ""
        held = "the interval it was placed on (the run logged one: optimistic)" if self.in_sample else \
            "the next interval's load"
        return (f"re-placed every {every} steps{copies}: {self.decisions} decisions replayed ({self.applied} "
                f"applied), each held against {held}")


def _intervals(load: MeasuredLoad, every: int) -> list[list[torch.Tensor]]:
    """The files' counts grouped into the intervals between decisions, in step order."""
    out: dict[int, list[torch.Tensor]] = {}
    for step, counts in load.records:
        out.setdefault((step - 1) // every, []).append(counts)
    return [out[k] for k in sorted(out)]


def _share(counts: torch.Tensor, rows: list[list[int]], copies: list[list[int]], ep: int) -> float:
    """The busiest EP rank's load over the mean under a placement, averaged over the MoE layers."""
    from ..moe.placement.online import mean_imbalance, rank_loads
    return mean_imbalance([rank_loads(counts[i], rows[i], ep, copies[i]) for i in range(len(rows))])


def replaced(load: MeasuredLoad, ep: int, every: int, redundant: int,
             pays: Optional[Callable[[float, float, Replacement, Replacement], bool]] = None) -> Replaced:
    """The last DECISIONS re-placements of the run replayed at `ep` (module docstring): the busiest rank's
    share they leave, and per MoE layer the experts the busiest sender moves per decision, the share of
    layers a decision changes and the copies the busiest rank refreshes and hands back each step.
    `pays(share kept, share placed, traffic kept, traffic placed)` (both shares on the load the decision
    sees) says whether a decision is applied, as the Replacer's auto policy weighs its predicted saving
    against the move (`paying`); without it every decision is."""
    from ..moe.placement import eplb_reference
    from ..moe.placement.online import copy_rows, home_row, moved_experts, replan
    _check_ep(load, ep)
    if every < 1:
        raise PlanError(f"re-placement needs parallel.replace_every >= 1, got {every}.")
    groups = _intervals(load, every)
    in_sample = len(groups) == 1
    pairs = [(groups[0], groups[0])] if in_sample else list(zip(groups[:-1], groups[1:]))[-DECISIONS:]
    n_layers, e = load.records[0][1].shape
    rows, copies = [home_row(e) for _ in range(n_layers)], [[-1] * (ep * redundant) for _ in range(n_layers)]
    kept = Replacement(every, 0.0, 0.0, 0.0)
    shares, traffic, applied = [], [], 0
    for seen, next_ in pairs:
        window = sum(seen)
        new, held = replan(window, rows, ep, redundant, eplb_reference)
        per_layer = [moved_experts(old, n, ep) for old, n in zip(rows, new)]
        placed = Replacement(every, sum(max(m) for m in per_layer) / n_layers,
                             sum(old != n for old, n in zip(rows, new)) / n_layers,
                             sum(copy_rows(new[i], held[i], ep, redundant) for i in range(n_layers)) / n_layers)
        if pays is None or pays(_share(window, rows, copies, ep), _share(window, new, held, ep), kept, placed):
            rows, copies, applied = new, held, applied + 1
            traffic.append(placed)
            kept = dataclasses.replace(placed, moved=0.0, changed=0.0)  # the copies stay until the next move
        else:
            traffic.append(kept)
        shares += [_share(counts, rows, copies, ep) for counts in next_]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    rep = Replacement(every, mean([t.moved for t in traffic]), mean([t.changed for t in traffic]),
                      mean([t.copies for t in traffic]))
    return Replaced(mean(shares), rep, len(pairs), applied, in_sample)


def paying(s, gpu, eff, mech) -> Callable[[float, float, Replacement, Replacement], bool]:
    """The Replacer's auto policy in the step model's terms: a decision is applied where the step with it
    (the placed share, its moves shared over the interval, its copies) is shorter than the step without
    (the kept share and copies), i.e. where the saving over the interval exceeds the move's cost."""
    def pays(kept_share: float, placed_share: float, kept: Replacement, placed: Replacement) -> bool:
        return step_time(s, gpu, eff, mech, placed_share, placed).step < \
            step_time(s, gpu, eff, mech, kept_share, kept).step
    return pays


def at_layout(load: MeasuredLoad, ep: int, every: int, redundant: int,
              pays: Optional[Callable] = None) -> tuple[float, Optional[Replacement], str]:
    """The load a layout at `ep` meets: (the busiest EP rank's share, the re-placement's traffic or None,
    where the share comes from); re-placed where the config re-places (`every` > 0; decisions applied
    where `pays`, see `replaced`), else at home."""
    if every and ep > 1:
        r = replaced(load, ep, every, redundant, pays)
        return r.imbalance, r.replacement, f"{load.run_dir} {r.source(every, redundant)}"
    return natural_imbalance(load, ep), None, f"measured from {load.run_dir}, experts at home"
