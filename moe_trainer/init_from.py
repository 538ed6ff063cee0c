"""train.init_from, rank-local: a rank reads only the tensors and rows it keeps.

Sources: a Hugging Face DeepSeek-V3 / Llama directory (config.json + safetensors, FP8
block-scaled or not, experts per expert or stacked), a safetensors file of our names, or a
run checkpoint (checkpoints/step_N). Every tensor is read through `safe_open(...).get_slice`
for the block the rank holds (its experts' rows, its TP shard), so no rank ever holds a whole
tensor it does not keep, let alone the model. The key set and every global shape are checked
from the files' headers first, with hf.check_keys_and_shapes, as hf.load_checked does.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig
from .hf import (_EXPERT_KEY, _IGNORED, HFFormatError, _checkpoint_files, _listing, check_keys_and_shapes,
                 check_same_model, hf_dir_model, hf_to_our_name, our_to_hf_name, read_config)
from .models.init import global_view, is_expert_param

BIAS = "e_score_correction_bias"


class Source:
    """Named tensors across safetensors files, read block by block (FP8 blocks dequantised)."""

    def __init__(self, files: list[Path], fp8_block: Optional[list] = None):
        self.fp8_block = fp8_block
        self.file_of: dict[str, Path] = {}
        self._handles: dict = {}
        for file in files:
            for key in self._open(file).keys():
                if key in self.file_of:
                    raise HFFormatError(f"key {key} appears in more than one shard (again in {file}).")
                self.file_of[key] = file

    def _open(self, file: Path):
        f = self._handles.get(file)
        if f is None:
            try:
                f = self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise HFFormatError(f"{file} is not a readable safetensors file ({e}).") from None
        return f

    def keys(self) -> list[str]:
        return [k for k in self.file_of if not k.endswith("_scale_inv")]

    def shape(self, key: str) -> tuple:
        return tuple(self._open(self.file_of[key]).get_slice(key).get_shape())

    def read(self, key: str, offsets: Optional[tuple] = None, sizes: Optional[tuple] = None) -> torch.Tensor:
        """Block [offsets, offsets + sizes) of tensor `key` (all of it by default), fp32."""
        shape = self.shape(key)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
        sizes = tuple(sizes) if sizes is not None else shape
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        t = self._open(self.file_of[key]).get_slice(key)[index] if shape else self._open(
            self.file_of[key]).get_tensor(key)
        scale_key = key + "_scale_inv"
        if scale_key not in self.file_of:
            return t.float()
        b0, b1 = self.fp8_block or [128, 128]
        (r0, c0), (n, m) = offsets, sizes  # DeepSeek scales 2-D weights in (b0 x b1) tiles
        s = self._open(self.file_of[scale_key]).get_slice(scale_key)[
            r0 // b0:(r0 + n - 1) // b0 + 1, c0 // b1:(c0 + m - 1) // b1 + 1].float()
        s = s.repeat_interleave(b0, 0)[r0 % b0:r0 % b0 + n].repeat_interleave(b1, 1)[:, c0 % b1:c0 % b1 + m]
        return t.float() * s


def local_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a rank loads: its parameters (a tied head once) and its balancing biases, by global name."""
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n.endswith(BIAS)})
    return out


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    from .checkpoint import full_model_shapes
    return full_model_shapes(cfg)


