"""Applying an expert placement plan (`parallel.expert_placement`) to expert parallelism.

A plan (tools/expert_load.py plan, the EPLB problem) gives, per MoE layer, the
logical expert of each of R physical slots; plan GPU g holds slots
[g*S, (g+1)*S), S = R / ep. The canonical expert weights stay where expert
parallelism puts them (expert e on EP rank e // (E/ep)): a plan changes no
parameter, no optimizer state and no checkpoint, so it can be added, changed or
removed at any resume.

Per layer this module (host side, no collectives) relabels the plan's GPUs to
EP ranks so that most slots hold an expert whose weights are already on that
rank, and derives what each rank must fetch: `LayerPlacement`. The dispatcher
(parallel/expert.py) uses it to route tokens to physical slots and to fetch the
weights of its slots' foreign experts every forward.

This fetching mode serves `parallel.expert_placement` plans. `parallel.replace_every` (slots.py) makes
the experts own their slots instead: a placement then moves weights and optimizer state between ranks
at a step boundary, nothing is fetched per forward, and redundant slots hold copies refreshed once per
step (`parallel.redundant_slots`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import Config
from ..expert_load import PLACEMENT_FILE
from ..moe.placement import PlacementError, check_plan, pick_replicas, relabel_gpus, replica_candidates


def plan_path(cfg: Config) -> Optional[Path]:
    """The plan file this run uses, or None: `none`, a path, or `auto` (the run directory's
    expert_placement.json if it exists now, at start or resume)."""
    choice = cfg.parallel.expert_placement
    if choice == "none":
        return None
    if choice == "auto":
        path = Path(cfg.run.out_dir) / PLACEMENT_FILE
        return path if path.is_file() else None
    return Path(choice)


def read_plan(path: Path, num_layers: int, num_experts: int, ep: int) -> dict:
    """The plan JSON, checked against the model (MoE layers, experts) and the EP size;
    raises PlacementError with one sentence naming the file."""
    where = f"parallel.expert_placement: {path}"
    try:
        plan = json.loads(path.read_text())
    except OSError as e:
        raise PlacementError(f"{where} cannot be read ({e.strerror or e}); give a plan written by "
                             f"tools/expert_load.py plan, or none.") from None
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise PlacementError(f"{where} is not valid JSON ({str(e).splitlines()[0]}); write it with "
                             f"tools/expert_load.py plan.") from None
    if not isinstance(plan, dict) or "phy2log" not in plan:
        raise PlacementError(f"{where} has no phy2log table; write it with tools/expert_load.py plan.")
    gpus = plan.get("layout", {}).get("num_gpus") if isinstance(plan.get("layout"), dict) else None
    if ep > 1 and gpus is not None and gpus != ep:
        raise PlacementError(f"{where} places experts on {gpus} GPUs but parallel.ep is {ep}; make the plan "
                             f"with --gpus {ep} or set parallel.expert_placement=none.")
    try:
        check_plan(plan["phy2log"], num_layers, num_experts, ep)
    except PlacementError as e:
        raise PlacementError(f"{where}: {str(e)[0].lower()}{str(e)[1:]}") from None
    return plan


@dataclass
class LayerPlacement:
    """One MoE layer's physical slots as seen from one EP rank (every field host-side, fixed)."""

    phy2log: torch.Tensor  # (R,) logical expert of each slot, relabeled: slot p lives on EP rank p // S
    slots_per_rank: int  # S
    rank: int  # this EP rank
    cand: torch.Tensor  # (E, W) slots a copy routed to expert e may take from this rank (-1 padded)
    cand_count: torch.Tensor  # (E,)
    send_index: torch.Tensor  # local expert rows this rank sends, grouped by destination rank
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    slot_index: torch.Tensor  # (S,) row of [local experts; received experts] each of my slots computes with
    gpu_to_rank: list[int]  # plan GPU g is hosted by EP rank gpu_to_rank[g]
    # slot-owned experts (parallel/slots.py): slot s of this rank is row s of its expert parameters, so
    # no weights are fetched (send/recv splits are zeros, slot_index the identity), except with redundant
    # slots: then `cached` is set and send/recv/slot_index describe the copies refreshed once per step
    owned: bool = False
    cached: bool = False
    # with `cached`: (received copies,) the redundant slot (0..r-1, after the S0 owned ones) each received copy
    # fills; the dispatcher keeps the copies in slot order (expert.py refresh_cache)
    copy_slot: Optional[torch.Tensor] = None

    @property
    def n_slots(self) -> int:
        return self.phy2log.numel()

    def slots(self, expert: torch.Tensor) -> torch.Tensor:
        """(M,) logical expert of each routed copy (in token order) -> its physical slot."""
        p = self.on(expert.device)
        return pick_replicas(expert, p.cand, p.cand_count, offset=self.rank)

    def on(self, device: torch.device) -> "LayerPlacement":
        """This placement with its index tensors on `device`, copied there once (not every step)."""
        if self.phy2log.device == device:
            return self
        cache = self.__dict__.setdefault("_on_device", {})
        if device not in cache:
            cache[device] = dataclasses.replace(
                self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                         if isinstance(getattr(self, f.name), torch.Tensor)})
        return cache[device]


