"""The fused CPU kernels (csrc/cpu_kernels.cpp), built on first use and cached.

- SwiGLU: the routed experts (experts.py) and every dense SwiGLU (layers.py: Llama's and
  DeepSeek's dense FFNs, the shared experts).
- Causal softmax and fp32 causal attention: the explicit CPU attention (layers.py).
- RMSNorm: every norm of both models (layers.py).
- Routing: a row-wise top-k and a stable counting sort of expert ids (the back end's topk and
  sort_by_key, __init__.py).
- The shared-memory all-to-all (shm_alltoall.py).
The float kernels run when their tensors are on a CPU in fp32 or bf16.

Like DeepSpeed's CPU ops, it is compiled once per machine (~20 s, g++ and ninja via
torch.utils.cpp_extension) into MOE_TRAINER_KERNEL_DIR (default
~/.cache/moe_trainer/kernels), in a directory named by the source (its text and path), torch version and
CPU so that an edit, an upgrade or another machine type builds its own copy; later
processes load it in milliseconds. `python -m moe_trainer.kernels.cpu.extension` builds it
ahead of a job. MOE_TRAINER_CPU_KERNELS=0 turns it off; if the build fails, the
torch-op paths run instead, after one warning.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.cpp"
_CACHE: dict[str, Any] = {}


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def build_dir() -> Path:
    # the source's path too: torch's JIT build records it, so two checkouts sharing one directory
    # would rebuild it for each other in turn
    key = hashlib.sha256(SOURCE.read_bytes() + str(SOURCE).encode() + torch.__version__.encode()
                         + _cpu_signature().encode()).hexdigest()
    root = os.environ.get("MOE_TRAINER_KERNEL_DIR") or Path.home() / ".cache" / "moe_trainer" / "kernels"
    return Path(root) / f"cpu_kernels_{key[:16]}"


def enabled() -> bool:
    return os.environ.get("MOE_TRAINER_CPU_KERNELS", "1") != "0" and sys.platform.startswith("linux")


def kernels() -> Optional[Any]:
    """The extension module (swiglu_forward/backward for [g | u] rows, silu_mul_forward/backward for
    separate g and u, causal_softmax_forward_/backward_, rms_norm_forward/backward, topk_rows,
    counting_sort), or None when turned off or unbuildable."""
    if "ops" in _CACHE:
        return _CACHE["ops"]
    ops = None
    if enabled():
        try:
            ops = _load_serialised(build_dir())
        except Exception as e:  # no compiler, no ninja, an unknown -march: the torch-op path still works
            warnings.warn(f"the fused CPU kernels could not be built ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); using torch ops.", stacklevel=2)
            ops = None
    _CACHE["ops"] = ops
    return ops


def _load_serialised(d: Path) -> Any:
    """torch.utils.cpp_extension.load under an flock on the build directory.

    torch's own guard is a lock *file* (FileBaton) that a builder killed mid-build (a rank of a
    job torn down by the launcher) leaves behind, and every later process then waits on it
    forever. An flock is dropped by the kernel when its holder dies, so holding one around the
    load, only one process builds at a time and a baton found under it is a dead builder's."""
    import fcntl

    from torch.utils.cpp_extension import load
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released on close, or by the kernel if this process dies
        (d / "lock").unlink(missing_ok=True)  # torch's baton: a dead builder's, since we hold the flock
        return load(name="moe_trainer_cpu_kernels", sources=[str(SOURCE)], build_directory=str(d),
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def onednn_linear_enabled() -> bool:
    """Whether fp32 projections on a CPU go through oneDNN's matmul (torch's own
    mkldnn::_linear_pointwise, registered when torch is built with oneDNN) instead of at::mm,
    which torch sends to MKL's sgemm for fp32. On this machine's AMD Zen 4 cores oneDNN's
    AVX-512 kernels ran 10-40% faster on the model's projection and expert shapes, one thread
    or two (docs/BENCHMARKS_train.md's notes). bf16 GEMMs already go to oneDNN.
    MOE_TRAINER_ONEDNN=0 turns it off."""
    if "onednn" not in _CACHE:
        _CACHE["onednn"] = (os.environ.get("MOE_TRAINER_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
                            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    return _CACHE["onednn"]


# Below this many multiply-adds (rows x in x out) an fp32 GEMM stays on sgemm: oneDNN's call costs
# ~10-20 us more (it builds an operation descriptor every call), which a GEMM this small does not
# win back (1 thread: 16 x 256 x 256 took 30 us on sgemm, 51 us on oneDNN; 128 x 256 x 256 about
# even; 512 x 256 x 256 and up ~10% faster on oneDNN).
ONEDNN_MIN_MACS = 1 << 24


def onednn_min_macs() -> int:
    """The GEMM size from which the fp32 kernels use oneDNN (ONEDNN_MIN_MACS), or -1 when it is off."""
    return ONEDNN_MIN_MACS if onednn_linear_enabled() else -1


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by oneDNN for a 2-D x; weight (out, in) of any strides."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], None)


def ops_for(*tensors: torch.Tensor) -> Optional[Any]:
    """kernels() when the kernels take these tensors (contiguous CPU tensors, all float32 or all
    bfloat16), else None: the caller runs torch ops."""
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.bfloat16) or any(
            t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() for t in tensors):
        return None
    return kernels()


def ops_on_cpu(*tensors: torch.Tensor) -> Optional[Any]:
    """kernels() when every tensor is a contiguous CPU tensor (the caller checks dtypes), else None."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    return kernels()


if __name__ == "__main__":
    ops = kernels()
    print(f"fused CPU kernels: {'ready in ' + str(build_dir()) if ops is not None else 'not available'}")
    sys.exit(0 if ops is not None or not enabled() else 1)