class _Naming:
    """Our names <-> the source's keys: Hugging Face's (experts per expert or stacked) or ours."""

    def __init__(self, source: Source, cfg: ModelConfig, hf: bool):
        self.source, self.cfg, self.hf = source, cfg, hf
        self.per_expert: dict[str, dict] = {}  # stacked key -> {(expert, proj): key}
        self.shapes: dict[str, tuple] = {}  # our name -> global shape
        unknown = []
        for key in source.keys():
            if _IGNORED.search(key):
                continue
            ours = hf_to_our_name(key, cfg.num_hidden_layers) if hf else key
            if ours is None:
                continue
            if ours.startswith("?"):
                unknown.append(key)
                continue
            m = _EXPERT_KEY.match(ours)
            if m is not None:
                self.per_expert.setdefault(m[1], {})[(int(m[2]), m[3])] = key
                continue
            shape = source.shape(key)
            if ".shared_experts." in ours and cfg.arch == "deepseek_v3" and cfg.n_shared_experts == 0 \
                    and math.prod(shape) == 0:
                continue  # transformers' zero-width shared experts
            self.shapes[ours] = shape
        if unknown:
            raise HFFormatError(f"the checkpoint has keys outside the model: {_listing(sorted(unknown))}.")
        self._stacked_shapes()

    def _stacked_shapes(self) -> None:
        missing = []
        for prefix, parts in self.per_expert.items():
            if f"{prefix}.gate_up_proj" in self.shapes:
                raise HFFormatError(f"the checkpoint stores the experts of {prefix} both stacked and per expert.")
            n = max(e for e, _ in parts) + 1
            absent = [f"{prefix}.{e}.{p}.weight" for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")
                      if (e, p) not in parts]
            if absent:
                missing.extend(self._hf_name(a) for a in absent)
                continue
            gate, up, down = (self.source.shape(parts[(0, p)]) for p in ("gate_proj", "up_proj", "down_proj"))
            self.shapes[f"{prefix}.gate_up_proj"] = (n, gate[0] + up[0], gate[1])
            self.shapes[f"{prefix}.down_proj"] = (n,) + tuple(down)
        if missing:
            raise HFFormatError(f"the checkpoint is missing expert weights: {_listing(sorted(missing))}.")

    def _hf_name(self, ours: str) -> str:
        return our_to_hf_name(ours, self.cfg.num_hidden_layers) if self.hf else ours

    def read(self, name: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        prefix, kind = name.rsplit(".", 1)
        if not (is_expert_param(name) and prefix in self.per_expert):
            return self.source.read(self._source_key(name), offsets, sizes)
        parts = self.per_expert[prefix]
        rows = []
        for e in range(offsets[0], offsets[0] + sizes[0]):  # this rank's experts only
            if kind == "gate_up_proj":
                full = torch.cat([self.source.read(parts[(e, "gate_proj")]), self.source.read(parts[(e, "up_proj")])])
            else:
                full = self.source.read(parts[(e, "down_proj")])
            rows.append(full[offsets[1]:offsets[1] + sizes[1], offsets[2]:offsets[2] + sizes[2]])
        return torch.stack(rows)

    def _source_key(self, name: str) -> str:
        return our_to_hf_name(name, self.cfg.num_hidden_layers) if self.hf else name


def _check(naming: _Naming, cfg: ModelConfig, source_name: str, optional_prefix: Optional[str]) -> None:
    """The source's key set and shapes from its headers (hf.check_keys_and_shapes), named its own way."""
    check_keys_and_shapes(naming.shapes, _expected_shapes(cfg), source_name, naming._hf_name, cfg.tie_word_embeddings,
                          optional_prefix)


@torch.no_grad()
def _copy_blocks(model: torch.nn.Module, read, skip=lambda name: False) -> None:
    for name, target in local_tensors(model).items():
        if skip(name):
            continue
        _, offsets = global_view(target)
        target.copy_(read(name, offsets, tuple(target.shape)).to(target.dtype))


def load_hf_dir(model: torch.nn.Module, cfg: ModelConfig, path: Path) -> None:
    """A Hugging Face directory whose config matches `cfg` (checked by the caller)."""
    quant = read_config(path).get("quantization_config")
    block = list(quant.get("weight_block_size") or [128, 128]) if quant is not None else None
    naming = _Naming(Source(_checkpoint_files(path), block), cfg, hf=True)
    has_mtp = any(k.startswith("mtp.") for k in naming.shapes)
    fresh_mtp = cfg.arch == "deepseek_v3" and cfg.num_nextn_predict_layers > 0 and not has_mtp
    if fresh_mtp:
        print(f"warning: {path} has no multi-token-prediction weights; the MTP module starts from its "
              f"initialisation", file=sys.stderr, flush=True)
    _check(naming, cfg, str(path), "mtp." if fresh_mtp else None)
    tied = cfg.tie_word_embeddings
    _copy_blocks(model, naming.read, skip=lambda n: (fresh_mtp and n.startswith("mtp.")) or (
        tied and n == "lm_head.weight"))


def load_weights_file(model: torch.nn.Module, cfg: ModelConfig, path: Path) -> None:
    """A safetensors file of our names (tools/convert_hf.py import writes one)."""
    naming = _Naming(Source([path]), cfg, hf=False)
    _check(naming, cfg, str(path), None)
    _copy_blocks(model, naming.read)


def load_run_checkpoint(model: torch.nn.Module, cfg: ModelConfig, path: Path) -> None:
    """A run checkpoint directory (weights only; the files read are checked against the manifest)."""
    from .checkpoint import CheckpointError, Index, verify
    try:
        index = Index(path)
    except CheckpointError as e:
        raise HFFormatError(str(e)) from None
    boxes = {}
    for name, t in local_tensors(model).items():
        boxes[name] = (global_view(t)[1], tuple(t.shape))
    problem = verify(path, read=index.files_for(boxes))
    if problem:
        raise HFFormatError(f"train.init_from {path}: {problem}.")
    index.check_fits(_expected_shapes(cfg), HFFormatError)
    _copy_blocks(model, lambda name, offsets, sizes: index.block(name, offsets, sizes))


def is_run_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "manifest.json").is_file()


