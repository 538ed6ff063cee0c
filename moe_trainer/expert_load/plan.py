"""A redundant-expert placement plan (the EPLB problem) for a measured load, as JSON; the solvers
live in moe/placement/."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from .files import ExpertLoadError, iter_expert_load, list_expert_load_files


def load_for_plan(source: str | os.PathLike, last: Optional[int] = None) -> tuple[Tensor, list[int]]:
    """The [layers, experts] load to plan for, and the layer ids.

    source: a safetensors file with tensor `load` (or `counts`), or a run
    directory, whose newest `last` readable expert-load files (default all) are summed.
    """
    source = Path(source)
    if last is not None and last < 1:
        raise ExpertLoadError(f"--last must be a positive number of files, got {last}.")
    if source.is_dir():
        files = list_expert_load_files(source)
        records = list(iter_expert_load(files))
        if not records:
            raise ExpertLoadError(f"None of the {len(files)} expert-load files in {source} is readable.")
        records = records[-last:] if last else records
        return torch.stack([r.counts.double() for r in records]).sum(0), records[-1].layer_ids
    if not source.is_file():
        raise ExpertLoadError(f"Load file {source} does not exist (give a safetensors file with a tensor "
                              f"'load' of shape [layers, experts], or a run directory).")
    from safetensors import safe_open

    try:
        with safe_open(str(source), framework="pt") as f:
            keys = set(f.keys())
            key = "load" if "load" in keys else "counts" if "counts" in keys else None
            if key is None:
                raise ExpertLoadError(f"{source} has no tensor 'load' (found: {sorted(keys) or 'none'}).")
            load = f.get_tensor(key).double()
            meta = f.metadata() or {}
    except ExpertLoadError:
        raise
    except Exception as e:
        raise ExpertLoadError(f"{source} is not a readable safetensors file ({type(e).__name__}).") from None
    if load.dim() != 2:
        raise ExpertLoadError(f"The load in {source} must have shape [layers, experts], got {list(load.shape)}.")
    try:
        layer_ids = [int(i) for i in json.loads(meta["layer_ids"])]
        assert len(layer_ids) == load.shape[0]
    except (KeyError, ValueError, TypeError, AssertionError):
        layer_ids = list(range(load.shape[0]))
    return load, layer_ids


def make_plan(load: Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
              layer_ids: Optional[list[int]] = None) -> dict:
    """Placement plan and its quality as a JSON-able dict (see `tools/expert_load.py plan --help`)."""
    from ..moe import placement as pl

    if not torch.isfinite(load).all() or (load < 0).any():
        raise ExpertLoadError("The load must be finite and non-negative.")
    try:
        pl.check_layout(load.shape[1], num_replicas, num_groups, num_nodes, num_gpus)
    except pl.PlacementError as e:
        raise ExpertLoadError(f"{str(e).rstrip('.')} (the load has {load.shape[1]} experts).") from None
    phy2log, _, logcnt = pl.rebalance_experts(load, num_replicas, num_groups, num_nodes, num_gpus)
    ref = pl.eplb_reference(load, num_replicas, num_groups, num_nodes, num_gpus)
    ours = pl.max_over_mean(load, phy2log, num_gpus)
    eplb = pl.max_over_mean(load, ref, num_gpus)
    bound = pl.lower_bound(load, num_replicas, num_groups, num_nodes, num_gpus)
    gpu = pl.gpu_loads(load, phy2log, num_gpus)
    S = num_replicas // num_gpus
    r = lambda t: [round(float(x), 6) for x in t]  # noqa: E731
    return {
        "layout": {"num_experts": load.shape[1], "num_replicas": num_replicas, "num_groups": num_groups,
                   "num_nodes": num_nodes, "num_gpus": num_gpus, "slots_per_gpu": S,
                   "policy": "hierarchical" if pl.is_hierarchical(num_groups, num_nodes) else "global"},
        "layer_ids": list(layer_ids) if layer_ids is not None else list(range(load.shape[0])),
        "phy2log": phy2log.tolist(),
        "logcnt": logcnt.tolist(),
        "max_over_mean": r(ours),
        "eplb_max_over_mean": r(eplb),
        "lower_bound": r(bound),
        "gap_to_lower_bound": r(ours / bound - 1),
        "max_gpu_load": r(gpu.max(-1).values),
        "mean_gpu_load": r(gpu.mean(-1)),
        "summary": {"mean_max_over_mean": float(ours.mean()), "mean_eplb_max_over_mean": float(eplb.mean()),
                    "mean_lower_bound": float(bound.mean()),
                    "mean_gap_to_lower_bound": float((ours / bound - 1).mean())},
        "notes": "GPU g holds physical slots [g*slots_per_gpu, (g+1)*slots_per_gpu); phy2log[layer][slot] is the "
                 "logical expert in that slot. max_over_mean = max GPU load / mean GPU load, a replica carrying "
                 "its expert's load / its replica count. lower_bound: no plan of this layout can do better "
                 "(moe_trainer.moe.placement.lower_bound).",
    }


def dump_plan(plan: dict) -> str:
    """JSON with one line per top-level key, and one line per layer for per-layer lists of lists."""
    lines = []
    for key, value in plan.items():
        if isinstance(value, list) and value and isinstance(value[0], list):
            rows = ",\n".join("    " + json.dumps(row) for row in value)
            lines.append(f"  {json.dumps(key)}: [\n{rows}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"
