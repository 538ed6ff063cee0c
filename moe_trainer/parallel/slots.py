"""Slot-owned experts that move while the run runs (`parallel.replace_every`).

Each EP rank's expert parameters are S = E / ep slots of one shape (gate_up_proj (S, 2H, d),
down_proj (S, d, H)); a placement (one row per MoE layer, `row[q]` = the expert id in global slot
q, slot q on EP rank q // S) says which expert each slot holds. At home, row[q] = q (expert e on EP
rank e // S, as plain expert parallelism keeps it). Routing stays by expert id (gates, balancing
biases, load counts, checkpoints); the dispatcher maps ids to slots (an `owned` LayerPlacement, so
no weights are fetched per forward: expert.py).

Applying a new placement, at a step boundary, exchanges slot contents between the EP ranks of each
EP group with one all_to_all_single of stacked rows per changed MoE layer (uneven splits, the same
call on every rank of the group, rows in slot order on both sides): per slot that changes rank, its model weights (bf16
or fp32), its fp32 master weights and its Adam exp_avg / exp_avg_sq. The optimizer state lives in
ZeRO-1's flat fp32 partitions, sharded over the expert-data-parallel group: a parameter's fragment
is reassembled whole with DeepSpeed's safe_get_full_* (one all-reduce over edp per tensor; a no-op
group when edp is 1) and written back with safe_set_full_*, so the flat buffers keep their layout
and only their contents move. Gradient-accumulation buffers hold nothing at a step boundary
(BF16_Optimizer.step ends in clear_hp_grads, ZeRO-1's step in zero_grad), so none moves. Slots
whose expert stays on its rank keep their place; the rank's free slots take the arriving experts.

Checkpoints stay keyed by expert id: a save moves every expert home first and back after
(`at_home`), a load resets the tables to home (the loaded rows are in id order).

`Replacer`, once per `replace_every` steps: rank 0 plans from the load counted since the last
placement (moe.placement.rebalance_experts with no redundant slot, every MoE layer), relabels the
plan's ranks to keep as many experts in place as possible, predicts the saving (rows of the busiest
EP rank per step x the steps until the next decision x the time of one expert row at the rank's
peak rate) and the cost (bytes the busiest sender moves at the planner's NVLink rate, or the wall time the last move took if
longer), decides,
and broadcasts the decision and the rows to every rank (one tensor from rank 0: the same decision
everywhere, no hang). metrics.jsonl gets an `event: replace` row.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..moe.placement import rebalance_experts
from .comm import all_to_all_rows
from .replicas import LayerPlacement

POLICIES = ("auto", "always", "rotate")
STATES = ("weight", "fp32", "exp_avg", "exp_avg_sq")  # what moves with a slot


def home_row(n_experts: int) -> list[int]:
    return list(range(n_experts))


def owned_placement(row: list[int], ep: int, rank: int) -> LayerPlacement:
    """The dispatcher's tables for slot-owned experts: expert row[q] in slot q, no weight fetched."""
    n = len(row)
    slot_of = [0] * n
    for q, e in enumerate(row):
        slot_of[e] = q
    # one candidate per expert, its slot (what replica_candidates gives a permutation, built on the host)
    cand, count = torch.tensor(slot_of, dtype=torch.int64)[:, None], torch.ones(n, dtype=torch.int64)
    return LayerPlacement(torch.tensor(row, dtype=torch.int64), n // ep, rank, cand, count,
                          torch.zeros(0, dtype=torch.int64), [0] * ep, [0] * ep, torch.arange(n // ep),
                          list(range(ep)), owned=True)


def moves(old: list[int], new: list[int], ep: int, rank: int):
    """What `rank` does to go from placement `old` to `new` (one layer): (send, recv, keep), send[d] the
    local slots whose contents go to rank d, recv[s] the local slots that take rows from rank s, keep
    (from local slot, to local slot) on the rank. Both sides list a pair of ranks' rows in ascending
    destination slot, so a sender's rows arrive in the order its receiver expects."""
    s = len(old) // ep
    where = {e: q for q, e in enumerate(old)}
    send, recv, keep = [[] for _ in range(ep)], [[] for _ in range(ep)], []
    for q, e in enumerate(new):
        p = where[e]
        if q // s == rank and p // s == rank:
            keep.append((p % s, q % s))
        elif q // s == rank:
            recv[p // s].append(q % s)
        elif p // s == rank:
            send[q // s].append(p % s)
    return send, recv, keep


def moved_experts(old: list[int], new: list[int], ep: int) -> list[int]:
    """Experts each EP rank sends to another rank (one layer)."""
    s = len(old) // ep
    where = {e: q for q, e in enumerate(old)}
    out = [0] * ep
    for q, e in enumerate(new):
        if where[e] // s != q // s:
            out[where[e] // s] += 1
    return out


def keep_in_place(plan: list[int], old: list[int], ep: int) -> list[int]:
    """Plan `plan` (rank g holds plan[g*S:(g+1)*S]) with its ranks relabeled and its slots ordered so
    that the fewest experts move: plan rank g goes to the current rank holding most of its experts
    (greedy over the largest overlaps), an expert already on its rank keeps its slot."""
    s = len(old) // ep
    rank_of = {e: q // s for q, e in enumerate(old)}
    groups = [plan[g * s:(g + 1) * s] for g in range(ep)]
    overlap = sorted(((sum(rank_of[e] == r for e in grp), -g, -r) for g, grp in enumerate(groups)
                      for r in range(ep)), reverse=True)
    to_rank, taken = {}, set()
    for _, g, r in overlap:
        if -g not in to_rank and -r not in taken:
            to_rank[-g] = -r
            taken.add(-r)
    row = [-1] * len(old)
    for g, grp in enumerate(groups):
        r = to_rank[g]
        staying = {e for e in grp if rank_of[e] == r}
        arriving = iter(sorted(e for e in grp if e not in staying))
        for i in range(s):
            e = old[r * s + i]
            row[r * s + i] = e if e in staying else next(arriving)
    return row


def rank_loads(load: torch.Tensor, row: list[int], ep: int) -> torch.Tensor:
    """(ep,) load of each EP rank for one layer's expert load (E,) under placement `row`."""
    return load[torch.tensor(row)].view(ep, -1).sum(1)


def _imbalance(loads: list[torch.Tensor]) -> float:
    """Mean over layers of the busiest rank's load over the mean (1 for a layer without load)."""
    vals = [float(x.max() / x.mean()) if float(x.sum()) > 0 else 1.0 for x in loads]
    return sum(vals) / max(1, len(vals))


class SlotExperts:
    """This stage's MoE layers as slots (`layers`: (global row, MoE module), rows in global order) and
    the placement of every MoE layer of the model (`rows`)."""

    def __init__(self, layers: list, n_layers: int, n_experts: int, mesh):
        self.layers, self.mesh = layers, mesh
        self.ep, self.rank = mesh.layout.ep, mesh.index("ep")
        self.n_experts = n_experts
        self.rows = [home_row(n_experts) for _ in range(n_layers)]

    def set_tables(self, rows: list[list[int]]) -> None:
        """The dispatchers route by `rows` (no contents move): home is the plain dispatcher path."""
        self.rows = [list(r) for r in rows]
        for i, layer in self.layers:
            home = self.rows[i] == home_row(self.n_experts)
            layer.dispatcher.placement = None if home else owned_placement(self.rows[i], self.ep, self.rank)

    def reset_home(self) -> None:
        self.set_tables([home_row(self.n_experts) for _ in self.rows])

    @torch.no_grad()
    def apply(self, rows: list[list[int]], engine) -> int:
        """Move every slot's contents to placement `rows`, one MoE layer at a time (its whole state is held
        in fp32 for the move, one layer's at a time): per changed layer one all-to-all over the EP group
        and, for the optimizer state, all-reduces over the edp group. Returns the bytes this rank sent."""
        from ..checkpoint import link_optimizer_state
        link_optimizer_state(engine)  # the moments exist (zeros before the first step)
        sent = 0
        for i, layer in self.layers:
            if rows[i] != self.rows[i]:  # the same layers on every rank of the EP and edp groups
                sent += self._move_layer(layer, moves(self.rows[i], rows[i], self.ep, self.rank))
        self.set_tables(rows)
        return sent

    def _move_layer(self, layer, plan) -> int:
        from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                                     safe_set_full_optimizer_state)
        send, recv, keep = plan
        params = [layer.experts.gate_up_proj, layer.experts.down_proj]
        full = [[p.detach().float(), safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
                 safe_get_full_optimizer_state(p, "exp_avg_sq")] for p in params]  # per param: STATES, whole
        s = params[0].shape[0]
        block = torch.cat([t.reshape(s, -1) for states in full for t in states], 1)  # (S, row width) fp32
        index = lambda slots: torch.tensor(slots, dtype=torch.int64, device=block.device)  # noqa: E731
        # rows to each rank in ascending destination slot; from each rank in the same order (moves)
        rows = torch.cat([block[index(send[d])] for d in range(self.ep)])
        in_splits, out_splits = [len(x) for x in send], [len(x) for x in recv]
        received = all_to_all_rows(rows, out_splits, in_splits, self.mesh.group("ep"))
        new = block.clone()
        if keep:
            new[index([b for _, b in keep])] = block[index([a for a, _ in keep])]
        mine = [q for src in range(self.ep) for q in recv[src]]
        if mine:
            new[index(mine)] = received
        self._write(new, params, full, safe_set_full_fp32_param, safe_set_full_optimizer_state)
        return rows.numel() * rows.element_size()

    @staticmethod
    def _write(new: torch.Tensor, params, full, set_fp32, set_state) -> None:
        col = 0
        for p, states in zip(params, full):
            out = []
            for t in states:
                width = t[0].numel()
                out.append(new[:, col:col + width].reshape(t.shape))
                col += width
            p.data.copy_(out[0].to(p.dtype))
            set_fp32(p, out[1])
            set_state(p, out[2], "exp_avg")
            set_state(p, out[3], "exp_avg_sq")

    @contextlib.contextmanager
    def at_home(self, engine):
        """Every expert in its home slot for the body (a checkpoint keyed by expert id), then back."""
        rows = [list(r) for r in self.rows]
        if rows == [home_row(self.n_experts) for _ in rows]:
            yield
            return
        self.apply([home_row(self.n_experts) for _ in rows], engine)
        try:
            yield
        finally:
            self.apply(rows, engine)


class Replacer:
    """Online re-placement every `parallel.replace_every` steps (see the module docstring)."""

    def __init__(self, cfg, slots: SlotExperts, engine, device: torch.device, peak_tflops: float):
        from ..plan.nodes import Links
        self.slots, self.engine, self.device = slots, engine, device
        p, m = cfg.parallel, cfg.model
        self.every, self.policy, self.max_steps = p.replace_every, p.replace_policy, cfg.train.max_steps
        self.last_wall = 0.0  # wall time of the last move applied (rank 0): the cost's floor
        self.n_layers, self.n_experts, self.ep = len(slots.rows), m.n_routed_experts, slots.ep
        self.edp = max(1, slots.mesh.size("edp"))
        expert_numel = 3 * m.hidden_size * m.moe_intermediate_size
        elem = 2 if cfg.train.dtype == "bf16" else 4
        self.expert_bytes = expert_numel * (elem + 3 * 4)  # weights, fp32 master, two moments
        # one routed row through one expert, forward and backward: 3 GEMMs x 2 flops x 3 passes
        self.row_seconds = 18 * expert_numel / (peak_tflops * 1e12)
        self.link_bytes_s = Links().nvlink_gbps * 1e9 / 8
        self._reset()

    def _reset(self) -> None:
        self.load = torch.zeros(self.n_layers, self.n_experts, dtype=torch.float64)
        self.rank_rows = torch.zeros(self.n_layers, self.ep, dtype=torch.float64)
        self.steps = 0

    def after_step(self, step: int, expert: Optional[dict]) -> Optional[dict]:
        """Count the step's load; at a decision step decide, move (collective on every rank) and
        return the `event: replace` row (None between decisions)."""
        if expert is None:
            return None
        self.load += expert["counts"].double()
        self.rank_rows += expert["rank_rows"].double()
        self.steps += 1
        if step % self.every or step >= self.max_steps:  # (after the last step nothing would gain)
            return None
        t0 = time.perf_counter()
        is_root = not dist.is_initialized() or dist.get_rank() == 0
        new, row = (self._decide() if is_root else (None, {}))
        apply = self._broadcast(new)
        moved = self.slots.apply(apply, self.engine) if apply is not None else 0
        if self.device.type == "cuda":  # the wall time of the moves, not of their launch
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        if apply is not None:
            self.last_wall = wall
        row.update(moved_bytes_rank=moved, wall_s=round(wall, 6))
        self._reset()
        return row

    def _host_load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The interval's (layers, E) expert load and (layers, ep) measured rows per EP rank, on the host
        (update_bias copied them there: no read here; the dry run draws them instead)."""
        return self.load, self.rank_rows

    def _decide(self) -> tuple[Optional[list[list[int]]], dict]:
        cur = self.slots.rows
        load, rank_rows = self._host_load()
        if self.policy == "rotate":  # the drill: every expert moves to the next rank and slot
            s = self.n_experts // self.ep
            new = [[r[(q - s - 1) % len(r)] for q in range(len(r))] for r in cur]
        else:
            plan = rebalance_experts(load, self.n_experts, 1, 1, self.ep)[0].tolist()
            new = [keep_in_place(p, c, self.ep) for p, c in zip(plan, cur)]
        before = [rank_loads(load[i], cur[i], self.ep) for i in range(self.n_layers)]
        after = [rank_loads(load[i], new[i], self.ep) for i in range(self.n_layers)]
        steps = max(1, self.steps)
        # rows of the busiest EP rank per step and device (the edp replicas split a rank's rows)
        saved_rows = sum(float(b.max() - a.max()) for b, a in zip(before, after)) / steps / self.edp
        saving_s = saved_rows * self.row_seconds * self.every
        per_rank = [sum(col) for col in zip(*(moved_experts(c, n, self.ep) for c, n in zip(cur, new)))]
        moved_bytes = sum(per_rank) * self.expert_bytes
        # at the planner's link rate, or what the last move measured if more (on CPU ranks the copies and
        # the optimizer state's edp all-reduces, not the link, set the pace)
        cost_s = max(max(per_rank) * self.expert_bytes / self.link_bytes_s, self.last_wall)
        if new == cur:
            decision, reason = "keep", "the search finds the current placement"
        elif self.policy in ("always", "rotate"):
            decision, reason = "apply", f"parallel.replace_policy={self.policy}"
        elif saving_s > cost_s:
            decision, reason = "apply", (f"predicted saving {saving_s:.3g} s over {self.every} steps exceeds "
                                         f"the move's {cost_s:.3g} s")
        else:
            decision, reason = "keep", (f"predicted saving {saving_s:.3g} s over {self.every} steps does not "
                                        f"exceed the move's {cost_s:.3g} s")
        measured = [rank_rows[i] for i in range(self.n_layers)]
        row = {"event": "replace", "decision": decision, "reason": reason, "steps_counted": self.steps,
               "moved_experts": sum(per_rank) if decision == "apply" else 0,
               "moved_bytes": moved_bytes if decision == "apply" else 0,
               "predicted_saving_s": saving_s, "move_cost_s": cost_s,
               "measured_rank_max_over_mean": round(_imbalance(measured), 6),
               "predicted_rank_max_over_mean_before": round(_imbalance(before), 6),
               "predicted_rank_max_over_mean_after": round(_imbalance(after), 6)}
        return (new if decision == "apply" else None), row

    def _broadcast(self, new: Optional[list[list[int]]]) -> Optional[list[list[int]]]:
        """Rank 0's decision on every rank: [flag, rows...] in one broadcast over the world."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return new
        buf = torch.zeros(1 + self.n_layers * self.n_experts, dtype=torch.int64, device=self.device)
        if new is not None:
            buf[0] = 1
            buf[1:] = torch.tensor(new, dtype=torch.int64, device=self.device).flatten()
        dist.broadcast(buf, src=0)
        return self._rows_from(buf)

    def _rows_from(self, buf: torch.Tensor) -> Optional[list[list[int]]]:
        """The broadcast decision on the host: rows to apply, or None."""
        flat = buf.cpu().tolist()  # host sync, once per decision
        if not flat[0]:
            return None
        return [flat[1 + i * self.n_experts:1 + (i + 1) * self.n_experts] for i in range(self.n_layers)]