def load_initial_weights(model: torch.nn.Module, path: Path) -> None:
    """train.init_from: continue a Hugging Face DeepSeek-V3 / Llama checkpoint
    directory, a safetensors file of our names, or a run checkpoint directory.
    A Hugging Face directory must describe the same architecture as model.*.
    `model` may be one rank's part (a stage, its experts, its TP shards): only the rows it
    holds are read."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return load_weights_or_checkpoint(model, path)
    check_same_model(model.cfg, hf_dir_model(path), [f.name for f in dataclasses.fields(ModelConfig)], path)
    load_hf_dir(model, model.cfg, path)


def load_weights_or_checkpoint(model: torch.nn.Module, path: Path) -> None:
    """Load a safetensors file keyed by our names, or a run checkpoint directory
    (checkpoints/step_N/), into `model` (the whole model or one rank's part of it)."""
    path = Path(path)
    if is_run_checkpoint(path):
        return load_run_checkpoint(model, model.cfg, path)
    if not path.is_file():
        raise HFFormatError(f"weights {path} is neither a safetensors file nor a checkpoint directory with a "
                            f"manifest.json.")
    load_weights_file(model, model.cfg, path)



# ----------------------------------------------------------------------------- checked before the start

def check_source(cfg: ModelConfig, path: Path) -> None:
    """train.init_from's headers against the model, before any process group or engine: its files
    open as safetensors (a truncated file fails here), its key set and every global shape are the
    model's. Reads headers only; the weights are read later, by each rank for its own part."""
    path = Path(path)
    if is_run_checkpoint(path):
        from .checkpoint import CheckpointError, Index
        try:
            Index(path).check_fits(_expected_shapes(cfg), HFFormatError)
        except CheckpointError as e:
            raise HFFormatError(f"train.init_from {path}: {e}") from None
        return
    if (path / "config.json").is_file():
        check_same_model(cfg, hf_dir_model(path), [f.name for f in dataclasses.fields(ModelConfig)], path)
        quant = read_config(path).get("quantization_config")
        block = list(quant.get("weight_block_size") or [128, 128]) if quant is not None else None
        naming = _Naming(Source(_checkpoint_files(path), block), cfg, hf=True)
        fresh_mtp = cfg.arch == "deepseek_v3" and cfg.num_nextn_predict_layers > 0 and not any(
            k.startswith("mtp.") for k in naming.shapes)
        _check(naming, cfg, str(path), "mtp." if fresh_mtp else None)
        return
    _check(_Naming(Source([path]), cfg, hf=False), cfg, str(path), None)


def tokenizer_dir(path: Path) -> Optional[Path]:
    """Where train.init_from's tokenizer lies, if it carries one: a Hugging Face directory's own
    tokenizer.json, or a run checkpoint's run directory (checkpoints/step_N -> the run's copy)."""
    path = Path(path)
    for d in ((path.parent.parent,) if is_run_checkpoint(path) else (path,) if path.is_dir() else ()):
        if (d / "tokenizer.json").is_file():
            return d
    return None
