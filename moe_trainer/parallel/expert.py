"""Expert parallelism: each EP rank keeps n_routed_experts / ep experts (global
ids stay stable: expert e lives on EP rank e // n_local) and tokens travel to
them with all_to_all_single (uneven splits; gloo has no list form).

DeepSpeed only treats its own MoE classes as MoE; a parameter-free marker that
subclasses deepspeed.moe.layer.MoE makes the engine build MoE optimizer groups,
and the expert parameters carry `allreduce=False` / `group_name`, so ZeRO-1
reduces and shards them over the expert-data-parallel group only. DeepSpeed's
group registry is filled with the mesh's own groups, so both agree.

With `dedup=True` (DeepSeek-V3's per-node dedup) a token's hidden state crosses
to an EP rank once however many of its top-k experts live there; a small
metadata row (the token's local expert slots and gates, fp32) travels with it.
The receiver expands it to its local experts, applies the gates, sums the
token's outputs and sends one row back. Rows that leave the rank are counted
as "dispatch"/"combine" (what plan.alltoall_bytes_exact predicts, dedup=True);
the metadata as "dispatch_meta".

With an expert placement plan (`parallel.expert_placement`, replicas.py) each
EP rank hosts S = R / ep physical slots of the plan, hot experts on several
ranks. The canonical weights do not move (expert e stays on EP rank
e // n_local, so ZeRO groups and checkpoints are those of the unplaced run):
every forward, a rank fetches the weights of its slots' foreign experts from
their home ranks with one all-to-all of stacked weight rows ("expert_weights",
3 * moe_intermediate_size * hidden_size elements per expert), and backward
sends their gradients home, where autograd sums them with the local replicas'.
A token copy routed to expert e goes to e's replica on the sender's own rank
if there is one, else round-robin over e's replicas; dispatch and combine
(plain or dedup) then run over physical slots. A capacity still applies per
logical expert. Gates, combine and the expert maths are unchanged, so the model
computes what the unplaced model computes (up to float rounding). Cost per
micro-batch and MoE layer: each rank receives its foreign experts' weights once
(however many of their replicas it hosts) and sends as many gradient rows back,
and holds its S slots' weights until backward.
With slot-owned experts (`parallel.replace_every`, slots.py) the placement is
`owned`: each of a rank's E / ep owned slots IS a row of its expert parameters,
so tokens are routed to slots the same way and nothing is fetched. Redundant
slots (`parallel.redundant_slots`) hold copies of other ranks' experts: their
weights are a cache refreshed once per optimizer step (refresh_cache, one
all-to-all of weight rows). The copies are leaves of autograd: each backward
adds their gradients into a sum kept on the holder (in the step's accumulation
dtype), and once per step, after the last backward and before the gradient
reduction, the sums go to the owners (copy_grads_to_owners: the refresh's
exchange reversed), so an expert has one set of parameters and optimizer state
however many copies route tokens, and no backward waits for a collective of
its own (the overlapped executor hides the MoE all-to-alls around it). A
rank's slots are its S0 owned slots (parameter rows 0..S0-1, in order) then
its r redundant ones, and rows arrive sorted by slot, so the owned slots' rows
come first: the experts run as two kernel calls (MoE._run_experts), those rows
against the parameters and the rest against the cache (kept in slot order),
both as they are, nothing gathered per micro-batch. The owned rows' number is read on the host with the split sizes,
in the same copy (_owned_of).
Token rows, dedup metadata and expert weights travel as ONE autograd node
(`_AllToAllGroup`), so backward enters the collectives in the same order on
every rank.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .. import kernels
from ..kernels.accelerator import count_keys
from ..moe.dispatcher import (CombineRows, Dispatched, GatherRows, inverse_permutation, route_order, rows_by_token,
                              sort_by_key)
from ..models.init import global_view, mark_shard
from ..moe.experts import Experts
from ..moe.layer import MoE
from .comm import (CommCounter, _exchange, all_to_all_rows, all_to_all_single, enable_shm_transport, traced,
                   traced_all_to_all_rows)
from .mesh import Mesh
from .replicas import LayerPlacement


@dataclass
class _A2ACtx:
    token_of: torch.Tensor  # (R,) source token of each expert-sorted routed copy
    gate: torch.Tensor  # (R,) gate of each copy, applied at the source on combine
    in_splits: list[int]  # rows sent to each EP rank
    out_splits: list[int]  # rows received from each EP rank
    unsort: torch.Tensor  # expert-major position of each received row (y[unsort]: back to received order)
    n_tokens: int
    regroup: torch.Tensor  # received row of each expert-major row (the inverse of unsort)
    by_row: Optional[torch.Tensor]  # (N * k,) sent rows of each token's copies; None when copies were dropped
    k: int


class _AllToAllGroup(torch.autograd.Function):
    """Several tensors through all-to-alls, each with its own splits, as ONE autograd node, so every
    rank runs the backward all-to-alls in the same order (separate nodes could become ready in a
    data-dependent order on different ranks and mismatch gloo's collectives).
    specs: one (out_splits, in_splits, kind) per tensor; backward counts kind + "_grad"."""

    @staticmethod
    def apply_or_trace(specs, group, counter, *tensors) -> tuple:
        """apply(); while torch.compile traces, one functional all-to-all per tensor (the compiled
        backward is one graph, the same on every rank, so its collectives keep one order)."""
        if not traced():
            return _AllToAllGroup.apply(specs, group, counter, *tensors)
        return tuple(traced_all_to_all_rows(t, out, inp, group, counter, kind)
                     for t, (out, inp, kind) in zip(tensors, specs))

    @staticmethod
    def forward(ctx, specs, group, counter, *tensors):
        ctx.specs, ctx.group, ctx.counter = specs, group, counter
        return tuple(_exchange(t, out, inp, group, counter, kind) for t, (out, inp, kind) in zip(tensors, specs))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None) + tuple(_exchange(g, inp, out, ctx.group, ctx.counter, kind + "_grad")
                                          for g, (out, inp, kind) in zip(grads, ctx.specs))


@dataclass
class Outbound:
    """A dispatch's or combine's tensors on their way out, cut at the exchange: one all-to-all per
    tensor (specs: (out_splits, in_splits, kind) each), then complete(received, carried) finishes on
    this rank. `carried`: tensors of the sending side that complete() uses (the gates a plain combine
    applies at the source); the overlapped executor re-roots them between its stages. The blocking
    path (send_now) runs both back to back. dropped, load: what MoE._count reads, known before."""
    tensors: tuple
    specs: tuple
    carried: tuple
    complete: Callable
    dropped: int = 0
    load: Optional[int] = None


@dataclass
class _DedupCtx:
    tokens: torch.Tensor  # (S,) source token of each sent row, grouped by destination rank
    pair_row: torch.Tensor  # (M,) received row of each expanded (row, local expert) pair, expert-sorted
    in_splits: list[int]
    out_splits: list[int]
    n_received: int
    n_tokens: int


class AllToAllDispatcher:
    """Same interface as LocalDispatcher; experts receive rows grouped by local expert, or by local
    physical slot under a placement plan (then `experts`, the layer's experts module, is required:
    its canonical weights are sent to the ranks that host replicas)."""

    def __init__(self, n_experts: int, ep: int, group, capacity_factor: Optional[float] = None,
                 counter: Optional[CommCounter] = None, dedup: bool = False,
                 placement: Optional[LayerPlacement] = None, experts: Optional[Experts] = None):
        self.n_experts, self.ep, self.group = n_experts, ep, group
        self.placement, self.experts = placement, experts
        # redundant slots' copies (slot-owned experts): (r, 2H, d), (r, d, H) in slot order, leaves of autograd
        # (refresh_cache), and the sums of their gradients since the last hand-back (_sum_copy_grad)
        self.cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.copy_grads: list[Optional[torch.Tensor]] = [None, None]
        self._grad_accs: list = []  # the cache's gradient accumulators (refresh_cache)
        self.capacity_factor = capacity_factor
        self.counter = counter
        self.dedup = dedup
        self.kernels = kernels.backend()
        if placement is not None and experts is None:
            raise ValueError("a placement needs the experts module whose weights it replicates")

    @property
    def n_local(self) -> int:
        """Destinations per rank: experts, or the placement's physical slots (which a re-placement may
        change between steps: parallel/slots.py)."""
        return self.placement.slots_per_rank if self.placement is not None else self.n_experts // self.ep

    def _mark(self):
        return self.counter.mark() if self.counter is not None and not traced() else None

    def _time(self, kind: str, start) -> None:
        if start is not None:  # no clock is read inside a compiled graph
            self.counter.add_span(kind, start)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> Dispatched:
        return self.send_now(self.dispatch_out(x, topk_idx, topk_weight))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        return self.send_now(self.combine_out(y, d))

    def send_now(self, o: "Outbound"):
        """The blocking exchange: o's all-to-alls (one autograd node), then o.complete. The overlapped
        executor (overlap.py) issues the same tensors asynchronously instead and completes later."""
        if len(o.tensors) == 1:
            (out, inp, kind), = o.specs
            received = (all_to_all_rows(o.tensors[0], out, inp, self.group, self.counter, kind),)
        else:
            received = _AllToAllGroup.apply_or_trace(o.specs, self.group, self.counter, *o.tensors)
        return o.complete(received, o.carried)

    def dispatch_out(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> "Outbound":
        """Routing and the split-size exchange; the token rows to send. complete(received, carried)
        -> Dispatched."""
        if self.dedup:
            return self._dispatch_dedup(x, topk_idx, topk_weight)
        n, k = topk_idx.shape
        order, counts, dropped = self._route(topk_idx)
        token_of = order // k
        # 1. exchange per-destination counts: recv[s, e] = rows rank s sends to my local expert (slot) e
        recv = torch.empty_like(counts)
        t0 = self._mark()
        all_to_all_single(recv, counts, group=self.group)
        send_counts, recv = counts.view(self.ep, self.n_local), recv.view(self.ep, self.n_local)
        in_splits, out_splits, *own = self._splits(send_counts.sum(1), recv.sum(1), *self._owned_of(recv))
        self._time("dispatch_counts", t0)
        # 2. send token copies (rows are destination-sorted, so each rank's rows are contiguous);
        # gathers whose backward is a gather too (GatherRows), not an accumulating scatter
        by_row = inverse = None
        if order.numel() == n * k:  # dropless: each token's k copies, at sorted positions by_row
            inverse = inverse_permutation(order)
            by_row = rows_by_token(inverse, n, k)
        gate = GatherRows.apply(topk_weight.reshape(-1), order, inverse, 1)

        def complete(out, carried) -> Dispatched:
            received, _, weights = self._received(out, False)
            # 3. regroup received rows (source-major) into local-expert-major order
            local_expert = torch.repeat_interleave(torch.arange(self.n_local, device=x.device).repeat(self.ep),
                                                   recv.reshape(-1), output_size=sum(out_splits))
            regroup, _ = sort_by_key(local_expert, self.n_local, self.kernels)
            unsort = inverse_permutation(regroup)
            ctx = _A2ACtx(token_of, carried[0], in_splits, out_splits, unsort, n, regroup, by_row, k)
            return Dispatched(GatherRows.apply(received, regroup, unsort, 1), None, recv.sum(0), ctx,
                              dropped, load=sum(out_splits), weights=weights, own_rows=self._own_rows(own))
        return self._outbound(GatherRows.apply(x, token_of, by_row, k), out_splits, in_splits, None, complete,
                              (gate,), dropped, sum(out_splits))

    @staticmethod
    def _splits(*per_rank: torch.Tensor) -> list[list[int]]:
        """The all-to-all split sizes on the host: THE host sync of an expert-parallel MoE layer,
        one device-to-host copy of every (ep,) count vector given, per micro-batch. Under
        torch.compile (capture_scalar_outputs) they are unbacked symbolic sizes, no graph break.
        Compiled, the copy is explicit: a graph turns `.tolist()` into one item() per element, each a
        blocking read of device memory (2 ep of them), where items of the host copy read host memory."""
        ep = per_rank[0].numel()
        counts = torch.cat(per_rank)
        # host sync (the only one of the layer): one copy; eager's .tolist() of a device tensor is one
        flat = (counts.cpu() if traced() else counts).tolist()
        if traced():
            for size in flat:
                torch._check_is_size(size)
        return [flat[i * ep:(i + 1) * ep] for i in range(len(per_rank))]

    def _owned_of(self, per_slot: torch.Tensor) -> list[torch.Tensor]:
        """[(ep,) rows of this rank's owned slots in each rank's column of per_slot (ep, S)] with copies
        (slot-owned experts), else []: read on the host with the split sizes (_splits), in the same copy."""
        return [per_slot[:, :self.experts.n_local].sum(1)] if self._holds_copies() else []

    def _holds_copies(self) -> bool:
        """Slot-owned experts with redundant slots (the layer's copies are placed)."""
        return self.placement is not None and self.placement.cached

    @staticmethod
    def _own_rows(own: list[list[int]]) -> Optional[int]:
        """The rows of the owned slots (the first ones of the slot-sorted rows), from _owned_of's host
        split sizes; None without copies."""
        return sum(own[0]) if own else None

    def _route(self, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Destination-sorted order of the kept routed copies, rows per destination (expert, or
        physical slot under a plan), copies dropped. A capacity applies per logical expert, as
        without a plan."""
        order, counts, dropped = route_order(topk_idx, self.n_experts, self.capacity_factor, self.kernels)
        if self.placement is None:
            return order, counts, dropped
        slot = self.placement.slots(topk_idx.reshape(-1))[order]
        resort, counts = sort_by_key(slot.contiguous(), self.ep * self.n_local, self.kernels)
        return order[resort], counts, dropped

    def _fetched(self) -> Optional[LayerPlacement]:
        """The placement whose foreign experts' weights this rank fetches every forward; None without a
        plan and for slot-owned experts (parallel.replace_every), whose slots are their own parameters."""
        return self.placement if self.placement is not None and not self.placement.owned else None

    def _outbound(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                  meta: Optional[torch.Tensor], complete, carried: tuple, dropped: int, load: int) -> "Outbound":
        """Token rows (and dedup metadata) for their ranks; under a fetching plan the weights of this
        rank's slots travel in the same exchange."""
        p = self._fetched()
        specs, tensors = [(out_splits, in_splits, "dispatch")], [rows]
        if meta is not None:
            specs.append((out_splits, in_splits, "dispatch_meta"))
            tensors.append(meta)
        if p is not None:
            specs.append((p.recv_splits, p.send_splits, "expert_weights"))
            tensors.append(self._weight_rows())
        return Outbound(tuple(tensors), tuple(specs), carried, complete, dropped, load)

    def _received(self, out, meta: bool):
        """(rows, meta or None, slot weights or None) from the received tensors of _outbound's exchange."""
        out = list(out)
        received = out.pop(0)
        meta = out.pop(0) if meta else None
        if self._fetched() is not None:
            return received, meta, self._slot_weights(out[0])
        if self._holds_copies():  # the copies' weights only: the owned slots' are the parameters (MoE._run_experts)
            return received, meta, self._copies()
        return received, meta, None

    def refresh_cache(self, grad_dtype: torch.dtype = torch.float32) -> int:
        """The redundant slots' copies made their owners' weights now (slot-owned experts with copies, once
        per optimizer step and after a move): one all-to-all of weight rows. The copies are new leaves of
        autograd whose gradients each backward adds into a sum in `grad_dtype` (the run's accumulation
        dtype), cleared here. Returns the bytes sent."""
        w1, w2 = self.experts.gate_up_proj, self.experts.down_proj
        p = self.placement.on(w1.device)
        with torch.no_grad():
            rows = self._weight_rows()
            got = _exchange(rows, p.recv_splits, p.send_splits, self.group, self.counter, "expert_copies")
            r, split = p.slots_per_rank - w1.shape[0], w1[0].numel()
            # in slot order, each weight contiguous (as the kernels take parameters); an empty slot holds zeros
            c1, c2 = w1.new_zeros((r,) + tuple(w1.shape[1:])), w2.new_zeros((r,) + tuple(w2.shape[1:]))
            c1.view(r, -1).index_copy_(0, p.copy_slot, got[:, :split])
            c2.view(r, -1).index_copy_(0, p.copy_slot, got[:, split:])
        self.cache = (c1.requires_grad_(), c2.requires_grad_())
        # their gradient accumulators held for as long as the cache lives: a weight saved inside a
        # checkpointed piece (full recomputation) is unpacked as an alias that reaches its leaf's
        # accumulator only while something holds it (as DeepSpeed holds its parameters'), else a held-back
        # gradient (kernels/wgrad.py) handed to the alias is lost
        with torch.enable_grad():  # (refresh runs under no_grad)
            self._grad_accs = [c.view_as(c).grad_fn.next_functions[0][0] for c in self.cache]
        self.copy_grads = [None, None]
        for i, c in enumerate(self.cache):
            c.register_post_accumulate_grad_hook(functools.partial(self._sum_copy_grad, i, grad_dtype))
        return rows.numel() * rows.element_size()

    def drop_copies(self) -> None:
        """The copies, their gradient sums and accumulators forgotten (new tables: refresh_cache fills them)."""
        self.cache, self.copy_grads, self._grad_accs = None, [None, None], []

    def _sum_copy_grad(self, i: int, dtype: torch.dtype, copy: torch.Tensor) -> None:
        """A backward's gradient of copy weight i (autograd's hook, after it accumulated it into .grad) added
        into the step's sum, and .grad freed: the sum is what copy_grads_to_owners sends. (Where the weight
        gradients are held back, kernels/wgrad.py, the backward hands autograd none and the hook runs with
        .grad None; the held-back gradient arrives later, through the executor's hand-over.)"""
        g, copy.grad = copy.grad, None
        acc = self.copy_grads[i]
        if g is not None:
            self.copy_grads[i] = g.to(dtype, copy=True) if acc is None else acc.add_(g)

    @torch.no_grad()
    def copy_grads_to_owners(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's summed gradients of this rank's copies sent to their owners (one all-to-all over the EP
        group, the refresh's reversed, in the weights' dtype; every rank of the group calls it for the same
        layers), after the step's last backward and before its gradient reduction. Returns [(expert
        weight, gradient to add to it)]: zeros but the rows of experts that other ranks hold copies of,
        each the sum of its copies' gradients. The sums are cleared."""
        w1, w2 = self.experts.gate_up_proj, self.experts.down_proj
        p = self.placement.on(w1.device)
        sums = [torch.zeros_like(c, dtype=w1.dtype) if g is None else g for c, g in zip(self.cache, self.copy_grads)]
        self.copy_grads = [None, None]
        rows = torch.cat([g[p.copy_slot].flatten(1).to(w.dtype) for g, w in zip(sums, (w1, w2))], 1)  # received order
        back = _exchange(rows, p.send_splits, p.recv_splits, self.group, self.counter, "expert_copies_grad")
        split = w1[0].numel()
        return [(w, w.new_zeros(w.shape).view(w.shape[0], -1).index_add_(0, p.send_index, part).view(w.shape))
                for w, part in ((w1, back[:, :split]), (w2, back[:, split:]))]

    def _copies(self) -> dict[str, torch.Tensor]:
        """The weights of this rank's r redundant slots for the forward, in slot order: the cache itself (leaves:
        no exchange, no copy; their gradients are summed here until copy_grads_to_owners)."""
        if self.cache is None:
            raise RuntimeError("the redundant slots' copies were not refreshed after the placement changed "
                               "(SlotExperts.refresh)")
        return {"gate_up_proj": self.cache[0], "down_proj": self.cache[1]}

    def _weight_rows(self) -> torch.Tensor:
        """(sent experts, 3 * H * d): this rank's experts that other ranks' slots need, destination-major."""
        w1, w2 = self.experts.gate_up_proj, self.experts.down_proj
        idx = self.placement.on(w1.device).send_index
        return torch.cat([w1[idx].flatten(1), w2[idx].flatten(1)], 1)

    def _slot_weights(self, received: torch.Tensor) -> dict[str, torch.Tensor]:
        """Weights of this rank's S slots: rows of [local experts; fetched experts]. Backward sums the
        gradients of an expert's replicas on this rank into its local or fetched row."""
        w1, w2 = self.experts.gate_up_proj, self.experts.down_proj  # (n_local, 2H, d), (n_local, d, H)
        m, split = received.shape[0], w1[0].numel()
        r1 = received[:, :split].reshape((m,) + tuple(w1.shape[1:]))
        r2 = received[:, split:].reshape((m,) + tuple(w2.shape[1:]))
        idx = self.placement.on(w1.device).slot_index
        return {"gate_up_proj": torch.cat([w1, r1])[idx], "down_proj": torch.cat([w2, r2])[idx]}

    def combine_out(self, y: torch.Tensor, d: Dispatched) -> "Outbound":
        """The expert outputs' rows back to their source ranks; complete(received, carried) -> (N, d)."""
        c = d.ctx
        if isinstance(c, _DedupCtx):
            # y is gated already: sum each received row's local-expert outputs, send one row back
            rows = y.new_zeros(c.n_received, y.shape[-1]).index_add_(0, c.pair_row, y)

            def complete(out, carried):
                return out[0].new_zeros(c.n_tokens, out[0].shape[-1]).index_add_(0, c.tokens, out[0])
            return Outbound((rows,), ((c.in_splits, c.out_splits, "combine"),), (), complete)

        def complete_gated(out, carried):
            back, (gate,) = out[0], carried
            return CombineRows.apply(back * gate[:, None].to(back.dtype), c.token_of, c.by_row, c.n_tokens, c.k)
        return Outbound((GatherRows.apply(y, c.unsort, c.regroup, 1),), ((c.in_splits, c.out_splits, "combine"),),
                        (c.gate,), complete_gated)

    def _dispatch_dedup(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> Dispatched:
        n, k = topk_idx.shape
        ep, n_local = self.ep, self.n_local
        idx = topk_idx
        dropped = 0
        if self.capacity_factor is not None:  # a capacity, if set, applies per source rank, to copies
            order, _, dropped = route_order(topk_idx, self.n_experts, self.capacity_factor, self.kernels)
            kept = torch.zeros(n * k, dtype=torch.bool, device=x.device)
            kept[order] = True
            idx = torch.where(kept.view(n, k), topk_idx, torch.full_like(topk_idx, -1))
        if self.placement is not None:  # destinations are physical slots
            slot = self.placement.slots(topk_idx.reshape(-1)).view(n, k)
            idx = torch.where(idx >= 0, slot, torch.full_like(idx, -1))
        dest = torch.where(idx >= 0, idx // n_local, torch.full_like(idx, ep))  # ep: dropped copy
        # hit[t, r]: token t goes to EP rank r (once, whatever the number of its experts there)
        hit = torch.zeros(n, ep + 1, dtype=torch.bool, device=x.device)
        hit.scatter_(1, dest, True)
        hit = hit[:, :ep]
        # rows (tokens) and (token, expert) pairs for each rank, exchanged in one all-to-all of 2 * ep ints
        # (3 * ep with copies: the pairs for the owned slots too, as _owned_of's)
        pairs_to = [count_keys(dest, ep + 1)[:ep]]
        if self._holds_copies():  # local slot < S0: an owned slot
            owned = (idx >= 0) & (idx % n_local < self.experts.n_local)
            pairs_to.append(count_keys(torch.where(owned, dest, torch.full_like(dest, ep)), ep + 1)[:ep])
        send = torch.stack([hit.sum(0)] + pairs_to, 1)  # (ep, 2 or 3)
        recv = torch.empty_like(send)
        t0 = self._mark()
        all_to_all_single(recv, send, group=self.group)
        in_splits, out_splits, recv_pairs, *own = self._splits(send[:, 0], recv[:, 0], *recv[:, 1:].t())
        self._time("dispatch_counts", t0)
        # the sent rows, grouped by destination rank, token order within: the first sum(in_splits)
        # hits in (rank, token) order (a stable sort instead of nonzero, whose size needs a sync)
        flat_hit = hit.t().reshape(-1)
        sent = torch.argsort((~flat_hit).to(torch.uint8), stable=True)[:sum(in_splits)]
        dst_of, tokens = sent // n, sent % n
        # metadata per sent row: the token's k slots as (gate, local expert id or -1 when elsewhere)
        here = dest[tokens] == dst_of[:, None]  # (S, k)
        local_id = torch.where(here, idx[tokens] - dst_of[:, None] * n_local, torch.full_like(idx[tokens], -1))
        gate = topk_weight[tokens] * here.to(topk_weight.dtype)
        meta = torch.cat([gate.float(), local_id.float()], 1)  # ids < 2**24 are exact in fp32
        # (GatherRows: index_select forward, index_add_ backward; a tensor index's backward is an
        # accumulating index_put, 15-25x slower on a CPU)
        n_pairs = sum(recv_pairs)

        def complete(out, carried) -> Dispatched:
            received, rmeta, weights = self._received(out, True)
            # expand: one (received row, local expert) pair per slot that names a local expert, expert-major
            r_gate, r_id = rmeta[:, :k], rmeta[:, k:].detach().long()
            pairs = torch.argsort((r_id < 0).reshape(-1).to(torch.uint8), stable=True)[:n_pairs]
            pair_row, slot = pairs // k, pairs % k
            pair_expert = r_id[pair_row, slot]
            sort, counts = sort_by_key(pair_expert.contiguous(), n_local, self.kernels)
            pair_row, slot = pair_row[sort], slot[sort]
            ctx = _DedupCtx(tokens, pair_row, in_splits, out_splits, received.shape[0], n)
            rows = GatherRows.apply(received, pair_row, None, 1)
            gates = GatherRows.apply(r_gate.reshape(-1), pair_row * k + slot, None, 1)
            return Dispatched(rows, gates, counts, ctx, dropped, load=n_pairs, weights=weights,
                              own_rows=self._own_rows(own))
        return self._outbound(GatherRows.apply(x, tokens, None, 1), out_splits, in_splits, meta, complete, (),
                              dropped, n_pairs)


def _deepspeed_moe_marker(num_experts: int, ep_size: int, group_name: str, mesh: Mesh) -> nn.Module:
    """A parameter-free module DeepSpeed's engine recognises as MoE."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class ExpertParallelMarker(DeepSpeedMoE):
        def __init__(self):
            nn.Module.__init__(self)
            self.num_experts, self.ep_size, self.expert_group_name = num_experts, ep_size, group_name

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            register_deepspeed_groups(mesh, group_name)

        def forward(self, *args, **kwargs):  # never called: our MoE layers do the work
            raise RuntimeError("the DeepSpeed MoE marker has no forward")

    return ExpertParallelMarker()


def register_deepspeed_groups(mesh: Mesh, group_name: str) -> None:
    """Tell DeepSpeed's group registry the mesh's EP and expert-DP groups."""
    from deepspeed.utils import groups
    groups._EXPERT_PARALLEL_GROUP[group_name] = mesh.group_or_self("ep")
    groups._EXPERT_DATA_PARALLEL_GROUP[group_name] = mesh.group_or_self("edp")
    groups._EXPERT_PARALLEL_GROUP_RANKS[group_name] = mesh.members["ep"]
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name] = mesh.members["edp"]


def shard_experts(layer: MoE, ep_rank: int, ep: int) -> None:
    """Keep this rank's slice of the stacked expert weights (real or on the meta device), marked
    with its place among the global experts (models/init.py, checkpoint.py)."""
    ex = layer.experts
    n_local = ex.n_local // ep
    lo = ep_rank * n_local
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(ex, name)
            new = nn.Parameter(old[lo:lo + n_local].clone())
            mark_shard(new, global_view(old), (lo, 0, 0))
            setattr(ex, name, new)
    ex.n_local, ex.expert_offset = n_local, ex.expert_offset + lo


def apply_expert_parallel(model: nn.Module, mesh: Mesh, counter: Optional[CommCounter] = None,
                          dedup: bool = False, placement: Optional[list[LayerPlacement]] = None,
                          cpu_alltoall: str = "shm", timeout_s: float = 300.0) -> nn.Module:
    """Shard the experts over the EP group and swap in all-to-all dispatchers; `placement`, if
    given, holds one LayerPlacement per MoE layer of the whole model (global order).
    cpu_alltoall="shm": on gloo, the EP group's all-to-alls go through shared memory when all its
    ranks share this host (shm_alltoall.py), else through gloo."""
    ep = mesh.layout.ep
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    if ep == 1 or not moe:
        return model
    if placement is not None and len(placement) != len(moe):
        raise ValueError(f"the expert placement has {len(placement)} layers but the model has {len(moe)} "
                         f"MoE layers.")
    group_name = f"ep_size_{ep}"
    ep_rank = mesh.index("ep")
    if cpu_alltoall == "shm":
        enable_shm_transport(mesh.group("ep"), timeout_s=timeout_s)
    for i, layer in enumerate(moe):
        shard_experts(layer, ep_rank, ep)
        layer.dispatcher = AllToAllDispatcher(layer.n_experts, ep, mesh.group("ep"),
                                              layer.dispatcher.capacity_factor, counter, dedup,
                                              placement[i] if placement is not None else None, layer.experts)
        for p in layer.experts.parameters():
            p.allreduce = False  # deepspeed.moe.utils.is_moe_param
            p.group_name = group_name
            p.expert_shard = (ep_rank, ep)  # checkpoint.py gathers / slices along dim 0
    model.deepspeed_moe_marker = _deepspeed_moe_marker(moe[0].n_experts, ep, group_name, mesh)
    # on every rank now, not only where the engine finds the marker: a pipeline stage without experts
    # still reduces the expert norm over these groups (zero.same_norm_collectives)
    register_deepspeed_groups(mesh, group_name)
    return model
