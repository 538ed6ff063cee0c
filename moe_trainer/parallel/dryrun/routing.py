"""The EP dispatcher's split sizes under the dry run: fake tensors carry no routing, so the one host
read of an expert-parallel MoE layer (AllToAllDispatcher._splits) gets sizes drawn here instead.

- `skewed` (the default): a seeded, skewed routing. Each MoE layer (its dispatcher, numbered in the
  order a rank builds them, the same on every rank of an EP group) draws expert popularities from a
  log-normal (sigma 1.5: a few hot experts carry most tokens) and gives every expert of one EP rank
  popularity 0, so that rank receives nothing: zero splits. Each source EP rank then routes a sample
  of its tokens to k distinct destinations by those popularities, scaled to its n tokens. The sizes
  are a function of (seed, layer, n, k) only: every rank of the group derives the same (ep, ep)
  matrix, rank s sends row s and receives column s, and a recomputed forward (activation
  checkpointing) gets the sizes of the first. The router's own bias cannot steer this: its values
  do not exist on fake tensors.
- `balanced`: the expectation of a balanced routing (n k / ep copies to each rank; with dedup
  n x plan.expected_remote_ranks / ep rows), what the planner assumes.
"""
from __future__ import annotations

import contextlib
import zlib

import torch

ROUTINGS = ("skewed", "balanced")
SAMPLE_TOKENS = 256  # tokens routed per source rank; counts are scaled from them to n
SKEW_SIGMA = 1.5


