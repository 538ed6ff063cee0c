"""The DeepSeekMoE layer: route -> dispatch -> experts -> combine, plus shared experts.

The dispatcher is swapped (local vs all-to-all) by parallel/expert.py; the
experts module then holds only this rank's experts. Under an expert placement
plan the dispatcher also hands over the weights of this rank's physical slots
(replicas of experts whose weights live elsewhere); the experts module then
computes with those instead of its own parameters. With slot-owned experts and
redundant copies it hands over the copies' weights only: the owned slots' rows
run against the parameters, the copies' against the copies (two calls). Counters for the bias
update and metrics are kept under no_grad; the bias itself moves once per
optimizer step, outside forward.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..kernels.accelerator import count_keys
from ..models.layers import SwiGLU
from . import balance
from .dispatcher import LocalDispatcher
from .experts import Experts
from .router import Router


class MoE(nn.Module):
    def __init__(self, hidden_size: int, n_experts: int, top_k: int, moe_intermediate_size: int,
                 n_shared_experts: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                 routed_scaling_factor: float, scoring_func: str = "sigmoid", seq_aux_loss_alpha: float = 0.0,
                 router_z_loss_coef: float = 0.0, capacity_factor: Optional[float] = None,
                 impl: str = "grouped"):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.gate = Router(hidden_size, n_experts, top_k, n_group, topk_group, norm_topk_prob,
                           routed_scaling_factor, scoring_func)
        self.experts = Experts(n_experts, hidden_size, moe_intermediate_size, impl)
        self.shared_experts = (SwiGLU(hidden_size, moe_intermediate_size * n_shared_experts)
                               if n_shared_experts > 0 else None)
        self.dispatcher = LocalDispatcher(n_experts, capacity_factor)
        self.seq_aux_loss_alpha = seq_aux_loss_alpha
        self.router_z_loss_coef = router_z_loss_coef
        # counters since the last optimizer step (summed over micro-batches)
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts), persistent=False)
        # [seq_aux_loss sum, z_loss sum, forward calls, dropped copies, routed copies,
        #  rows this rank's experts computed (its expert load under expert parallelism)]
        self.register_buffer("stats", torch.zeros(6, dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x (B, T, d) -> (output (B, T, d), weighted auxiliary loss or None)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        routing = self.gate(flat)
        dispatched = self.dispatcher.dispatch(flat, routing.topk_idx, routing.topk_weight)
        y = self._run_experts(dispatched)
        out = self.dispatcher.combine(y, dispatched)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        aux = self._aux_loss(routing, b)
        if self.training:
            self._count(routing, dispatched)
        return out.view(b, t, d), aux

    def _run_experts(self, d) -> torch.Tensor:
        if self.experts.rows_unbacked:  # a compiled region of its own (compile.py): one graph for any row count
            from torch._dynamo.decorators import mark_unbacked  # (imported by then: the region compiled)
            mark_unbacked(d.x, 0)
            if d.gate is not None:
                mark_unbacked(d.gate, 0)
        if d.weights is None:
            return self.experts(d.x, d.counts, d.gate)
        if d.own_rows is None:
            # the same expert maths with the weights of this rank's physical slots (a placement plan)
            return torch.func.functional_call(self.experts, d.weights, (d.x, d.counts, d.gate))
        # slot-owned experts with copies: two grouped calls, the owned slots' rows with the parameters as
        # they are (no gather; leaf weights, so their gradients may be held back, kernels/wgrad.py), the
        # copies' rows with the copies (always called, if with no row: every step's copies get a gradient
        # sum, zeros if no row); split, not sliced (a slice's backward makes a zero tensor of the whole size)
        sizes, s0 = [d.own_rows, d.x.shape[0] - d.own_rows], self.experts.n_local
        x, counts = d.x.split(sizes), d.counts.split([s0, d.counts.shape[0] - s0])
        gate = d.gate.split(sizes) if d.gate is not None else (None, None)
        own = self.experts(x[0], counts[0], gate[0])
        copies = torch.func.functional_call(self.experts, d.weights, (x[1], counts[1], gate[1]))
        return torch.cat([own, copies])

    def _aux_loss(self, routing, batch: int) -> Optional[torch.Tensor]:
        aux = None
        if self.seq_aux_loss_alpha > 0:
            seq = balance.sequence_balance_loss(routing.scores, routing.topk_idx, batch, self.top_k)
            aux = self.seq_aux_loss_alpha * seq
            self._last_seq = seq.detach()
        if self.router_z_loss_coef > 0:
            z = balance.router_z_loss(routing.logits)
            aux = self.router_z_loss_coef * z + (aux if aux is not None else 0.0)
            self._last_z = z.detach()
        return aux

    @torch.no_grad()
    def _count(self, routing, dispatched) -> None:
        dropped = dispatched.dropped
        self.tokens_per_expert += count_keys(routing.topk_idx, self.n_experts).float()
        s = self.stats
        if self.seq_aux_loss_alpha > 0:
            s[0] += self._last_seq.double()
        if self.router_z_loss_coef > 0:
            s[1] += self._last_z.double()
        s[2] += 1
        s[3] += dropped
        s[4] += routing.topk_idx.numel()
        s[5] += dispatched.load if dispatched.load is not None else routing.topk_idx.numel() - dropped

    @torch.no_grad()
    def reset_counters(self) -> None:
        self.tokens_per_expert.zero_()
        self.stats.zero_()
