"""Fake CUDA on a CPU-only build: torch.cuda's host API shimmed, and a FakeTensorMode whose
`device="cuda:N"` tensors carry shapes, dtypes and devices but no data.

What is faked and why:
- torch.cuda's host-side API (availability, devices, streams, events, memory statistics, device
  properties, RNG seeding): DeepSpeed's CUDA accelerator and the trainer's StepClock call it.
  Memory statistics read the fake-CUDA bytes counted by `MemoryMeter`.
- Host reads of device values (`.item()`, `.tolist()`): a fake tensor has no value, so each
  read returns 0 of its dtype (losses are finite, flags are false) and is counted by call site;
  the expert-parallel split sizes, the one read whose value shapes what follows, come from
  runner.balanced_splits instead.
- Module.to / .float() ...: nn.Module._apply swaps fake parameters and fails ("Couldn't swap");
  `_apply_without_swap` keeps a parameter that the conversion leaves as it is.
- Initial weights: random init needs a CUDA generator; `materialize_without_init` gives every
  meta parameter an uninitialised fake tensor on the rank's device, in the engine's dtype.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections import Counter, namedtuple
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ...models.init import replace_param

# ----------------------------------------------------------------------------- torch.cuda's host API

_Props = namedtuple("_Props", "name total_memory major minor multi_processor_count")
FAKE_GPU_BYTES = 80 * 10**9  # the planner's default --gpu-memory-gb


class FakeStream:
    """A CUDA stream that orders nothing (fake tensors run no kernels)."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = device

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or FakeEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class FakeEvent:
    """A CUDA event: recorded and waited on instantly, 0 ms apart."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class CudaShim:
    """torch.cuda's host API for `gpus` fake devices; the current device is what set_device chose."""

    def __init__(self, gpus: int, meter: MemoryMeter):
        self.gpus, self.meter, self.current = gpus, meter, 0

    def set_device(self, device) -> None:
        index = device.index if isinstance(device, torch.device) else int(str(device).split(":")[-1])
        self.current = 0 if index is None else index

    def install(self) -> None:
        c = torch.cuda
        props = _Props("NVIDIA H100 80GB HBM3 (fake)", FAKE_GPU_BYTES, 9, 0, 132)
        stream = FakeStream()
        values: dict[str, Callable] = {
            "is_available": lambda: True, "device_count": lambda: self.gpus, "current_device": lambda: self.current,
            "set_device": self.set_device, "_lazy_init": lambda: None, "is_initialized": lambda: True,
            "synchronize": lambda device=None: None, "empty_cache": lambda: None,
            "current_stream": lambda device=None: stream, "default_stream": lambda device=None: stream,
            "stream": lambda s=None: contextlib.nullcontext(s), "is_current_stream_capturing": lambda: False,
            "get_device_properties": lambda device=None: props, "get_device_name": lambda device=None: props.name,
            "get_device_capability": lambda device=None: (props.major, props.minor),
            "is_bf16_supported": lambda including_emulation=True: True,
            "memory_allocated": lambda device=None: self.meter.live,
            "max_memory_allocated": lambda device=None: self.meter.peak,
            "memory_reserved": lambda device=None: self.meter.live,
            "max_memory_reserved": lambda device=None: self.meter.peak,
            "memory_cached": lambda device=None: self.meter.live,
            "max_memory_cached": lambda device=None: self.meter.peak,
            "reset_peak_memory_stats": lambda device=None: None, "reset_max_memory_allocated": lambda device=None: None,
            "reset_max_memory_cached": lambda device=None: None,
            "memory_stats": lambda device=None: {"allocated_bytes.all.current": self.meter.live,
                                                 "allocated_bytes.all.peak": self.meter.peak},
            "mem_get_info": lambda device=None: (FAKE_GPU_BYTES - self.meter.live, FAKE_GPU_BYTES),
            "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None, "seed": lambda: None,
            "seed_all": lambda: None, "initial_seed": lambda: 0,
            "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
            "set_rng_state": lambda state, device="cuda": None,
            "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8)] * self.gpus,
            "set_rng_state_all": lambda states: None, "_lazy_call": lambda fn, **kw: None,
            "Stream": FakeStream, "Event": FakeEvent, "default_generators": (),
        }
        for name, value in values.items():
            setattr(c, name, value)
        c.nccl.version = lambda: (2, 21, 5)
        for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):  # DeepSpeed's profiling ranges
            setattr(c.nvtx, name, lambda *args, **kwargs: 0)


# ----------------------------------------------------------------------------- memory of fake CUDA tensors