def _fetch_plan(row: list[int], n_local: int, ep: int, rank: int, per_rank: int):
    """What each rank fetches: the foreign experts of its slots, each once, in ascending id (so grouped
    by home rank). Returns (send_index, send_splits, recv_splits, slot_index) for `rank`."""
    def foreign(r):
        return sorted({e for e in row[r * per_rank:(r + 1) * per_rank] if e // n_local != r})
    mine = foreign(rank)
    send = [[e - rank * n_local for e in foreign(r) if e // n_local == rank] for r in range(ep)]
    recv_splits = [sum(1 for e in mine if e // n_local == r) for r in range(ep)]
    slot_index = [e - rank * n_local if e // n_local == rank else n_local + mine.index(e)
                  for e in row[rank * per_rank:(rank + 1) * per_rank]]
    return (torch.tensor([i for s in send for i in s], dtype=torch.int64), [len(s) for s in send],
            recv_splits, torch.tensor(slot_index, dtype=torch.int64))


def layer_placement(row: list[int], n_experts: int, ep: int, rank: int, num_nodes: int = 1) -> LayerPlacement:
    """Relabel one layer's plan GPUs to EP ranks and derive `rank`'s routing and fetch tables."""
    per_rank = len(row) // ep
    perm = relabel_gpus(row, n_experts, ep, num_nodes)
    by_rank = [0] * ep
    for g, r in enumerate(perm):
        by_rank[r] = g
    relabeled = [e for r in range(ep) for e in row[by_rank[r] * per_rank:(by_rank[r] + 1) * per_rank]]
    phy2log = torch.tensor(relabeled, dtype=torch.int64)
    cand, count = replica_candidates(relabeled, rank, per_rank, n_experts)
    send_index, send_splits, recv_splits, slot_index = _fetch_plan(relabeled, n_experts // ep, ep, rank, per_rank)
    return LayerPlacement(phy2log, per_rank, rank, cand, count, send_index, send_splits, recv_splits, slot_index,
                          perm)


def fetched_experts(p: LayerPlacement, n_experts: int, ep: int) -> int:
    """Expert weight rows all EP ranks together fetch per forward of this layer (each row one expert)."""
    n_local, s = n_experts // ep, p.slots_per_rank
    row = p.phy2log.tolist()
    return sum(len({e for e in row[r * s:(r + 1) * s] if e // n_local != r}) for r in range(ep))


def load_placement(cfg: Config, ep: int, ep_rank: int, log: bool) -> Optional[list[LayerPlacement]]:
    """Per MoE layer (global order: main layers, then MTP), this rank's LayerPlacement; None when the run
    uses no plan, or when ep == 1 (every expert is on every rank: a plan changes nothing). Validates the
    plan (PlacementError, one sentence) and, if `log`, prints the GPU relabeling and the weight traffic."""
    path = plan_path(cfg)
    if path is None:
        return None
    m = cfg.model
    n_layers = (max(0, m.num_hidden_layers - m.first_k_dense_replace) + m.num_nextn_predict_layers
                if m.arch == "deepseek_v3" else 0)
    plan = read_plan(path, n_layers, m.n_routed_experts, ep)
    if ep == 1:
        if log:
            print(f"expert placement: {path} ignored: parallel.ep is 1, so every rank holds every expert and "
                  f"a placement changes nothing", flush=True)
        return None
    layout = plan.get("layout") if isinstance(plan.get("layout"), dict) else {}
    nodes = layout.get("num_nodes", 1) if isinstance(layout.get("num_nodes", 1), int) else 1
    placements = [layer_placement(row, m.n_routed_experts, ep, ep_rank, nodes) for row in plan["phy2log"]]
    if log:
        _log(path, placements, cfg, ep)
    return placements


def _log(path: Path, placements: list[LayerPlacement], cfg: Config, ep: int) -> None:
    m = cfg.model
    elem = 2 if cfg.train.dtype == "bf16" else 4
    expert_bytes = 3 * m.hidden_size * m.moe_intermediate_size * elem
    ids = [i for i in range(m.num_hidden_layers) if i >= m.first_k_dense_replace]
    ids += [m.num_hidden_layers + k for k in range(m.num_nextn_predict_layers)]
    total = 0
    print(f"expert placement: {path}: {placements[0].n_slots} slots per MoE layer on {ep} EP ranks", flush=True)
    n_local = m.n_routed_experts // ep
    for layer_id, p in zip(ids, placements):
        n = fetched_experts(p, m.n_routed_experts, ep)
        home = sum(1 for slot, e in enumerate(p.phy2log.tolist()) if e // n_local == slot // p.slots_per_rank)
        total += n
        print(f"  layer {layer_id}: plan GPU -> EP rank {p.gpu_to_rank}; {home} of {p.n_slots} slots hold an "
              f"expert of their own rank, {n} expert weight rows fetched per forward", flush=True)
    mb = total * expert_bytes / 2 ** 20
    print(f"expert placement: {total} expert weight rows ({mb:.2f} MiB) cross ranks per forward of a micro-batch "
          f"over all EP ranks of a group, and as many gradient rows in backward (comm.expert_weights*)", flush=True)
