"""Initial weights as a function of (seed, global parameter name, expert index) only.

A model is built on the meta device (no memory); parallelism then slices the meta
parameters (experts over ep, Megatron shards over tp, layers over pipeline
stages) and records on each kept parameter which part of the global tensor it is
(`p.shard_of = (global_shape, offsets)`). `materialize` finally gives the kept
parameters their values, computing only the rows they hold:

- vectors: ones for norms, zeros otherwise (Hugging Face's initialisation);
- matrices: Normal(0, initializer_range), generated in row blocks of at most
  BLOCK_ELEMS elements, each block from its own generator keyed by
  (seed, name, block index); a TP shard generates the blocks its rows touch and
  narrows them, so its cost is bounded by one parameter, never the model;
- stacked routed experts (E, ...): one block per expert, keyed by the global
  expert id, so an EP rank generates its own experts only.
Every layout therefore starts from exactly the single-process weights.
"""
from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence

import torch
from torch import nn

BLOCK_ELEMS = 1 << 22  # 16 MB of fp32 per generated block


def _generator(seed: int, name: str, block: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def is_expert_param(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def rows_per_block(name: str, shape: Sequence[int]) -> int:
    if is_expert_param(name):
        return 1
    return max(1, BLOCK_ELEMS // max(1, math.prod(shape[1:])))


def init_values(name: str, shape: Sequence[int], offsets: Optional[Sequence[int]] = None,
                local_shape: Optional[Sequence[int]] = None, std: float = 0.02, seed: int = 0) -> torch.Tensor:
    """The box [offsets, offsets + local_shape) of global parameter `name` (shape `shape`), fp32."""
    shape = tuple(shape)
    offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
    local = tuple(local_shape) if local_shape is not None else shape
    if len(shape) <= 1:
        return torch.ones(local) if "norm" in name else torch.zeros(local)
    out = torch.empty(local)
    per = rows_per_block(name, shape)
    r0, n = offsets[0], local[0]
    for b in range(r0 // per, (r0 + n - 1) // per + 1):
        lo, hi = b * per, min((b + 1) * per, shape[0])
        block = torch.empty((hi - lo,) + shape[1:]).normal_(0.0, std, generator=_generator(seed, name, b))
        s, e = max(lo, r0), min(hi, r0 + n)
        piece = block[s - lo:e - lo]
        for d in range(1, len(shape)):
            piece = piece.narrow(d, offsets[d], local[d])
        out[s - r0:e - r0] = piece
    return out


def global_view(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, offsets of this tensor's box in it): `p.shard_of` if sharding set it, else all of p."""
    view = getattr(p, "shard_of", None)
    return view if view is not None else (tuple(p.shape), (0,) * p.dim())


def mark_shard(p: torch.Tensor, parent: tuple, offsets: Sequence[int]) -> None:
    """Record that p is the box at `offsets` inside `parent` (the global_view of the tensor it was cut from)."""
    shape, base = parent
    p.shard_of = (tuple(shape), tuple(a + b for a, b in zip(base, offsets)))


def replace_param(root: nn.Module, old: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    """Swap `old` for a Parameter holding `value` in every module of root that holds it (tied
    weights stay tied), keeping its attributes (sharding marks) and its gradient hooks."""
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    for k, v in old.__dict__.items():
        if k != "_backward_hooks":
            setattr(new, k, v)
    for hook in (getattr(old, "_backward_hooks", None) or {}).values():
        new.register_hook(hook)
    for module in root.modules():
        for k, p in module._parameters.items():
            if p is old:
                module._parameters[k] = new
    return new


@torch.no_grad()
def materialize(root: nn.Module, seed: int, std: float) -> nn.Module:
    """Give every meta parameter of root its initial values (this rank's box only) and every meta
    buffer zeros (the buffers built on the meta device are counters and balancing biases, which
    start at zero; the rotary tables are built on the host)."""
    for name, p in list(root.named_parameters()):
        if p.device.type == "meta":
            shape, offsets = global_view(p)
            replace_param(root, p, init_values(name, shape, offsets, p.shape, std, seed).to(p.dtype))
    for module in root.modules():
        for k, b in module._buffers.items():
            if b is not None and b.device.type == "meta":
                module._buffers[k] = torch.zeros(b.shape, dtype=b.dtype)
    return root


@torch.no_grad()
def init_in_place(root: nn.Module, seed: int, std: float) -> None:
    """The same values written into a model whose parameters already have storage."""
    for name, p in root.named_parameters():
        if p.device.type != "meta":
            shape, offsets = global_view(p)
            p.copy_(init_values(name, shape, offsets, p.shape, std, seed))
