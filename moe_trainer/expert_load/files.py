"""The expert-load files of a run directory.

Format (written by the trainer through `write_expert_load`, read by the tool):
    <run_dir>/expert_load/step_<N:08d>.safetensors
        counts  float32 [moe_layers, n_routed_experts]: tokens routed to each
                global expert during the logging interval ending at step N,
                summed over all ranks;
        bias    float32, same shape, optional: the aux-loss-free balancing
                bias at step N;
        metadata {"step": "N", "layer_ids": "[global ids of the MoE layers]"}.
Files are written atomically (temp file + os.replace). A reader may still meet
a broken file (a run in progress on a shared file system, a crash, a copy cut
short): unreadable files are skipped with a warning, never fatal.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

EXPERT_LOAD_DIR = "expert_load"
PLACEMENT_FILE = "expert_placement.json"  # in a run directory: the plan parallel.expert_placement=auto uses
_FILE_RE = re.compile(r"^step_(\d+)\.safetensors$")


class ExpertLoadError(ValueError):
    """Bad input to the analysis: the message is one user-facing sentence."""


class ExpertLoadWarning(UserWarning):
    """A file that was skipped (unreadable or inconsistent)."""

def expert_load_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / EXPERT_LOAD_DIR / f"step_{step:08d}.safetensors"


def write_expert_load(run_dir: str | os.PathLike, step: int, counts: Tensor, bias: Optional[Tensor] = None,
                      layer_ids: Optional[Sequence[int]] = None) -> Path:
    """Write one interval's expert load atomically; returns the file's path.

    Args:
        counts: [moe_layers, n_routed_experts] tokens per global expert, summed over ranks.
        bias: same shape, optional aux-loss-free balancing bias.
        layer_ids: global layer id of each MoE layer (default 0 .. moe_layers-1).
    """
    from safetensors.torch import save_file

    counts = counts.detach().to("cpu", torch.float32).contiguous()
    if counts.dim() != 2:
        raise ExpertLoadError(f"counts must have shape [moe_layers, n_routed_experts], got {list(counts.shape)}.")
    tensors = {"counts": counts}
    if bias is not None:
        bias = bias.detach().to("cpu", torch.float32).contiguous()
        if bias.shape != counts.shape:
            raise ExpertLoadError(f"bias must have the shape of counts {list(counts.shape)}, got {list(bias.shape)}.")
        tensors["bias"] = bias
    ids = list(range(counts.shape[0])) if layer_ids is None else [int(i) for i in layer_ids]
    if len(ids) != counts.shape[0]:
        raise ExpertLoadError(f"layer_ids has {len(ids)} entries but counts has {counts.shape[0]} MoE layers.")
    path = expert_load_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"step": str(int(step)), "layer_ids": json.dumps(ids)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@dataclass
class ExpertLoadRecord:
    step: int
    counts: Tensor  # [L, E] float32
    bias: Optional[Tensor]  # [L, E] float32 or None
    layer_ids: list[int]
    path: Path


def read_expert_load(path: str | os.PathLike) -> ExpertLoadRecord:
    """Read one file; raises ExpertLoadError (one sentence) if it is unreadable or malformed."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            if "counts" not in keys:
                raise ExpertLoadError(f"{path} has no tensor 'counts'.")
            counts = f.get_tensor("counts").float()
            bias = f.get_tensor("bias").float() if "bias" in keys else None
    except ExpertLoadError:
        raise
    except Exception as e:  # safetensors raises several types for truncated/corrupt files
        raise ExpertLoadError(f"{path} is unreadable ({type(e).__name__}: {str(e).strip()[:120]}).") from None
    if counts.dim() != 2:
        raise ExpertLoadError(f"{path}: counts has shape {list(counts.shape)}, expected [moe_layers, experts].")
    if bias is not None and bias.shape != counts.shape:
        raise ExpertLoadError(f"{path}: bias shape {list(bias.shape)} differs from counts {list(counts.shape)}.")
    match = _FILE_RE.match(path.name)
    try:
        step = int(meta["step"]) if "step" in meta else int(match.group(1))
        ids = json.loads(meta["layer_ids"]) if "layer_ids" in meta else range(counts.shape[0])
        layer_ids = [int(i) for i in ids]
    except (ValueError, TypeError, AttributeError):  # json.JSONDecodeError is a ValueError
        raise ExpertLoadError(f"{path} has malformed metadata {meta}.") from None
    if len(layer_ids) != counts.shape[0]:
        raise ExpertLoadError(f"{path}: {len(layer_ids)} layer_ids for {counts.shape[0]} MoE layers.")
    return ExpertLoadRecord(step, counts, bias, layer_ids, path)


def list_expert_load_files(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every expert-load file of a run, by step; errors if there are none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        raise ExpertLoadError(f"Run directory {run_dir} {what}.")
    d = run_dir / EXPERT_LOAD_DIR
    files = sorted((int(m.group(1)), p) for p in (d.iterdir() if d.is_dir() else [])
                   if (m := _FILE_RE.match(p.name)) and p.is_file())
    if not files:
        raise ExpertLoadError(f"{run_dir} has no expert-load files ({EXPERT_LOAD_DIR}/step_<N>.safetensors); "
                              f"is it a run directory of a MoE model that has logged at least once?")
    return files


def iter_expert_load(files: Sequence[tuple[int, Path]], skipped: Optional[list[str]] = None
                     ) -> Iterator[ExpertLoadRecord]:
    """Read files in step order, skipping unreadable ones and ones whose shape or layer ids
    differ from the newest readable file's (the current run's).

    Every skipped file emits an ExpertLoadWarning and, if given, appends its reason to `skipped`.
    """
    def skip(reason: str) -> None:
        warnings.warn(f"{reason.rstrip('.')}; skipped it.", ExpertLoadWarning, stacklevel=3)
        if skipped is not None:
            skipped.append(reason)

    newest, ref = len(files), None
    while ref is None and newest > 0:  # a run in progress may have a broken newest file
        newest -= 1
        try:
            ref = read_expert_load(files[newest][1])
        except ExpertLoadError as e:
            skip(str(e))
    if ref is None:
        return
    for _, path in files[:newest]:
        try:
            rec = read_expert_load(path)
        except ExpertLoadError as e:
            skip(str(e))
            continue
        if rec.counts.shape != ref.counts.shape or rec.layer_ids != ref.layer_ids:
            skip(f"{path}: shape {list(rec.counts.shape)} and layers {rec.layer_ids} differ from the newest "
                 f"file's {list(ref.counts.shape)} and {ref.layer_ids}.")
            continue
        yield rec
    yield ref



def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a reader (a resuming run) never sees a half-written file
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _make_out_dir(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExpertLoadError(f"Cannot create the output directory {out} ({e.strerror}).") from None
    return out
