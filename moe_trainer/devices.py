"""Datasheet peaks of the GPUs users train on, for MFU (dense math, no sparsity).

MFU compares achieved model FLOP/s with what the chip can do: on a GPU that is its datasheet
figure (bf16 tensor cores; TF32 tensor cores for fp32 models, which is what torch runs with
TF32 on), not a measurement, so runs on different machines and days compare. Unknown chips
return None and the caller measures. `python -m moe_trainer.devices` prints what it finds.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

# name fragment (as torch.cuda.get_device_name reports it) -> (bf16 dense TFLOP/s, TF32 dense TFLOP/s);
# the first matching fragment wins, so the more specific ones come first
DATASHEET_TFLOPS = (
    ("GB200", 2500.0, 1250.0),
    ("B200", 2250.0, 1100.0),
    ("H200", 989.4, 494.7),
    ("H100 PCIe", 756.0, 378.0),
    ("H100", 989.4, 494.7),  # SXM
    ("H800", 989.4, 494.7),
    ("A100", 312.0, 156.0),
    ("A800", 312.0, 156.0),
    ("L40S", 362.1, 183.0),
)


def datasheet_tflops(name: str, dtype: torch.dtype) -> Optional[float]:
    """The dense peak of the GPU called `name` for `dtype` (bf16/fp16 tensor cores, or TF32 for fp32)."""
    for fragment, half, tf32 in DATASHEET_TFLOPS:
        if fragment in name:
            return tf32 if dtype == torch.float32 else half
    return None


def gpu_peak_tflops(dtype: torch.dtype, index: int = 0) -> Optional[tuple[float, str]]:
    """(peak TFLOP/s, "datasheet <name>") of CUDA device `index`, or None without CUDA or for an unknown GPU."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(index)
    peak = datasheet_tflops(name, dtype)
    return None if peak is None else (peak, f"datasheet {name}")


if __name__ == "__main__":
    dtype = torch.float32 if sys.argv[1:2] == ["fp32"] else torch.bfloat16
    found = gpu_peak_tflops(dtype)
    if found is None:
        print("no CUDA GPU with a known datasheet peak", file=sys.stderr)
        sys.exit(1)
    print(f"{found[0]:g}")
