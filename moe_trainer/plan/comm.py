"""Communication per step: the expert all-to-all (exact for a routing, expected under uniform
routing), data parallel / ZeRO, pipeline send/recv, tensor and context parallel."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..config import ModelConfig
from .memory import FP32
from .params import PlanError, Precision


# ----------------------------------------------------------------------------- expert all-to-all

@dataclass(frozen=True)
class AllToAllBytes:
    """Bytes one rank moves in one MoE layer's forward all-to-alls: dispatch, then combine.

    Only token copies that leave their rank count. The combine sends each expert output back to the
    token's rank, so combine_send = dispatch_recv and combine_recv = dispatch_send. The backward
    repeats both with the roles swapped (the same bytes again).
    """

    dispatch_send: float
    dispatch_recv: float
    combine_send: float
    combine_recv: float
    sent: float  # dispatch_send + combine_send
    received: float  # dispatch_recv + combine_recv
    total: float  # sent + received

    @classmethod
    def of(cls, dispatch_send: float, dispatch_recv: float) -> "AllToAllBytes":
        sent = received = dispatch_send + dispatch_recv
        return cls(dispatch_send, dispatch_recv, dispatch_recv, dispatch_send, sent, received, sent + received)


def _as_lists(x):
    """Nested lists from nested lists or tensors (`.tolist()`: a host sync for device tensors)."""
    return x.tolist() if hasattr(x, "tolist") else [_as_lists(v) if not isinstance(v, (int, float)) else v
                                                      for v in x]


def remote_copies(routing, n_experts: int, ep: int, dedup: bool = False) -> list[list[int]]:
    """copies[src][dst]: token copies EP rank src sends to EP rank dst in a dispatch (0 when src == dst).

    routing[r][t] lists the global expert ids chosen for token t of EP rank r, for every rank of the
    EP group; expert e lives on rank e // (n_experts / ep). With `dedup` a token goes to a rank once,
    however many of its experts live there.
    """
    routing = _as_lists(routing)
    if ep < 1 or n_experts % ep or len(routing) != ep:
        raise PlanError(f"routing must list the tokens of all {ep} EP ranks and n_experts ({n_experts}) must be "
                        f"divisible by ep ({ep}); got routing for {len(routing)} ranks.")
    per_rank = n_experts // ep
    copies = [[0] * ep for _ in range(ep)]
    for src, tokens in enumerate(routing):
        for experts in tokens:
            if any(not 0 <= int(e) < n_experts for e in experts):
                raise PlanError(f"expert ids must lie in [0, {n_experts}), got {experts} on EP rank {src}.")
            dests = [int(e) // per_rank for e in experts]
            for dst in (set(dests) if dedup else dests):
                copies[src][dst] += dst != src
    return copies


def alltoall_bytes_exact(routing, n_experts: int, ep: int, rank: int, hidden: int, bytes_per_elem: int,
                         dedup: bool = False) -> AllToAllBytes:
    """Exact bytes EP rank `rank` sends and receives in one layer's dispatch and combine for a concrete
    routing (see `remote_copies` for its layout): each copy that leaves a rank carries hidden *
    bytes_per_elem bytes. The expert-parallel dispatcher must move exactly this."""
    copies = remote_copies(routing, n_experts, ep, dedup)
    row = hidden * bytes_per_elem
    sent = sum(copies[rank]) * row
    received = sum(copies[src][rank] for src in range(ep)) * row
    return AllToAllBytes.of(sent, received)


def _rank_hit_probability(rank: int, n_experts: int, topk: int, ep: int, n_group: int, topk_group: int) -> float:
    """P(EP rank `rank` holds at least one of a token's experts) when the token picks topk_group of
    n_group groups uniformly, then top-k experts uniformly among those groups' experts (what iid
    scores give under DeepSeek's group-limited routing; n_group = topk_group = 1 is plain top-k)."""
    per_rank, per_group = n_experts // ep, n_experts // n_group
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    overlaps = [min(hi, (g + 1) * per_group) - max(lo, g * per_group) for g in range(n_group)]
    overlaps = [o for o in overlaps if o > 0]
    pool = topk_group * per_group
    ways = {(0, 0): 1}  # (groups of this rank chosen, its experts in the pool) -> number of subsets
    for o in overlaps:
        grown = dict(ways)
        for (c, x), w in ways.items():
            grown[(c + 1, x + o)] = grown.get((c + 1, x + o), 0) + w
        ways = grown
    others = n_group - len(overlaps)
    miss = sum(w * math.comb(others, topk_group - c) * math.comb(pool - x, topk)
               for (c, x), w in ways.items() if c <= topk_group)
    return 1 - miss / (math.comb(n_group, topk_group) * math.comb(pool, topk))


def expected_remote_ranks(n_experts: int, topk: int, ep: int, n_group: int = 1, topk_group: int = 1) -> float:
    """Expected number of OTHER EP ranks a token is sent to with dedup, under uniform routing:
    (ep - 1) / ep * sum over ranks of P(rank hit), averaging over the token's own rank. With
    node-limited routing and whole groups per rank (n_group % ep == 0) it never exceeds topk_group."""
    if ep == 1:
        return 0.0
    hits = sum(_rank_hit_probability(r, n_experts, topk, ep, n_group, topk_group) for r in range(ep))
    return (ep - 1) / ep * hits


def alltoall_bytes_expected(tokens: float, topk: int, hidden: int, ep: int, bytes_per_elem: int,
                            n_experts: Optional[int] = None, dedup: bool = False, n_group: int = 1,
                            topk_group: int = 1) -> AllToAllBytes:
    """Expected bytes per rank of one layer's dispatch + combine under uniform routing.

    Without dedup: tokens * topk * hidden * bytes per direction, times (1 - 1/ep), the share of copies
    that leave the rank (group limits do not change it: each expert stays equally likely). So
    `sent` = tokens * topk * hidden * bytes * 2 * (1 - 1/ep); ep = 1 moves nothing. With dedup a token
    crosses to each rank once: `expected_remote_ranks` copies instead of topk * (1 - 1/ep).
    """
    if dedup and n_experts is None:
        raise PlanError("the expected all-to-all with dedup needs n_experts.")
    copies = expected_remote_ranks(n_experts, topk, ep, n_group, topk_group) if dedup else topk * (ep - 1) / ep
    send = tokens * copies * hidden * bytes_per_elem
    return AllToAllBytes.of(send, send)


def alltoall_bytes(tokens: float, topk: int, hidden: int, ep: int, bytes_per_elem: int, routing=None,
                   n_experts: Optional[int] = None, rank: int = 0, dedup: bool = False, n_group: int = 1,
                   topk_group: int = 1) -> AllToAllBytes:
    """One entry point: `alltoall_bytes_exact` for a concrete `routing`, else `alltoall_bytes_expected`."""
    if routing is None:
        return alltoall_bytes_expected(tokens, topk, hidden, ep, bytes_per_elem, n_experts, dedup, n_group,
                                       topk_group)
    if n_experts is None:
        raise PlanError("an exact all-to-all count needs n_experts to place experts on ranks.")
    return alltoall_bytes_exact(routing, n_experts, ep, rank, hidden, bytes_per_elem, dedup)


# ----------------------------------------------------------------------------- other collectives

@dataclass(frozen=True)
class ZeroComm:
    """Bytes one rank sends per optimizer step for gradient reduction and ZeRO's parameter gathers."""

    all_reduce: float
    reduce_scatter: float
    all_gather: float
    total: float

    @classmethod
    def of(cls, all_reduce: float = 0.0, reduce_scatter: float = 0.0, all_gather: float = 0.0) -> "ZeroComm":
        return cls(all_reduce, reduce_scatter, all_gather, all_reduce + reduce_scatter + all_gather)


def zero_comm(n_params: float, group: int, zero: int, micro_batches: int, prec: Precision,
              stage1_all_reduce: bool = False) -> ZeroComm:
    """Data-parallel traffic for `n_params` parameters replicated over `group` ranks. What is counted:

    ZeRO-0: one all-reduce of the gradients per step (accumulated locally over the micro-batches).
    ZeRO-1: the gradients reduce-scattered once per step (each rank needs the sum for its optimizer
    shard only), then the updated parameters all-gathered: together the bytes of one all-reduce.
    With `stage1_all_reduce` (what DeepSpeed's stage 1 does, and so `make_plan`: it all-reduces the
    whole gradient buffer at the accumulation boundary, reduce-scattering only from stage 2 on) the
    gradients are all-reduced instead: 1.5x the bytes of the textbook ZeRO-1.
    ZeRO-2: the reduce-scatter runs every micro-batch (no full gradient buffer to accumulate into, as
    in DeepSpeed), then one all-gather. ZeRO-3: every micro-batch all-gathers the parameters for the
    forward and again for the backward and reduce-scatters the gradients (3x instead of 2x).
    """
    f = (group - 1) / group
    grads, params = n_params * prec.grad_bytes * f, n_params * prec.param_bytes * f
    if zero == 0:
        return ZeroComm.of(all_reduce=2 * grads)
    if zero == 1:
        if stage1_all_reduce:
            return ZeroComm.of(all_reduce=2 * grads, all_gather=params)
        return ZeroComm.of(reduce_scatter=grads, all_gather=params)
    if zero == 2:
        return ZeroComm.of(reduce_scatter=micro_batches * grads, all_gather=params)
    return ZeroComm.of(reduce_scatter=micro_batches * grads, all_gather=2 * micro_batches * params)


def _passes(recompute: str) -> int:
    """Forward-like passes per micro-batch: forward, backward, and the recomputed forward."""
    return 3 if recompute == "full" else 2


def pipeline_bytes(stage: int, pp: int, micro_batches: int, boundary_bytes: float) -> float:
    """Send/recv per step: each micro-batch's activations go to the next stage in the forward and
    their gradients to the previous stage in the backward (boundary_bytes each)."""
    sends = (stage < pp - 1) + (stage > 0)
    return micro_batches * sends * boundary_bytes


def tensor_parallel_bytes(blocks: int, micro_batches: int, tp: int, activation_bytes: float, recompute: str) -> float:
    """Per block and pass, 2 all-reduces of the [tokens, hidden] activation (activation_bytes), or with
    sequence parallelism 2 all-gathers + 2 reduce-scatters: the same 4 (tp-1)/tp * activation_bytes."""
    return blocks * micro_batches * _passes(recompute) * 4 * (tp - 1) / tp * activation_bytes


def tensor_parallel_extra_bytes(m: ModelConfig, stage: int, pp: int, n_blocks: int, micro_batches: int, tp: int,
                                 tokens: float, act_bytes: int, grad_bytes: int, sp: bool) -> float:
    """What tensor parallelism moves outside the blocks' 4 collectives per pass, per step: the
    vocabulary-parallel embedding (first stage: all-reduce forward, or reduce-scatter forward +
    all-gather backward with SP) and the head's input (last stage: all-reduce backward, or all-gather
    forward + reduce-scatter backward): 2 (tp-1)/tp x [tokens, hidden] each; the vocabulary-parallel
    loss (last stage: 3 all-reduces of an fp32 [tokens] vector: max, sum of exponentials, target
    logit); with SP the all-reduce of each replicated RMSNorm weight's partial grad (2 per block +
    the final norm); k/v projections replicated because kv heads < tp: their grads all-reduced in an
    (kv heads, ...) buffer. Every micro-batch."""
    if tp == 1:
        return 0.0
    f, h = 2 * (tp - 1) / tp, m.hidden_size
    ends = (stage == 0) + (stage == pp - 1)
    per_mb = ends * f * tokens * h * act_bytes
    if stage == pp - 1:
        per_mb += 3 * f * tokens * FP32
    if sp:
        per_mb += f * h * grad_bytes * (2 * n_blocks + (stage == pp - 1))
    kv = m.num_key_value_heads or m.num_attention_heads
    if m.arch == "llama3" and kv < tp:
        d = m.head_dim or h // m.num_attention_heads
        per_mb += n_blocks * 2 * f * kv * d * h * grad_bytes
    return micro_batches * per_mb


def context_parallel_bytes(blocks: int, micro_batches: int, cp: int, local_kv_bytes: float, recompute: str) -> float:
    """Per block: the forward all-gathers K and V from the cp ranks ((cp-1) * local_kv_bytes sent), the
    backward reduce-scatters their gradients (the same); a full recomputation gathers again."""
    return blocks * micro_batches * _passes(recompute) * (cp - 1) * local_kv_bytes


def _kv_bytes_per_token(m: ModelConfig, tp: int, b: int) -> float:
    """What context parallelism gathers per token: K and V of the rank's heads (GQA), or for MLA the
    compressed latent plus the shared RoPE key (kv_lora_rank + qk_rope_head_dim), up-projected locally."""
    if m.arch == "deepseek_v3":
        return (m.kv_lora_rank + m.qk_rope_head_dim) * b
    kv, d = m.num_key_value_heads or m.num_attention_heads, m.head_dim or m.hidden_size // m.num_attention_heads
    return 2 * max(kv / tp, 1) * d * b