def balanced_splits(dispatcher, n_tokens: int, k: int, count: int) -> list[list[int]]:
    """The split sizes a balanced routing gives, in the form AllToAllDispatcher._splits returns.
    Plain dispatch (2 vectors): n * k copies sent, spread evenly over the ep ranks, and as many
    received. Dedup (3 vectors): token rows sent per rank = n * (expected ranks a token reaches) /
    ep (plan.expected_remote_ranks), received alike, and n * k / ep (row, expert) pairs received."""
    ep = dispatcher.ep

    def even(total: int) -> list[int]:
        return [total // ep + (1 if i < total % ep else 0) for i in range(ep)]

    copies = even(n_tokens * k)
    if count == 2:
        return [copies, copies]
    from ...plan import expected_remote_ranks
    m = dispatcher.model_cfg
    hits = expected_remote_ranks(m.n_routed_experts, k, ep, m.n_group, m.topk_group)
    rows = even(min(n_tokens * ep, round(n_tokens * hits)))
    return [rows, rows, [max(a, b) for a, b in zip(copies, rows)]]


def _scale(counts: list[int], total: int) -> list[int]:
    """Non-negative integers proportional to `counts` that sum to `total` (largest remainder)."""
    whole = sum(counts)
    if whole == 0:
        return [0] * len(counts)
    exact = [c * total / whole for c in counts]
    out = [int(x) for x in exact]
    for i in sorted(range(len(counts)), key=lambda i: out[i] - exact[i])[:total - sum(out)]:
        out[i] += 1
    return out


def skewed_matrix(seed: int, layer: int, n: int, k: int, ep: int, n_local: int) -> tuple[list, list]:
    """(copies, rows): [s][d] the routed copies and the distinct tokens (rows) source EP rank s sends
    to rank d, for n tokens of top-k routing over ep * n_local destinations. Pure and seeded."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{layer}".encode()))
    dests = ep * n_local
    weight = torch.exp(SKEW_SIGMA * torch.randn(dests, generator=gen, dtype=torch.float64))
    cold = int(torch.randint(ep, (1,), generator=gen))
    if (ep - 1) * n_local > k:  # one rank gets nothing (when the others still leave the routing a choice)
        weight[cold * n_local:(cold + 1) * n_local] = 0
    m = min(n, SAMPLE_TOKENS)
    copies, rows = [], []
    for _ in range(ep):
        if m == 0:
            copies.append([0] * ep)
            rows.append([0] * ep)
            continue
        chosen = torch.multinomial(weight.expand(m, dests), k, replacement=False, generator=gen) // n_local
        hits = torch.zeros(m, ep, dtype=torch.int64).scatter_add_(1, chosen, torch.ones_like(chosen))
        c = _scale(hits.sum(0).tolist(), n * k)
        per_row = min(k, n_local)  # the most copies one token sends to one rank
        copies.append(c)
        rows.append([min(n, ci, max(-(-ci // per_row), round(h * n / m)))
                     for h, ci in zip((hits > 0).sum(0).tolist(), c)])
    return copies, rows


def skewed_splits(dispatcher, n_tokens: int, k: int, count: int, seed: int, cache: dict) -> list[list[int]]:
    """This EP rank's split sizes from skewed_matrix, in the form AllToAllDispatcher._splits returns."""
    import torch.distributed as dist
    key = (dispatcher._dry_run_layer, n_tokens, k)
    if key not in cache:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():  # real host tensors: the draw has values
            cache[key] = skewed_matrix(seed, dispatcher._dry_run_layer, n_tokens, k, dispatcher.ep,
                                       dispatcher.n_local)
    copies, rows = cache[key]
    me = dist.get_rank(dispatcher.group)
    column = list(range(dispatcher.ep))
    if count == 2:  # plain: copies sent to each rank, copies received from each rank
        return [copies[me], [copies[s][me] for s in column]]
    return [rows[me], [rows[s][me] for s in column], [copies[s][me] for s in column]]


def owned_splits(dispatcher, received: list[int]) -> list[int]:
    """With redundant slots (slot-owned experts with copies, AllToAllDispatcher._owned_of): of the rows (the
    (row, expert) pairs with dedup) received from each rank, those for this rank's S0 owned slots, the
    owned slots' share S0 / (S0 + r) of them, rounded down (the copies take the rest)."""
    s0, s = dispatcher.experts.n_local, dispatcher.n_local
    return [c * s0 // s for c in received]


@contextlib.contextmanager
def routed_dispatch(model_cfg, routing: str, seed: int, stats: dict):
    """AllToAllDispatcher's split-size read returns the sizes `routing` draws for the tokens in hand.
    stats: "splits" (sizes drawn) and "zero" (of them zero), added to as the rank runs."""
    from .. import expert
    cls = expert.AllToAllDispatcher
    base_init, base_dispatch, base_splits = cls.__init__, cls.dispatch_out, cls._splits
    current: list = []
    built = [0]
    cache: dict = {}

    def init(self, *args, **kwargs):
        base_init(self, *args, **kwargs)
        self._dry_run_layer, built[0] = built[0], built[0] + 1  # the same order on every rank of a stage

    def dispatch_out(self, x, topk_idx, topk_weight):  # the blocking dispatch and the overlapped one call it
        self.model_cfg = model_cfg
        current.append((self, *topk_idx.shape))
        try:
            return base_dispatch(self, x, topk_idx, topk_weight)
        finally:
            current.pop()

    def splits(*per_rank):
        me, n, k = current[-1]
        count = 3 if me.dedup else 2  # (a dispatcher holding copies asks for one vector more: owned_splits)
        out = (balanced_splits(me, n, k, count) if routing == "balanced"
               else skewed_splits(me, n, k, count, seed, cache))
        if me._holds_copies():
            out.append(owned_splits(me, out[-1]))
        sizes = [x for v in out[:2] for x in v]
        stats["splits"] = stats.get("splits", 0) + len(sizes)
        stats["zero"] = stats.get("zero", 0) + sum(1 for x in sizes if x == 0)
        return out

    cls.__init__, cls.dispatch_out, cls._splits = init, dispatch_out, staticmethod(splits)
    try:
        yield
    finally:
        cls.__init__, cls.dispatch_out, cls._splits = base_init, base_dispatch, base_splits


@contextlib.contextmanager
def drawn_replacement(seed: int):
    """The online re-placement's host reads (parallel/slots.py Replacer) under fake tensors: the interval's
    expert load is a seeded log-normal draw per MoE layer (the same on every rank, as rank 0 would
    broadcast it), rank 0's decision is made on real host tensors from it, and every rank reads that
    decision (made again from the same draw), so the moves it makes are the ones its EP group makes."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from ...moe.placement import online
    from .. import slots
    cls = slots.Replacer
    base_load, base_decide, base_rows = cls._host_load, cls._decide, cls._rows_from

    def host_load(self):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:replace".encode()))
        load = 1000 * torch.exp(SKEW_SIGMA * torch.randn(self.n_layers, self.n_experts, generator=gen,
                                                         dtype=torch.float64))
        rows = torch.stack([online.rank_loads(load[i], self.slots.rows[i], self.ep) for i in range(self.n_layers)])
        return load, rows

    def decide(self):
        with unset_fake_temporarily():
            return base_decide(self)

    cls._host_load, cls._decide = host_load, decide
    cls._rows_from = lambda self, buf: self._decide()[0]
    try:
        yield
    finally:
        cls._host_load, cls._decide, cls._rows_from = base_load, base_decide, base_rows
