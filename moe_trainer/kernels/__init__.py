"""Kernel back ends, chosen once per process: the device boundary.

- `accelerator` (kernels/accelerator.py): the device-generic path that GPUs run: grouped GEMMs
  over all experts, SDPA / flash attention, fused RMSNorm, no host syncs.
- `cpu` (kernels/cpu/): the CPU back end: C++ kernels, oneDNN, shared-memory rings, allocator
  settings. It hands any tensor that is not on a CPU to the accelerator path.
- `reference` (kernels/reference.py): plain torch ops, one expert at a time: what the tests hold
  the fast paths against.

MOE_TRAINER_KERNELS=auto|cpu|accelerator|reference picks one (auto: cpu on CPU ranks, accelerator
elsewhere); `accelerator` on a CPU runs the GPU path here, so the tests prove it against the
reference on machines without one. The trainer calls `select(device)` before it builds the model;
modules take `backend()` when they are built and keep it (no switch in forward).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Protocol

import torch

MODES = ("auto", "cpu", "accelerator", "reference")
ENV = "MOE_TRAINER_KERNELS"


class Backend(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor: ...

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor: ...

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor: ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor: ...

    def chunked_causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                 q_chunks: tuple[int, ...]) -> torch.Tensor: ...

    def document_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           q_docs: torch.Tensor, k_docs: torch.Tensor,
                           q_chunks: Optional[tuple[int, ...]] = None) -> torch.Tensor: ...

    def experts(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gate: Optional[torch.Tensor],
                counts: torch.Tensor) -> torch.Tensor: ...

    def sort_by_key(self, keys: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def topk(self, scores: torch.Tensor, k: int) -> torch.Tensor: ...


class KernelConfigError(ValueError):
    """MOE_TRAINER_KERNELS names no back end: one sentence."""


_SELECTED: dict[str, Backend] = {}


def _make(name: str) -> Backend:
    if name == "cpu":
        from .cpu import CPUBackend
        return CPUBackend()
    if name == "reference":
        from .reference import ReferenceBackend
        return ReferenceBackend()
    from .accelerator import AcceleratorBackend
    return AcceleratorBackend()


def resolve(mode: str, device_type: str) -> str:
    """The back end `mode` means on a `device_type` device (pure)."""
    if mode not in MODES:
        raise KernelConfigError(f"{ENV}={mode!r} is not a kernel back end; use one of {', '.join(MODES)}.")
    if mode == "auto":
        return "cpu" if device_type == "cpu" else "accelerator"
    return mode


def select(device: Optional[torch.device] = None) -> Backend:
    """Choose this process's back end from MOE_TRAINER_KERNELS for the device it trains on
    (default: CUDA if present, else CPU). The choice holds until `select` is called again."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = resolve(os.environ.get(ENV, "auto").strip().lower() or "auto", torch.device(device).type)
    if name == "accelerator" and not hasattr(torch, "_grouped_mm"):
        raise KernelConfigError(f"the accelerator kernels need torch._grouped_mm (torch >= 2.9); this is torch "
                                f"{torch.__version__}.")
    _SELECTED["backend"] = _make(name)
    return _SELECTED["backend"]


def backend() -> Backend:
    """The selected back end (selected from the environment on first use)."""
    return _SELECTED.get("backend") or select()


@contextlib.contextmanager
def using(name: str) -> Iterator[Backend]:
    """Build modules with back end `name` inside the block (tests: one model per back end)."""
    previous = _SELECTED.get("backend")
    _SELECTED["backend"] = _make(resolve(name, "cpu"))
    try:
        yield _SELECTED["backend"]
    finally:
        if previous is None:
            _SELECTED.pop("backend", None)
        else:
            _SELECTED["backend"] = previous
