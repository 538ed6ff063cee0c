"""A Hugging Face checkpoint directory -> our model: safetensors only (sharded or not), FP8 dequantized,
per-expert weights stacked, the key set and every shape checked."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import SafetensorError, safe_open

from ..config import ModelConfig
from ..models.registry import ARCHS
from .config_json import hf_config_to_model_config, read_config
from .errors import HFFormatError, PathLike
from .names import _EXPERT_KEY, _IGNORED, _MTP_KEY, hf_to_our_name, our_to_hf_name

def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise HFFormatError(f"{index} is not a safetensors index (a JSON object with a weight_map).") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise HFFormatError(f"{index} lists shard {missing[0]}, which does not exist.")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (pickled .bin checkpoints are not read; convert them to safetensors)" if any(
            path.glob("*.bin")) else ""
        raise HFFormatError(f"{path} holds no *.safetensors weight files{hint}.")
    return files


def read_safetensors(files: Iterable[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the given safetensors files (keys must be unique across files)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in tensors:
                        raise HFFormatError(f"key {key} appears in more than one shard (again in {file}).")
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise HFFormatError(f"{file} is not a readable safetensors file ({e}).") from None
    return tensors


def _dequantize_fp8(tensors: dict, block: list) -> dict:
    """DeepSeek's block-scaled FP8: w = w_fp8 * scale_inv per (block[0] x block[1]) tile."""
    out = {}
    for key, t in tensors.items():
        if key.endswith("_scale_inv"):
            continue
        scale = tensors.get(key + "_scale_inv")
        if scale is None:
            out[key] = t
            continue
        rows, cols = t.shape
        s = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        out[key] = t.float() * s
    return out


def _stack_experts(tensors: dict[str, torch.Tensor], missing: list[str]) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down tensors -> stacked gate_up_proj (E, 2H, d) and down_proj (E, d, H)."""
    out, groups = {}, {}
    for key, t in tensors.items():
        m = _EXPERT_KEY.match(key)
        if m is None:
            out[key] = t
        else:
            groups.setdefault(m[1], {})[(int(m[2]), m[3])] = t
    for prefix, parts in groups.items():
        n = max(e for e, _ in parts) + 1
        absent = [f"{prefix}.{e}.{p}.weight" for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")
                  if (e, p) not in parts]
        if f"{prefix}.gate_up_proj" in tensors:
            raise HFFormatError(f"the checkpoint stores the experts of {prefix} both stacked and per expert.")
        if absent:
            missing.extend(absent)
            continue
        try:
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], 0) for e in range(n)])
            out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
        except RuntimeError:
            raise HFFormatError(f"the per-expert weights under {prefix} do not all have the same shape.") from None
    return out


def _mtp_depths(keys: Iterable[str]) -> int:
    depths = [int(m[1]) for m in map(_MTP_KEY.match, keys) if m]
    return max(depths) + 1 if depths else 0


def _hf_names_for(keys: Iterable[str], cfg: ModelConfig) -> list[str]:
    return sorted(our_to_hf_name(k, cfg.num_hidden_layers) for k in keys)


def _listing(keys: list[str], limit: int = 6) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def convert_hf_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named tensors -> our names (experts stacked, MTP renamed, copies and derived buffers dropped)."""
    renamed, unknown = {}, []
    for key, t in tensors.items():
        if _IGNORED.search(key):
            continue
        ours = hf_to_our_name(key, cfg.num_hidden_layers)
        if ours is None:
            continue
        if ours.startswith("?"):
            unknown.append(key)
        renamed[ours] = t
    if unknown:
        raise HFFormatError(f"the checkpoint has keys outside the model: {_listing(sorted(unknown))}.")
    missing: list[str] = []
    out = _stack_experts(renamed, missing)
    if missing:
        raise HFFormatError(f"the checkpoint is missing expert weights: "
                            f"{_listing(_hf_names_for(missing, cfg))}.")
    if cfg.arch == "deepseek_v3" and cfg.n_shared_experts == 0:
        # transformers builds zero-width shared experts when n_shared_experts is 0; we build none
        out = {k: t for k, t in out.items() if not (".shared_experts." in k and t.numel() == 0)}
    return out


