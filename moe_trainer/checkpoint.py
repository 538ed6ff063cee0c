"""Checkpoints: layout-independent safetensors, written atomically.

checkpoints/step_<N>/
  model.safetensors      fp32 master weights + buffers (balancing biases), global names
  optimizer.safetensors  Adam exp_avg / exp_avg_sq per parameter, same names
  rng.safetensors        every rank's RNG state
  state.json             step, Adam step, data position, layout, config digest
  manifest.json          size and sha256 of every file above (written last)
The directory is assembled under a temporary name and renamed when complete;
`latest` is replaced after that. A directory without a valid manifest is never
resumed from.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: one user-facing sentence."""


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- gather / scatter

def _optimizer_params(engine):
    """(name, param) for parameters the optimizer owns, in a fixed order."""
    return list(engine.module.named_parameters())


def link_optimizer_state(engine) -> None:
    """Make every parameter's ZeRO fragment see its Adam moments.

    DeepSpeed links optimizer state to parameters lazily after the first
    optimizer step, and only for the param groups that had state by then (the
    second group is missed); before any step torch's Adam has no state at all.
    Create missing state as torch's AdamW would (zeros, step 0), then relink.
    """
    zero = engine.optimizer
    for flat in zero.single_partition_of_fp32_groups:
        st = zero.optimizer.state[flat]
        if "exp_avg" not in st:
            st["step"] = torch.tensor(0.0, device=flat.device)  # fused AdamW keeps it on the parameter's device
            st["exp_avg"] = torch.zeros_like(flat)
            st["exp_avg_sq"] = torch.zeros_like(flat)
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()


def gather_state(trainer) -> tuple[dict, dict]:
    """Full fp32 weights and optimizer moments, by global name (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    link_optimizer_state(trainer.engine)
    model, opt = {}, {}
    for name, p in _optimizer_params(trainer.engine):
        full = safe_get_full_fp32_param(p)
        model[name] = _unshard(name, p, full if full is not None else p.detach().float(), trainer).cpu()
        for key in ("exp_avg", "exp_avg_sq"):
            state = safe_get_full_optimizer_state(p, key)
            if state is not None:
                opt[f"{name}.{key}"] = _unshard(name, p, state, trainer).cpu()
    for name, buf in trainer.engine.module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            model[name] = buf.detach().float().cpu()
    return model, opt


def _unshard(name: str, p, local: torch.Tensor, trainer) -> torch.Tensor:
    """The layout-independent tensor of parameter `name` from this rank's piece
    (collective over the groups that split it): experts over ep, TP shards over tp."""
    mesh = trainer.mesh
    if hasattr(p, "expert_shard"):
        parts = [torch.empty_like(local) for _ in range(mesh.size("ep"))]
        dist.all_gather(parts, local.contiguous(), group=mesh.group("ep"))
        return torch.cat(parts, dim=0)
    if mesh.size("tp") > 1:
        from .parallel.tensor import shard_param
        cfg, tp = trainer.cfg.model, mesh.size("tp")
        full_shape = _full_shape(name, trainer)
        _, dim = shard_param(name, torch.empty(full_shape, device="meta"), cfg, tp, 0)
        if dim is None:
            return local
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=mesh.group("tp"))
        full = torch.zeros(full_shape, dtype=local.dtype, device=local.device)
        for index, part in enumerate(parts):  # replicated kv heads: several ranks write the same rows
            target, _ = shard_param(name, full, cfg, tp, index)
            target.copy_(part)
        return full
    return local


def _shard(name: str, p, full: torch.Tensor, trainer) -> torch.Tensor:
    """This rank's piece of a layout-independent tensor."""
    if hasattr(p, "expert_shard"):
        ep_rank, ep = p.expert_shard
        n = full.shape[0] // ep
        return full[ep_rank * n:(ep_rank + 1) * n]
    if trainer.mesh.size("tp") > 1:
        from .parallel.tensor import shard_param
        return shard_param(name, full, trainer.cfg.model, trainer.mesh.size("tp"), trainer.mesh.index("tp"))[0]
    return full


def _full_shape(name: str, trainer) -> tuple:
    shapes = getattr(trainer, "_full_shapes", None)
    if shapes is None:
        shapes = trainer._full_shapes = full_model_shapes(trainer.cfg.model)
    return shapes[name]


def adam_step(engine) -> int:
    for state in engine.optimizer.optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def _rng_state() -> torch.Tensor:
    return torch.get_rng_state()


# ----------------------------------------------------------------------------- save

def save(trainer) -> Optional[Path]:
    """Write checkpoints/step_<N> (collective).

    One rank per pipeline stage (data-parallel index 0) writes that stage's
    weights and moments; rank 0 then writes RNG states, state.json and the
    manifest, renames the directory into place and updates `latest`.
    """
    model_state, opt_state = gather_state(trainer)
    rng = _rng_state().tolist()
    rngs = [None] * trainer.layout.world
    if dist.is_initialized() and trainer.layout.world > 1:
        dist.all_gather_object(rngs, rng)  # a few KB of ints between our own ranks
    else:
        rngs = [rng]
    root = trainer.out_dir / "checkpoints"
    final = root / f"step_{trainer.step}"
    tmp = root / f".step_{trainer.step}.tmp"
    if trainer.mesh.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    trainer.barrier()
    m = trainer.mesh
    if m.index("dpcp") == 0 and m.coord["tp"] == 0:
        stage = m.coord["pp"]
        save_file({k: v.contiguous() for k, v in model_state.items()}, str(tmp / f"model-pp{stage}.safetensors"),
                  metadata={"format": "moe_trainer.v1"})
        save_file({k: v.contiguous() for k, v in opt_state.items()}, str(tmp / f"optimizer-pp{stage}.safetensors"))
    trainer.barrier()
    path = _finish(trainer, tmp, final, rngs) if trainer.mesh.rank == 0 else None
    trainer.barrier()
    return path


