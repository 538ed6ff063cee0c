"""Writing and reading safetensors files one tensor at a time.

safetensors' own `save_file` first turns every tensor into a bytes object and then writes them,
so a rank writing its checkpoint part briefly holds the part twice (three times counting the host
copies made for it). `write_safetensors` writes the same format (the header names each tensor's
dtype, shape and byte range; files are read back with safetensors' `safe_open`, which checks all
of it) from the tensors where they are: each is copied to the host only if it lives elsewhere, written,
and dropped before the next, and the file's sha256 is computed from the same buffers on the way.
A tensor may also be deferred: anything with `shape`, `dtype` and `read()` (export.Entry), read
only when its turn comes, so that a file of deferred tensors never holds more than one in memory.
`TensorFile` reads such files (checkpoint parts) tensor by tensor without a memory map.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

# torch dtype -> the safetensors header's name for it
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _size(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def header_bytes(tensors: Mapping[str, Any], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to a multiple of 8 as safetensors
    pads it; tensors lie in the data section in `tensors`' order, back to back."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"tensor {name} has dtype {t.dtype}, which safetensors cannot store.")
        size = _size(t.shape, t.dtype)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: Path | str, tensors: Mapping[str, Any],
                      metadata: Optional[Mapping[str, str]] = None) -> str:
    """Write `tensors` (on any device, views are fine; or deferred) to `path` as a safetensors file,
    fsynced. Returns its sha256."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        head = header_bytes(tensors, metadata)
        f.write(head)
        digest.update(head)
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):  # deferred: read now, in the dtype its header entry gives
                spec, t = t, t.read().to(t.dtype)
                if tuple(t.shape) != tuple(spec.shape):
                    raise ValueError(f"tensor {name} was read with shape {tuple(t.shape)}, not {tuple(spec.shape)}.")
            host = t.detach().to("cpu").contiguous().reshape(-1)
            if host.numel():
                data = memoryview(host.view(torch.uint8).numpy())
                f.write(data)
                digest.update(data)
            del host, t
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest()


NAMES = {name: dtype for dtype, name in DTYPES.items()}


class TensorFile:
    """The tensors of a safetensors file, read by byte range with ordinary reads into fresh tensors.

    safetensors' `safe_open` maps the file, and every page a read touches stays in the process's
    resident memory until the handle closes: a rank restoring its checkpoint part would count the
    whole part on top of the state it restores. Here a read costs only the tensor it returns. The
    header is checked as safetensors checks it (known dtypes, each byte range inside the file and of
    its shape's size); a problem is a ValueError naming the file."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._file = open(self.path, "rb")
        try:
            self._parse(os.fstat(self._file.fileno()).st_size)
        except BaseException:
            self._file.close()
            raise

    def _parse(self, size: int) -> None:
        raw = self._file.read(8)
        if len(raw) < 8:
            raise ValueError(f"{self.path} is too short for a safetensors header ({size} bytes)")
        n = struct.unpack("<Q", raw)[0]
        if n > size - 8:
            raise ValueError(f"{self.path}: its header length {n} runs past the end of the file ({size} bytes)")
        try:
            header = json.loads(self._file.read(n))
            self.metadata = header.pop("__metadata__", None) or {}
            self.start, data = 8 + n, size - 8 - n
            self.entries = {}
            for name, e in header.items():
                dtype, shape, (lo, hi) = NAMES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
                if not (0 <= lo <= hi <= data) or hi - lo != _size(shape, dtype):
                    raise ValueError(f"tensor {name}'s byte range {lo}-{hi} does not fit the file or its shape")
                self.entries[name] = (dtype, shape, lo, hi)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{self.path} has a bad safetensors header ({e})") from None

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple:
        return self.entries[name][1]

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, lo, hi = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        if hi > lo:
            self._file.seek(self.start + lo)
            if self._file.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy())) != hi - lo:
                raise ValueError(f"{self.path} ends inside tensor {name}")
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

