"""Streaming export to a Hugging Face directory: one tensor in memory at a time.

The shard plan (which tensor goes to which `model-0000k-of-0000n.safetensors`) is made from
shapes alone; then each shard is written tensor by tensor, each read when its turn comes (a run
checkpoint's pieces, or a safetensors file's tensors, block by block) and dropped. Peak memory is
about one tensor (plus the one checkpoint piece being cut into per-expert tensors), never a
shard or the model. The layout is
what hf.to_hf writes for a model in memory: Hugging Face names, experts one tensor per expert
unless stacked, DeepSeek's MTP copies of the embedding and head, the router kept in fp32.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .config import ModelConfig
from .hf import DEFAULT_SHARD_BYTES, KEEP_FP32, HFFormatError, model_config_to_hf, our_to_hf_name
from .hf.write import _staged_dir
from .tensor_file import write_safetensors

Reader = Callable[[str, tuple, tuple], torch.Tensor]  # (our name, offsets, sizes) -> fp32 block


@dataclass
class Entry:
    key: str  # Hugging Face name
    shape: tuple
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * (torch.finfo(self.dtype).bits // 8)


def _entries(cfg: ModelConfig, shapes: dict, read: Reader, dtype: torch.dtype, stacked: bool) -> list[Entry]:
    """Every tensor of the Hugging Face layout, with how to produce it."""
    n_layers, out = cfg.num_hidden_layers, []

    def cast(name: str) -> torch.dtype:
        return torch.float32 if name.endswith(KEEP_FP32) else dtype

    def whole(name: str, shape: tuple) -> Callable[[], torch.Tensor]:
        return lambda: read(name, (0,) * len(shape), shape)

    for name, shape in shapes.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        key = our_to_hf_name(name, n_layers)
        if stacked or not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out.append(Entry(key, shape, cast(name), whole(name, shape)))
            continue
        prefix, kind = key.rsplit(".", 1)
        e_count, rows, cols = shape
        for e in range(e_count):
            def one(e=e, name=name, rows=rows, cols=cols):
                return read(name, (e, 0, 0), (1, rows, cols))[0]
            if kind == "gate_up_proj":
                h = rows // 2
                out.append(Entry(f"{prefix}.{e}.gate_proj.weight", (h, cols), dtype, lambda one=one, h=h: one()[:h]))
                out.append(Entry(f"{prefix}.{e}.up_proj.weight", (h, cols), dtype, lambda one=one, h=h: one()[h:]))
            else:
                out.append(Entry(f"{prefix}.{e}.down_proj.weight", (rows, cols), dtype, one))
    if cfg.arch == "deepseek_v3":
        out += _hf_only(cfg, shapes, read, dtype)
    return sorted(out, key=lambda e: e.key)


def _hf_only(cfg: ModelConfig, shapes: dict, read: Reader, dtype: torch.dtype) -> list[Entry]:
    """DeepSeek's MTP copies of the embedding and head; zero-width shared experts (as hf.write._add_hf_only)."""
    out = []
    embed = ("embed_tokens.weight", shapes["embed_tokens.weight"])
    head = ("lm_head.weight", shapes["lm_head.weight"]) if "lm_head.weight" in shapes else embed
    for k in range(cfg.num_nextn_predict_layers):
        layer = f"model.layers.{cfg.num_hidden_layers + k}"
        for key, (name, shape) in ((f"{layer}.embed_tokens.weight", embed), (f"{layer}.shared_head.head.weight", head)):
            out.append(Entry(key, shape, dtype, lambda name=name, shape=shape: read(name, (0, 0), shape)))
    if cfg.n_shared_experts == 0:
        d = cfg.hidden_size
        for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
            base = f"model.layers.{i}.mlp.shared_experts"
            for proj, shape in (("gate_proj", (0, d)), ("up_proj", (0, d)), ("down_proj", (d, 0))):
                out.append(Entry(f"{base}.{proj}.weight", shape, dtype, lambda shape=shape: torch.zeros(shape)))
    return out


def _plan(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    shards, current, size = [], [], 0
    for e in entries:
        if current and size + e.bytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.bytes
    return shards + [current]


def stream_to_hf(cfg: ModelConfig, shapes: dict, read: Reader, path, *, dtype: Optional[torch.dtype] = None,
                 stacked_experts: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 overwrite: bool = False) -> Path:
    """Write a Hugging Face directory from tensors read on demand (`read`: our name, offsets, sizes
    -> fp32 block); `shapes`: our names -> global shapes. Atomic like hf.to_hf."""
    dtype = dtype or torch.float32
    entries = _entries(cfg, shapes, read, dtype, stacked_experts)
    hf_cfg = model_config_to_hf(cfg)
    hf_cfg["dtype"] = str(dtype).removeprefix("torch.")
    path = Path(path)
    with _staged_dir(path, overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
        shards = _plan(entries, max_shard_bytes)
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            # each tensor read when its turn comes: one tensor in memory, not the shard
            write_safetensors(tmp / name, {e.key: e for e in shard}, metadata={"format": "pt"})
            weight_map.update({e.key: name for e in shard})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.bytes for e in entries)}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


def export_weights(cfg: ModelConfig, weights, out_dir, **kwargs) -> Path:
    """Our weights (a run checkpoint directory or a safetensors file of our names) -> Hugging Face
    directory, streamed; shapes are checked against `cfg` first."""
    from . import init_from
    from .checkpoint import CheckpointError, Index, full_model_shapes
    weights = Path(weights)
    shapes = full_model_shapes(cfg)
    if init_from.is_run_checkpoint(weights):
        try:
            index = Index(weights)
        except CheckpointError as e:
            raise HFFormatError(str(e)) from None
        index.check_fits(shapes, HFFormatError)
        read = index.block
    elif weights.is_file():
        naming = init_from._Naming(init_from.Source([weights]), cfg, hf=False)
        init_from._check(naming, cfg, str(weights), None)
        read = naming.read
    else:
        raise HFFormatError(f"weights {weights} is neither a safetensors file nor a checkpoint directory with a "
                            f"manifest.json.")
    return stream_to_hf(cfg, shapes, read, out_dir, **kwargs)