def check_keys_and_shapes(have: dict[str, tuple], expected: dict[str, tuple], source: str, name_of=lambda k: k,
                          tied: bool = False, optional_prefix: Optional[str] = None, error=HFFormatError) -> None:
    """The one check of a set of weights (`have`: our name -> shape) against the model the config
    describes (`expected`, the same): the same keys, each of the same shape, else one sentence
    (`error`) naming the keys at fault by `name_of` (the source's own names). A tied lm_head.weight
    (`tied`) and keys under `optional_prefix` may be absent (they keep their initial values)."""
    optional = {"lm_head.weight"} if tied else set()
    if optional_prefix:
        optional |= {k for k in expected if k.startswith(optional_prefix)}
    missing = sorted(name_of(k) for k in expected.keys() - have.keys() - optional)
    unexpected = sorted(name_of(k) for k in have.keys() - expected.keys())
    if missing:
        raise error(f"{source} is missing {len(missing)} key(s) the config needs: {_listing(missing)}.")
    if unexpected:
        raise error(f"{source} has {len(unexpected)} key(s) the config does not have: {_listing(unexpected)}.")
    for key in expected.keys() & have.keys():
        if tuple(have[key]) != tuple(expected[key]):
            raise error(f"{source}: {name_of(key)} has shape {tuple(have[key])} but the config implies "
                        f"{tuple(expected[key])}.")


def load_checked(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
                 name_of=lambda k: k, optional_prefix: Optional[str] = None) -> None:
    """Copy `state` (our names) into `model` after check_keys_and_shapes and a dtype check; errors
    name keys via `name_of`. Keys under `optional_prefix` may be absent (they keep their initial values)."""
    expected = model.state_dict()
    tied = getattr(model.cfg, "tie_word_embeddings", False)
    shapes = {k: tuple(t.shape) for k, t in state.items()}
    check_keys_and_shapes(shapes, {k: tuple(t.shape) for k, t in expected.items()}, source, name_of, tied,
                          optional_prefix)
    for key, t in state.items():
        if not (t.is_floating_point() or t.dtype == expected[key].dtype):
            raise HFFormatError(f"{source}: {name_of(key)} has dtype {t.dtype}, expected a floating point tensor.")
    # tied: lm_head is embed_tokens; a stored copy of the head is not loaded over it
    skip = {"lm_head.weight"} if tied else set()
    model.load_state_dict({k: t for k, t in state.items() if k not in skip and not (
        optional_prefix and k.startswith(optional_prefix))}, strict=False)


def from_hf(path: PathLike, seed: int = 0) -> torch.nn.Module:
    """Load a Hugging Face DeepSeek-V3 or Llama checkpoint directory into our model (fp32, eval mode).

    The key set must match the config exactly (MTP depths: those present in the
    checkpoint, all or none), and every shape must agree.
    """
    path = Path(path)
    if not path.is_dir():
        raise HFFormatError(f"{path} is not a directory; expected a Hugging Face checkpoint directory.")
    hf = read_config(path)
    cfg = hf_config_to_model_config(hf)
    tensors = read_safetensors(_checkpoint_files(path))
    quant = hf.get("quantization_config")
    if quant is not None:
        tensors = _dequantize_fp8(tensors, list(quant.get("weight_block_size") or [128, 128]))
    state = convert_hf_state_dict(tensors, cfg)
    present = _mtp_depths(state)
    if cfg.arch == "deepseek_v3" and present == 0 and cfg.num_nextn_predict_layers > 0:
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)  # the checkpoint carries no MTP weights
    model = _build(cfg, seed)
    load_checked(model, state, str(path), name_of=lambda k: our_to_hf_name(k, cfg.num_hidden_layers))
    return model.eval()


def _build(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ARCHS[cfg.arch](cfg)