class MemoryMeter:
    """Live and peak bytes of fake CUDA storages: a storage counts from its first fake tensor's
    creation until its last fake tensor dies or moves to another storage (views share their base's
    storage; `param.data = other` moves a tensor, as DeepSpeed's flattening of the weights does, and
    frees the old storage on a GPU once nothing else holds it).

    An op that fake mode runs as a decomposition (several inner ops) counts at its end, outputs
    only: a GPU runs it as one kernel, which makes no such temporaries (cross-entropy's log-softmax
    backward, for one, would otherwise peak at three vocabulary-wide fp32 tensors instead of one)."""

    def __init__(self):
        self.total = self.top = self.base = 0  # every simulated rank's bytes, kept alive until the reloads
        self.depth = 0  # ops of the fake mode being dispatched, nested (op_enter / op_exit)
        self._refs: Counter = Counter()
        self._bytes: dict[int, int] = {}
        self._key_of: dict[int, int] = {}  # id of a live tracked tensor -> its storage's key

    def reset(self) -> None:
        """Count from here: the bytes live now belong to ranks simulated earlier."""
        self.base = self.top = self.total

    @property
    def live(self) -> int:
        return self.total - self.base

    @property
    def peak(self) -> int:
        return self.top - self.base

    def _hold(self, storage) -> int:
        key = storage._cdata
        if key not in self._bytes:
            self._bytes[key] = storage.nbytes()
            self.total += self._bytes[key]
            if self.depth <= 1 and self.total > self.top:
                self._raise_top()
        self._refs[key] += 1
        return key

    def _raise_top(self) -> None:
        self.top = self.total

    def op_enter(self) -> None:
        self.depth += 1

    def op_exit(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self.total > self.top:
            self._raise_top()

    def track(self, t: FakeTensor) -> None:
        if t.fake_device.type != "cuda":
            return
        self._key_of[id(t)] = self._hold(t.untyped_storage())
        weakref.finalize(t, self._forget, id(t))

    def moved(self, t: torch.Tensor) -> None:
        """`t` now uses another storage (its .data was set): count that one, release the old."""
        old = self._key_of.get(id(t))
        if old is None or t.untyped_storage()._cdata == old:
            return
        self._key_of[id(t)] = self._hold(t.untyped_storage())
        self._release(old)

    def _forget(self, tensor_id: int) -> None:
        key = self._key_of.pop(tensor_id, None)
        if key is not None:
            self._release(key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.total -= self._bytes.pop(key)


_METER: list = []  # the one MemoryMeter FakeTensor.__new__ reports to (install_meter)


def install_meter(meter: MemoryMeter) -> None:
    """Count every fake tensor created from now on in `meter`, and follow `tensor.data = other`."""
    if not _METER:
        base = FakeTensor.__new__

        def new(cls, *args, **kwargs):
            t = base(cls, *args, **kwargs)
            if _METER:
                _METER[0].track(t)
            return t
        FakeTensor.__new__ = staticmethod(new)
        data = torch._C.TensorBase.data

        def set_data(self, value):
            data.__set__(self, value)
            if _METER:
                _METER[0].moved(self)
        torch.Tensor.data = property(data.__get__, set_data)
        _METER.append(meter)
    _METER[0] = meter


# ----------------------------------------------------------------------------- attention as a GPU runs it

@contextlib.contextmanager
def fused_attention():
    """F.scaled_dot_product_attention on fake CUDA tensors as the memory-efficient kernel a GPU picks
    for these shapes (two head sizes for MLA included): its output and log-sum-exp are all it keeps,
    where torch without CUDA would choose the math path and materialise (B, H, T, S) scores. Calls
    with a mask stay as they are (on CUDA the document mask runs as FlexAttention instead)."""
    import torch.nn.functional as F
    base = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or not isinstance(q, FakeTensor) or q.fake_device.type != "cuda":
            return base(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        if enable_gqa and k.shape[1] != q.shape[1]:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, q.requires_grad or k.requires_grad or v.requires_grad, dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = base


class _FusedRmsNorm(torch.autograd.Function):
    """F.rms_norm as CUDA builds run it (aten._fused_rms_norm): it keeps the input, the weight and
    the fp32 reciprocal RMS per row for its backward. A CPU-only build has no such kernel for fake
    CUDA tensors and runs the composite above autograd, which keeps the input upcast to fp32 and the
    fp32 normalised rows: 8 bytes per element more than a GPU."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps, base):
        y = base(x, shape, weight, eps)  # the composite's temporaries die here, as inside the kernel
        rstd = x.new_empty(tuple(x.shape[:x.dim() - len(shape)]) + (1,) * len(shape), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dw = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[2] else None
        return torch.empty_like(x), None, dw, None, None


@contextlib.contextmanager
def fused_rms_norm():
    """F.rms_norm on fake CUDA tensors keeps what the fused CUDA kernel keeps (_FusedRmsNorm)."""
    import torch.nn.functional as F
    base = F.rms_norm

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if not isinstance(x, FakeTensor) or x.fake_device.type != "cuda" or not torch.is_grad_enabled():
            return base(x, normalized_shape, weight, eps)
        return _FusedRmsNorm.apply(x, tuple(normalized_shape), weight, eps, base)

    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = base


# ----------------------------------------------------------------------------- the fake mode

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_PIN = (torch.ops.aten._pin_memory.default, torch.ops.aten.is_pinned.default)


def call_site(skip: tuple = ("/parallel/dryrun/",)) -> str:
    """file:line of the innermost moe_trainer frame on the stack (outside this package), else the
    innermost frame outside torch."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        where = f"{path.split('/moe_trainer/', 1)[-1] if '/moe_trainer/' in path else path}:{frame.f_lineno}"
        if "/moe_trainer/" in path and not any(s in path for s in skip) and "/tests/" not in path:
            return "moe_trainer/" + where if not where.startswith("moe_trainer/") else where
        if fallback is None and "/torch/" not in path and not any(s in path for s in skip):
            fallback = where
        frame = frame.f_back
    return fallback or "?"


class FakeCudaMode(FakeTensorMode):
    """FakeTensorMode (device checks, shapes, _grouped_mm's alignment checks) where a host read
    of a value returns 0 of its dtype and is counted per call site (`host_reads`), and pinning
    host memory is a no-op. Real CPU tensors (the data's token ids) become fake on first use."""

    def __init__(self, on_functional_collective: Callable | None = None):
        super().__init__(allow_non_fake_inputs=True)
        self.host_reads: Counter = Counter()
        # functional collectives (the compiled path's) never reach torch.distributed's functions: their
        # ops run as meta kernels here, so the rules see them through this hook (func, args, kwargs)
        self.on_functional_collective = on_functional_collective

    # torch.tensor(data, device="cuda") builds on the host and lifts to a fake CUDA tensor (the mode
    # does so itself only when torch.cuda is unavailable, which the shim makes it not)
    avoid_device_init = True

    def dispatch(self, func, types, args=(), kwargs=None):
        if func is _LOCAL_SCALAR:
            self.host_reads[call_site()] += 1
            dtype = args[0].dtype
            return False if dtype == torch.bool else (0.0 if dtype.is_floating_point else 0)
        if func in _PIN:
            return args[0] if func is _PIN[0] else False
        if self.on_functional_collective is not None and getattr(func, "namespace", "") == "_c10d_functional":
            self.on_functional_collective(func, args, kwargs)
        meter = _METER[0] if _METER else None
        if meter is None:
            return super().dispatch(func, types, args, kwargs)
        meter.op_enter()  # a decomposition's inner ops come back through here, nested (MemoryMeter)
        try:
            return super().dispatch(func, types, args, kwargs)
        finally:
            meter.op_exit()


def quiet_fake_tensor_logs() -> None:
    """A failing meta kernel is the dry run's finding, reported as one sentence: no traceback dump."""
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


# ----------------------------------------------------------------------------- modules on fake CUDA

def _apply_without_swap(self: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """nn.Module._apply for fake parameters: a parameter (or gradient) the conversion returns
    unchanged is kept; one it changes takes the new tensor's data in place, so optimizer groups
    that hold the parameter still see it. Buffers are replaced."""
    for module in (self.modules() if recurse else [self]):
        with torch.no_grad():
            for p in module._parameters.values():
                if p is None:
                    continue
                new = fn(p)
                if new is not p:
                    _set_fake_data(p, new)
                if p.grad is not None and fn(p.grad) is not p.grad:
                    p.grad = fn(p.grad)
            for k, b in module._buffers.items():
                if b is not None:
                    module._buffers[k] = fn(b)
    return self


def _set_fake_data(p: torch.Tensor, new: torch.Tensor) -> None:
    """p.data = new for fake tensors: set_data keeps the old fake device, so it is set too."""
    p.data = new
    if isinstance(p, FakeTensor) and isinstance(new, FakeTensor):
        p.fake_device = new.fake_device


@contextlib.contextmanager
def fake_module_conversion():
    """Module.to(...) and the dtype casts leave fake parameters that already fit where they are."""
    base = nn.Module._apply
    nn.Module._apply = _apply_without_swap
    try:
        yield
    finally:
        nn.Module._apply = base


def materialize_without_init(device: torch.device, dtype: torch.dtype | None):
    """A stand-in for models.init.materialize: every meta parameter becomes an uninitialised fake
    tensor on `device` (in `dtype` when it is floating point: the engine's dtype, so its cast is a
    no-op), every meta buffer zeros there; host buffers (rotary tables) move there."""
    @torch.no_grad()
    def materialize(root: nn.Module, seed: int, std: float) -> nn.Module:
        for p in list(root.parameters()):
            if p.device.type == "meta":
                kind = dtype if (dtype is not None and p.dtype.is_floating_point) else p.dtype
                replace_param(root, p, torch.empty(p.shape, dtype=kind, device=device))
        for module in root.modules():
            for k, b in module._buffers.items():
                if b is not None and b.device != device:
                    module._buffers[k] = torch.zeros(b.shape, dtype=b.dtype, device=device)
        return root
    return materialize