def _finish(trainer, tmp: Path, final: Path, rngs: list) -> Path:
    save_file({f"rank{r}": torch.tensor(s, dtype=torch.uint8) for r, s in enumerate(rngs)},
              str(tmp / "rng.safetensors"))
    state = {"step": trainer.step, "adam_step": adam_step(trainer.engine), "data_position": trainer.step,
             "arch": trainer.cfg.model.arch, "layout": trainer.layout.__dict__,
             "model": trainer.cfg.to_dict()["model"], "noise_scale": trainer.noise.state_dict()}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps({"step": trainer.step, "files": files}, indent=1))
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(final.parent / "latest", final.name + "\n")
    prune(final.parent, trainer.cfg.train.keep_checkpoints)
    return final


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop leftovers of interrupted writes."""
    steps = sorted((int(p.name.split("_")[1]), p) for p in root.glob("step_*") if p.name.split("_")[1].isdigit())
    for _, p in steps[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- find / verify / load

def verify(path: Path) -> Optional[str]:
    """None if the checkpoint is complete and intact, else why not."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "it has no manifest (incomplete write)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError):
        return "its manifest is unreadable"
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if sha256(f) != meta["sha256"]:
            return f"{name} does not match its checksum"
    return None


def find_resume(out_dir: Path, resume: str, warn: bool = True) -> Optional[Path]:
    """train.resume: none -> None; a path -> that checkpoint (must be valid);
    auto -> the newest complete checkpoint, skipping broken ones with a warning."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        problem = verify(path) if path.is_dir() else "it does not exist"
        if problem:
            raise CheckpointError(f"cannot resume from {path}: {problem}.")
        return path
    root = Path(out_dir) / "checkpoints"
    candidates = sorted(((int(p.name.split("_")[1]), p) for p in root.glob("step_*")
                         if p.name.split("_")[1].isdigit()), reverse=True) if root.is_dir() else []
    for _, path in candidates:
        problem = verify(path)
        if problem is None:
            return path
        if warn:
            print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
    return None


def _load_safetensors(path: Path) -> dict:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}).") from None


def full_model_shapes(model_cfg) -> dict:
    """Name -> shape of every weight (and balancing bias) of the whole model,
    built on the meta device: no memory, no initialisation cost."""
    from .models.registry import ARCHS
    with torch.device("meta"):
        model = ARCHS[model_cfg.arch](model_cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    return shapes


def full_model_names(model_cfg) -> set:
    return set(full_model_shapes(model_cfg))


def _load_all(path: Path, kind: str) -> dict:
    """Merge the per-stage files (`model-pp0.safetensors`, ...) of a checkpoint:
    any layout can read what any layout wrote."""
    files = sorted(path.glob(f"{kind}-pp*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {path} has no {kind} files.")
    merged: dict = {}
    for f in files:
        merged.update(_load_safetensors(f))
    return merged


def load(path: Path, trainer) -> int:
    """Restore weights, optimizer state, RNG and step from a verified checkpoint."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    state = json.loads((path / "state.json").read_text())
    if state.get("arch") != trainer.cfg.model.arch:
        raise CheckpointError(f"checkpoint {path} holds a {state.get('arch')} model, but model.arch is "
                              f"{trainer.cfg.model.arch}.")
    weights = _load_all(path, "model")
    moments = _load_all(path, "optimizer")
    module = trainer.engine.module
    expected = {n: p for n, p in module.named_parameters()}
    expected.update({n: b for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")})
    full = full_model_names(trainer.cfg.model)  # a pipeline stage holds only some of them
    missing = sorted(full - set(weights))
    unexpected = sorted(set(weights) - full)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit this model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}.")
    for name, target in expected.items():
        if tuple(_shard(name, target, weights[name], trainer).shape) != tuple(target.shape):
            raise CheckpointError(f"checkpoint {path} has {name} of shape {tuple(weights[name].shape)}, which does "
                                  f"not fit this model's {tuple(target.shape)}.")
    link_optimizer_state(trainer.engine)
    with torch.no_grad():
        for name, target in expected.items():
            value = _shard(name, target, weights[name], trainer).to(target.device)
            target.copy_(value.to(target.dtype))
            if isinstance(target, torch.nn.Parameter):
                safe_set_full_fp32_param(target, value.float())
                for key in ("exp_avg", "exp_avg_sq"):
                    if f"{name}.{key}" in moments:
                        moment = _shard(name, target, moments[f"{name}.{key}"], trainer).to(target.device)
                        safe_set_full_optimizer_state(target, moment, key)
        for st in trainer.engine.optimizer.optimizer.state.values():
            if "step" in st:
                st["step"] = (torch.tensor(float(state["adam_step"]), dtype=st["step"].dtype,
                                           device=st["step"].device)
                              if torch.is_tensor(st["step"]) else state["adam_step"])
    if "noise_scale" in state:
        trainer.noise.load_state_dict(state["noise_scale"])
    rng = _load_safetensors(path / "rng.safetensors")
    key = f"rank{trainer.mesh.rank}"
    if key in rng:
        torch.set_rng_state(rng[key])
    return int(state["step"])
