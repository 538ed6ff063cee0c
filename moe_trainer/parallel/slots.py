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

Redundant slots (`parallel.redundant_slots` r a rank): copies of other ranks' experts that tokens are
routed to like their owners (a sender's own copy first, else round-robin over the expert's slots). A
copy is not a parameter: its weights are a cache that every rank refreshes after each optimizer step
and each move (one all-to-all of weight rows per layer with copies, `refresh`). Its gradients are
summed on its holder over the step's micro-batches (in the run's gradient accumulation dtype) and go
to the owner once per step, after the last backward and before ZeRO's reduction (`hand_back`: one
all-to-all of gradient rows per layer with copies, the refresh's reversed), where one more
engine.backward adds them to the owned rows as DeepSpeed's hooks and accumulation see every gradient.
So an expert has one set of weights, fp32 master and moments however many copies it has: they cannot
drift apart, ZeRO's flat buffers and the gradient norm are those of the run without copies, and a
copy costs its weights and its gradient sum (no 12 bytes a parameter of optimizer state). No backward
runs a collective of its own, so the copies run under the overlapped executor too
(`parallel.overlap`). A saved checkpoint first checks every copy bit for bit against its owner. The
search fills the copies greedily (moe/placement/online.py's copy_slots) after placing the owned slots.

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

from ..moe.placement import replica_candidates
from ..moe.placement.online import (copy_rows, home_row, mean_imbalance, moved_experts, rank_loads, replan,
                                    slot_row)
from .comm import all_to_all_rows
from .replicas import LayerPlacement
from .surrogate import hand_over

POLICIES = ("auto", "always", "rotate")
STATES = ("weight", "fp32", "exp_avg", "exp_avg_sq")  # what moves with a slot


def check_replicas(row: list[int], replicas: list[int], ep: int) -> None:
    """A rank's redundant slots hold distinct experts owned by other ranks (ValueError otherwise)."""
    s0, r = len(row) // ep, len(replicas) // ep
    for q in range(ep):
        copies = [e for e in replicas[q * r:(q + 1) * r] if e >= 0]
        own = set(row[q * s0:(q + 1) * s0])
        if len(set(copies)) != len(copies) or own.intersection(copies) or \
                any(not 0 <= e < len(row) for e in copies):
            raise ValueError(f"EP rank {q}'s redundant slots {replicas[q * r:(q + 1) * r]} must hold distinct "
                             f"expert ids of other ranks (it owns {sorted(own)})")


def _cache_tables(row: list[int], replicas: list[int], ep: int, rank: int):
    """What `rank` sends and receives to refresh every rank's copies: (send_index, send_splits, recv_splits,
    slot_index), the forms a fetching LayerPlacement uses (replicas.py), with an expert's owner in place of
    its home, and copy_slot: the redundant slot (0..r-1) each received copy fills. Rows of one pair of ranks
    are in ascending expert id on both sides."""
    s0, r = len(row) // ep, len(replicas) // ep
    owner = {e: q for q, e in enumerate(row)}  # expert -> its owned global slot

    def copies(d):  # experts rank d copies, in ascending id
        return sorted(e for e in replicas[d * r:(d + 1) * r] if e >= 0)
    send = [[owner[e] % s0 for e in copies(d) if owner[e] // s0 == rank] for d in range(ep)]
    mine = sorted(copies(rank), key=lambda e: (owner[e] // s0, e))  # received source-major
    recv_splits = [sum(1 for e in mine if owner[e] // s0 == src) for src in range(ep)]
    # slot -> row of [owned rows; received copies]; an empty slot takes row 0 (it is routed no token)
    slot_index = list(range(s0)) + [s0 + mine.index(e) if e >= 0 else 0 for e in replicas[rank * r:(rank + 1) * r]]
    copy_slot = [replicas[rank * r:(rank + 1) * r].index(e) for e in mine]
    return (torch.tensor([i for x in send for i in x], dtype=torch.int64), [len(x) for x in send], recv_splits,
            torch.tensor(slot_index, dtype=torch.int64), torch.tensor(copy_slot, dtype=torch.int64))


def owned_placement(row: list[int], ep: int, rank: int, replicas: Optional[list[int]] = None) -> LayerPlacement:
    """The dispatcher's tables for slot-owned experts: expert row[q] in owned slot q, no weight fetched per
    forward; with redundant slots (`replicas`) a copy routed to an expert takes one of its slots (its
    owner's, or a copy on the sender's rank if it has one, else round-robin), and the copies' weights
    are the cache each rank refreshes once per step (expert.py)."""
    n = len(row)
    slots = slot_row(row, replicas, ep)
    per_rank = len(slots) // ep
    cand, count = replica_candidates(slots, rank, per_rank, n)
    if per_rank == n // ep:  # no copy: nothing is fetched, slot s is parameter row s
        return LayerPlacement(torch.tensor(slots, dtype=torch.int64), per_rank, rank, cand, count,
                              torch.zeros(0, dtype=torch.int64), [0] * ep, [0] * ep, torch.arange(per_rank),
                              list(range(ep)), owned=True)
    check_replicas(row, replicas, ep)
    send_index, send_splits, recv_splits, slot_index, copy_slot = _cache_tables(row, replicas, ep, rank)
    return LayerPlacement(torch.tensor(slots, dtype=torch.int64), per_rank, rank, cand, count, send_index,
                          send_splits, recv_splits, slot_index, list(range(ep)), owned=True, cached=True,
                          copy_slot=copy_slot)


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


class SlotExperts:
    """This stage's MoE layers as slots (`layers`: (global row, MoE module), rows in global order), the
    placement of every MoE layer of the model (`rows`, owned slots) and its copies in the r redundant
    slots of each EP rank (`copies`, ep * r ids a layer, -1 = empty)."""

    def __init__(self, layers: list, n_layers: int, n_experts: int, mesh, redundant: int = 0,
                 device: torch.device = torch.device("cpu"), grad_dtype: torch.dtype = torch.float32):
        self.layers, self.mesh = layers, mesh
        self.ep, self.rank = mesh.layout.ep, mesh.index("ep")
        self.n_experts, self.redundant = n_experts, redundant
        self.device = device  # where the world's collectives take their tensors (NCCL: the rank's GPU)
        self.grad_dtype = grad_dtype  # the copies' gradient sums: the run's gradient accumulation dtype
        self.rows = [home_row(n_experts) for _ in range(n_layers)]
        self.copies = [self.no_copies() for _ in range(n_layers)]

    def no_copies(self) -> list[int]:
        return [-1] * (self.ep * self.redundant)

    def set_tables(self, rows: list[list[int]], copies: Optional[list[list[int]]] = None) -> None:
        """The dispatchers route by `rows` and `copies` (no contents move; the copies' caches are filled
        by refresh): home without copies is the plain dispatcher path."""
        self.rows = [list(r) for r in rows]
        self.copies = [list(c) for c in copies] if copies is not None else [self.no_copies() for _ in rows]
        for i, layer in self.layers:
            plain = self.rows[i] == home_row(self.n_experts) and all(e < 0 for e in self.copies[i])
            layer.dispatcher.placement = None if plain else owned_placement(self.rows[i], self.ep, self.rank,
                                                                           self.copies[i])
            layer.dispatcher.drop_copies()

    def reset_home(self) -> None:
        self.set_tables([home_row(self.n_experts) for _ in self.rows])

    @torch.no_grad()
    def refresh(self) -> int:
        """Every copy in a redundant slot made its owner's weights again (after an optimizer step or a move):
        one all-to-all of weight rows over the EP group per MoE layer with copies (the same layers on every
        rank of the group). Returns the bytes this rank sent."""
        return sum(d.refresh_cache(self.grad_dtype) for d in self._holding())

    def _holding(self) -> list:
        """The dispatchers of this stage's MoE layers that hold copies (the same layers on every rank of the
        EP group), in layer order."""
        return [layer.dispatcher for _, layer in self.layers
                if layer.dispatcher.placement is not None and layer.dispatcher.placement.cached]

    def hand_back(self, engine) -> None:
        """The copies' gradients of the step to their owners, after the step's last backward and before the
        gradient reduction (the executors' `before_reduce`): per MoE layer with copies one all-to-all of the
        summed gradient rows, then one engine.backward (not the accumulation boundary) that adds them to the
        owned weights, so DeepSpeed's hooks and fp32 accumulation take them as they take every gradient.
        One layer at a time: the gradients to add are as large as the rank's expert weights of a layer."""
        for d in self._holding():
            hand_over(engine, d.copy_grads_to_owners())

    @torch.no_grad()
    def replica_mismatch(self) -> int:
        """Redundant slots whose weights differ (bit for bit) from their owner's now, over this rank's layers:
        a fresh copy of every owned row is fetched and compared with the cache (collective, as refresh)."""
        bad = 0
        for d in self._holding():
            cache = d.cache
            d.refresh_cache(self.grad_dtype)  # (r, 2H, d), (r, d, H) in slot order: a slot differs if either does
            bad += int(((cache[0] != d.cache[0]).flatten(1).any(1) | (cache[1] != d.cache[1]).flatten(1).any(1)).sum())
        return bad

    @torch.no_grad()
    def apply(self, rows: list[list[int]], copies: Optional[list[list[int]]] = None, *, engine) -> int:
        """Move every slot's contents to placement `rows`, one MoE layer at a time (its whole state is held
        in fp32 for the move, one layer's at a time): per changed layer one all-to-all over the EP group
        and, for the optimizer state, all-reduces over the edp group; then the copies of `copies` are
        filled (refresh). Returns the bytes this rank sent.

        Every copy is refreshed, also where only copies changed or nothing did: a decision follows an
        optimizer step, so every cache is stale then (the refresh stands in for the step's own), and the
        new tables drop the old caches."""
        from ..checkpoint import link_optimizer_state
        link_optimizer_state(engine)  # the moments exist (zeros before the first step)
        sent = 0
        for i, layer in self.layers:
            if rows[i] != self.rows[i]:  # the same layers on every rank of the EP and edp groups
                sent += self._move_layer(layer, moves(self.rows[i], rows[i], self.ep, self.rank))
        self.set_tables(rows, copies)
        return sent + self.refresh()

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
        """Every expert in its home slot for the body (a checkpoint keyed by expert id), then back. First the
        redundant slots' copies are checked bit for bit against their owners (RuntimeError on every rank
        if one differs)."""
        rows, copies = [list(r) for r in self.rows], [list(c) for c in self.copies]
        held = sum(e >= 0 for c in copies for e in c)
        if held:  # the copies the forward used are their owners' weights (refreshed since the last step)
            bad = torch.tensor([self.replica_mismatch()], dtype=torch.int64, device=self.device)
            if dist.is_initialized():  # every rank raises, or none does
                dist.all_reduce(bad)
            if int(bad.item()):  # host read, once per checkpoint
                raise RuntimeError(f"{int(bad.item())} redundant expert slots differ from their owners' weights: "
                                   f"a copy was not refreshed after an optimizer step")
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"redundant slots: {held} expert copies bit-identical to their owners", flush=True)
        if rows == [home_row(self.n_experts) for _ in rows]:
            yield
            return
        self.apply([home_row(self.n_experts) for _ in rows], engine=engine)
        try:
            yield
        finally:
            self.apply(rows, copies, engine=engine)


class Replacer:
    """Online re-placement every `parallel.replace_every` steps (see the module docstring)."""

    def __init__(self, cfg, slots: SlotExperts, engine, device: torch.device, peak_tflops: float):
        from ..plan.nodes import Links
        self.slots, self.engine, self.device = slots, engine, device
        p, m = cfg.parallel, cfg.model
        self.every, self.policy, self.max_steps = p.replace_every, p.replace_policy, cfg.train.max_steps
        self.redundant, self.rotations = p.redundant_slots, 0
        self.last_wall = 0.0  # wall time of the last move applied (rank 0): the cost's floor
        self.n_layers, self.n_experts, self.ep = len(slots.rows), m.n_routed_experts, slots.ep
        self.edp = max(1, slots.mesh.size("edp"))
        expert_numel = 3 * m.hidden_size * m.moe_intermediate_size
        elem = 2 if cfg.train.dtype == "bf16" else 4
        self.expert_bytes = expert_numel * (elem + 3 * 4)  # weights, fp32 master, two moments
        self.copy_bytes = expert_numel * elem  # a copy's refresh or its summed gradient (each once a step)
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
            self.slots.refresh()  # the optimizer stepped: the copies take the new weights
            return None
        self.load += expert["counts"].double()
        self.rank_rows += expert["rank_rows"].double()
        self.steps += 1
        if step % self.every or step >= self.max_steps:  # (after the last step nothing would gain)
            self.slots.refresh()
            return None
        t0 = time.perf_counter()
        is_root = not dist.is_initialized() or dist.get_rank() == 0
        new, row = (self._decide() if is_root else (None, {}))
        apply = self._broadcast(new)
        if apply is not None:
            moved = self.slots.apply(*apply, engine=self.engine)  # the copies refreshed too
        else:
            moved = self.slots.refresh()
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

    def _decide(self) -> tuple[Optional[tuple[list[list[int]], list[list[int]]]], dict]:
        cur, cur_copies = self.slots.rows, self.slots.copies
        load, rank_rows = self._host_load()
        s = self.n_experts // self.ep
        if self.policy == "rotate":  # the drill: every expert moves to the next rank and slot, new copies
            new = [[r[(q - s - 1) % len(r)] for q in range(len(r))] for r in cur]
            self.rotations += 1
            copies = [[r[((q // self.redundant + 1) % self.ep) * s + (self.rotations + q) % s]
                       for q in range(self.ep * self.redundant)] for r in new]
        else:
            new, copies = replan(load, cur, self.ep, self.redundant)
        before = [rank_loads(load[i], cur[i], self.ep, cur_copies[i]) for i in range(self.n_layers)]
        after = [rank_loads(load[i], new[i], self.ep, copies[i]) for i in range(self.n_layers)]
        steps = max(1, self.steps)
        # rows of the busiest EP rank per step and device (the edp replicas split a rank's rows)
        saved_rows = sum(float(b.max() - a.max()) for b, a in zip(before, after)) / steps / self.edp
        saving_s = saved_rows * self.row_seconds * self.every
        per_rank = [sum(col) for col in zip(*(moved_experts(c, n, self.ep) for c, n in zip(cur, new)))]
        moved_bytes = sum(per_rank) * self.expert_bytes
        # at the planner's link rate, or what the last move measured if more (on CPU ranks the copies and
        # the optimizer state's edp all-reduces, not the link, set the pace)
        cost_s = max(max(per_rank) * self.expert_bytes / self.link_bytes_s, self.last_wall)
        # copies cost every step: their refresh and their summed gradients back to the owner, per layer the
        # rows of the busiest holder or owner (an owner sends a hot expert to every rank holding a copy)
        def rows_of(placement, held):
            return sum(copy_rows(p, h, self.ep, self.redundant) for p, h in zip(placement, held))
        copy_s = (rows_of(new, copies) - rows_of(cur, cur_copies)) * self.copy_bytes * 2 * self.every / self.link_bytes_s
        cost_s += max(0.0, copy_s)
        if new == cur and copies == cur_copies:
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
               "copies": sum(e >= 0 for c in (copies if decision == "apply" else cur_copies) for e in c),
               "predicted_saving_s": saving_s, "move_cost_s": cost_s,
               "measured_rank_max_over_mean": round(mean_imbalance(measured), 6),
               "predicted_rank_max_over_mean_before": round(mean_imbalance(before), 6),
               "predicted_rank_max_over_mean_after": round(mean_imbalance(after), 6)}
        return ((new, copies) if decision == "apply" else None), row

    def _broadcast(self, new):
        """Rank 0's decision on every rank: [flag, rows..., copies...] in one broadcast over the world."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return new
        width = self.n_layers * (self.n_experts + self.ep * self.redundant)
        buf = torch.zeros(1 + width, dtype=torch.int64, device=self.device)
        if new is not None:
            buf[0] = 1
            buf[1:] = torch.tensor([e for part in new for r in part for e in r], dtype=torch.int64,
                                   device=self.device)
        dist.broadcast(buf, src=0)
        return self._rows_from(buf)

    def _rows_from(self, buf: torch.Tensor):
        """The broadcast decision on the host: (rows, copies) to apply, or None."""
        flat = buf.cpu().tolist()  # host sync, once per decision
        if not flat[0]:
            return None
        e, c = self.n_experts, self.ep * self.redundant
        rows = [flat[1 + i * e:1 + (i + 1) * e] for i in range(self.n_layers)]
        base = 1 + self.n_layers * e
        return rows, [flat[base + i * c:base + (i + 1) * c] for i in range(self.n_layers)]
