"""Our model -> a Hugging Face checkpoint directory that transformers loads: Hugging Face names,
experts one tensor per expert unless stacked, DeepSeek's MTP copies, the router kept in fp32;
written beside the target and renamed into place."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from .config_json import model_config_to_hf
from .errors import HFFormatError, PathLike
from .names import our_to_hf_name

KEEP_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # transformers keeps the router in fp32
DEFAULT_SHARD_BYTES = 5 * 1024 ** 3


def hf_state_dict(model: torch.nn.Module, stacked_experts: bool = False,
                  dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Our model -> HF-named CPU tensors, one storage each (what safetensors needs)."""
    cfg = model.cfg
    n_layers = cfg.num_hidden_layers
    out = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: transformers re-ties it to embed_tokens
        t = t.detach().cpu()
        if dtype is not None and t.is_floating_point() and not key.endswith(KEEP_FP32):
            t = t.to(dtype)
        name = our_to_hf_name(key, n_layers)
        if not stacked_experts and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            _split_experts(name, t, out)
        else:
            out[name] = t.contiguous().clone()
    if cfg.arch == "deepseek_v3":
        _add_hf_only(model, out, dtype)
    return out


def _split_experts(name: str, t: torch.Tensor, out: dict) -> None:
    prefix, kind = name.rsplit(".", 1)
    for e in range(t.shape[0]):
        if kind == "gate_up_proj":
            gate, up = t[e].chunk(2, dim=0)
            out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous().clone()
            out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous().clone()
        else:
            out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous().clone()


def _add_hf_only(model, out: dict, dtype) -> None:
    """Tensors DeepSeek's layout has and ours does not: MTP copies of the embedding and head,
    zero-width shared experts when n_shared_experts is 0 (transformers builds them)."""
    cfg = model.cfg
    embed = out["model.embed_tokens.weight"]
    head = out.get("lm_head.weight", embed)
    for k in range(cfg.num_nextn_predict_layers):
        layer = f"model.layers.{cfg.num_hidden_layers + k}"
        out[f"{layer}.embed_tokens.weight"] = embed.clone()
        out[f"{layer}.shared_head.head.weight"] = head.clone()
    if cfg.n_shared_experts == 0:
        dt, d = dtype or embed.dtype, cfg.hidden_size
        moe_layers = [i for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
                      if i >= cfg.first_k_dense_replace]
        for i in moe_layers:
            base = f"model.layers.{i}.mlp.shared_experts"
            out[f"{base}.gate_proj.weight"] = torch.zeros(0, d, dtype=dt)
            out[f"{base}.up_proj.weight"] = torch.zeros(0, d, dtype=dt)
            out[f"{base}.down_proj.weight"] = torch.zeros(d, 0, dtype=dt)


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for key in sorted(tensors):
        n = tensors[key].numel() * tensors[key].element_size()
        if current and size + n > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensors[key]
        size += n
    return shards + [current]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "cfg") and hasattr(model, "module"):
        model = model.module  # DDP / DeepSpeed engine
    if not isinstance(getattr(model, "cfg", None), ModelConfig):
        raise HFFormatError("to_hf needs one of our models (a module with a ModelConfig in .cfg).")
    return model


def to_hf(model: torch.nn.Module, path: PathLike, *, dtype: Optional[torch.dtype] = None,
          stacked_experts: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
          overwrite: bool = False) -> Path:
    """Write `model` as a Hugging Face checkpoint directory that `AutoModelForCausalLM.from_pretrained` loads.

    config.json + model.safetensors (or shards + index beyond `max_shard_bytes`),
    written into a temporary directory beside `path` and renamed into place, so
    `path` is either absent or complete. `dtype` casts weights (the router stays
    fp32); the default keeps the model's dtype.
    """
    model = _unwrap(model)
    hf_cfg = model_config_to_hf(model.cfg)
    tensors = hf_state_dict(model, stacked_experts, dtype)
    hf_cfg["dtype"] = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    path = Path(path)
    with _staged_dir(path, overwrite) as tmp:
        _write_dir(tmp, hf_cfg, tensors, max_shard_bytes)
    return path


def _write_dir(tmp: Path, hf_cfg: dict, tensors: dict, max_shard_bytes: int) -> None:
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _staged_dir(path: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary directory beside `path` to write a checkpoint directory into: once the block is
    done its files are fsynced and it replaces `path` (so `path` is either absent or complete); if
    the block fails it is removed. A `path` holding anything is refused unless `overwrite`."""
    if path.exists() and not (path.is_dir() and not any(path.iterdir())) and not overwrite:
        raise HFFormatError(f"{path} already exists and is not an empty directory; choose another output path.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(tmp: Path, path: Path) -> None:
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    if path.exists():  # overwrite: move the old one aside first, drop it once the new one is in place
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
        tmp.rename(path)
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
    else:
        tmp.rename(path)
