"""DeepSeek-V3 router: affinities, group-limited top-k with a selection-only bias.

No communication here: the router sees local tokens and returns expert ids
and gate values; dispatch is the dispatcher's job.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels


@dataclass
class Routing:
    topk_idx: torch.Tensor  # (N, k) int64 global expert ids
    topk_weight: torch.Tensor  # (N, k) fp32 gate values (normalised, scaled)
    scores: torch.Tensor  # (N, E) fp32 affinities (sigmoid or softmax), for balance losses
    logits: torch.Tensor  # (N, E) fp32, for the z-loss


def group_limited_mask(scores_for_choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Bool mask (N, E) of experts inside each token's best `topk_group` groups.

    A group's score is the sum of its top-2 experts' (biased) scores, as in
    DeepSeek-V3 (node-limited routing when groups map to nodes or EP ranks).
    """
    n, e = scores_for_choice.shape
    grouped = scores_for_choice.view(n, n_group, e // n_group)
    group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)  # (N, G)
    chosen = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)


def topk_indices(choice: torch.Tensor, k: int, backend=None) -> torch.Tensor:
    """(N, k) int64 indices of each row's k largest scores, by the kernel back end (unsorted)."""
    return (backend or kernels.backend()).topk(choice, k)


class Fp32Logits(torch.autograd.Function):
    """logits = x W^T computed in fp32 (routing decisions as precise as the reference's), with a
    backward in the model's dtype: the gradients land in x's and W's dtype anyway, and on a CPU
    a bf16 GEMM runs ~5x faster than an fp32 one. For fp32 models this is plain F.linear."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.to(x.dtype)
        dx = g.mm(weight.to(x.dtype)) if ctx.needs_input_grad[0] else None
        dw = g.t().mm(x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


class Router(nn.Module):
    """Gate with weight (E, d) and the aux-loss-free balancing bias (E,).

    The bias only changes which experts are chosen, never the gate values; it is
    a buffer moved by `balance.update_bias` once per optimizer step.
    """

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, scoring_func: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.n_experts, self.top_k = n_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.scoring_func = scoring_func
        self.kernels = kernels.backend()

    def forward(self, x: torch.Tensor) -> Routing:
        """x (N, d) -> Routing. Computed in fp32 whatever the model dtype."""
        logits = Fp32Logits.apply(x, self.weight)  # (N, E)
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores.detach() + self.e_score_correction_bias  # bias: selection only
        if self.n_group > 1 and self.topk_group < self.n_group:
            choice = choice.masked_fill(~group_limited_mask(choice, self.n_group, self.topk_group), float("-inf"))
        topk_idx = topk_indices(choice, self.top_k, self.kernels)
        weight = scores.gather(1, topk_idx)
        if self.norm_topk_prob:  # also for top_k == 1, as DeepSeek-V3 and Hugging Face do
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        return Routing(topk_idx, weight * self.routed_scaling_factor, scores, logits)
