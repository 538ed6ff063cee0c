"""Hugging Face interop: DeepSeek-V3 and Llama checkpoint directories <-> our models.

A Hugging Face checkpoint directory is `config.json` plus `*.safetensors`
(one `model.safetensors`, or shards listed in `model.safetensors.index.json`).
Only safetensors are read; pickled `.bin` files never are.

Names: ours are Hugging Face's minus the `model.` prefix, except
- MoE experts: transformers keeps them stacked in memory
  (`mlp.experts.gate_up_proj` (E, 2H, d), `mlp.experts.down_proj` (E, d, H)), as
  we do, but `save_pretrained` and DeepSeek's release write one tensor per expert
  (`mlp.experts.{e}.{gate,up,down}_proj.weight`). Both layouts load; `to_hf`
  writes the per-expert one (what transformers itself writes) unless asked.
- multi-token prediction: our `mtp.{k}.{enorm,hnorm,eh_proj,block.*,norm}` is
  DeepSeek's `model.layers.{L + k}.{enorm,hnorm,eh_proj,*,shared_head.norm}`;
  DeepSeek also stores copies of the embedding and output head there
  (`embed_tokens`, `shared_head.head`), which we write and skip on reading.
  transformers' DeepseekV3ForCausalLM ignores these keys.
- FP8 checkpoints (DeepSeek's release: `quantization_config.quant_method: fp8`,
  `weight_scale_inv` per 128x128 block) are dequantized on load.

Every failure is an `HFFormatError` (a ValueError) with one sentence naming the
field, key or file at fault.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ConfigError, ModelConfig, config_from_dict
from .models.registry import ARCHS

PathLike = Union[str, os.PathLike]


class HFFormatError(ValueError):
    """A checkpoint or config we cannot read or write; the message is one sentence."""


# ----------------------------------------------------------------------------- config mapping

MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "llama": "llama3"}
ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "LlamaForCausalLM": "llama3"}
HF_CLASS = {"deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"), "llama3": ("llama", "LlamaForCausalLM")}

# transformers' defaults (DeepseekV3Config / LlamaConfig) for fields a config.json may leave out
HF_DEFAULTS = {
    "deepseek_v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
        norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, initializer_range=0.02,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True, attention_bias=False,
        num_nextn_predict_layers=1,
    ),
    "llama3": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
        initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, head_dim=None,
    ),
}
COMMON_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                 "tie_word_embeddings", "attention_bias")
DEEPSEEK_FIELDS = ("moe_intermediate_size", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
                   "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
                   "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
                   "rope_interleave", "num_nextn_predict_layers")
LLAMA_FIELDS = ("num_key_value_heads", "head_dim")
# our training-only model fields; to_hf keeps them under this key so a round trip restores them
EXTRA_KEY = "moe_trainer"
TRAINING_FIELDS = {
    "deepseek_v3": ("bias_update_speed", "seq_aux_loss_alpha", "router_z_loss_coef", "capacity_factor", "moe_impl",
                    "mtp_loss_weight"),
    "llama3": (),
}
# RoPE variants we implement, with the rope_parameters keys each reads (rope_theta apart)
ROPE_KEYS = {
    "default": set(),
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def _arch_of(hf: dict) -> str:
    model_type = hf.get("model_type")
    if model_type is not None:
        if model_type not in MODEL_TYPES:
            raise HFFormatError(f"config.json field model_type is {model_type!r}; supported model types are "
                                f"{', '.join(MODEL_TYPES)}.")
        return MODEL_TYPES[model_type]
    archs = hf.get("architectures") or []
    for name in archs:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise HFFormatError(f"config.json names no supported architecture (model_type missing, architectures={archs}); "
                        f"supported: {', '.join(ARCHITECTURES)}.")


def _rope_from_hf(hf: dict, max_position_embeddings: int) -> tuple[float, Optional[dict]]:
    """HF rope_parameters (or the legacy rope_scaling + rope_theta) -> (rope_theta, our rope_scaling)."""
    # transformers lets a legacy rope_scaling override rope_parameters
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(field) or {}
    if not isinstance(params, dict):
        raise HFFormatError(f"config.json field {field} must be a mapping, got {params!r}.")
    if any(isinstance(v, dict) for v in params.values()):
        raise HFFormatError(f"config.json field {field} holds per-layer-type RoPE settings, which "
                            f"{_arch_of(hf)} does not use.")
    params = dict(params)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind not in ROPE_KEYS:
        raise HFFormatError(f"config.json field {field}.rope_type is {kind!r}; supported RoPE types are "
                            f"{', '.join(ROPE_KEYS)}.")
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFFormatError(f"config.json field partial_rotary_factor is {partial}; only full rotary (1.0) is "
                            f"supported.")
    unknown = sorted(set(params) - ROPE_KEYS[kind])
    if unknown:
        raise HFFormatError(f"config.json field {field} has keys {', '.join(unknown)} that {kind} RoPE does not "
                            f"use; valid keys are {', '.join(sorted(ROPE_KEYS[kind])) or 'none'}.")
    if kind == "default":
        return theta, None
    # transformers' standardisation: the pre-scaling context defaults to max_position_embeddings
    original = params.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings",
                                                                            max_position_embeddings))
    if params.get("factor") is None:
        if kind != "yarn":
            raise HFFormatError(f"config.json field {field}.factor is required for {kind} RoPE.")
        params["factor"] = max_position_embeddings / original
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise HFFormatError(f"config.json field {field}.{key} is required for llama3 RoPE.")
    return theta, {"rope_type": kind, **params}


def _check_supported(hf: dict, arch: str) -> None:
    """Settings that change the model's function but that we do not implement."""
    if hf.get("mlp_bias"):
        raise HFFormatError("config.json field mlp_bias is true; only bias-free MLPs are supported.")
    if arch == "deepseek_v3":
        checks = {"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",), "moe_layer_freq": (1,)}
        for key, valid in checks.items():
            if key in hf and hf[key] not in valid:
                raise HFFormatError(f"config.json field {key} is {hf[key]!r}; DeepSeek-V3 import supports "
                                    f"{', '.join(map(str, valid))}.")
    quant = hf.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "fp8":
        raise HFFormatError(f"config.json field quantization_config.quant_method is {quant.get('quant_method')!r}; "
                            f"only fp8 (block-scaled, as DeepSeek released) checkpoints can be read.")


def hf_config_to_model_config(hf: dict) -> ModelConfig:
    """A Hugging Face config.json dict -> our validated ModelConfig.

    Fields absent from the dict take transformers' defaults for the architecture.
    `num_nextn_predict_layers` is what the config declares; `from_hf` lowers it to
    0 when the checkpoint holds no MTP weights (transformers' own save_pretrained
    writes none).
    """
    if not isinstance(hf, dict):
        raise HFFormatError("config.json must hold a JSON object.")
    arch = _arch_of(hf)
    _check_supported(hf, arch)
    defaults = HF_DEFAULTS[arch]
    fields = COMMON_FIELDS + (DEEPSEEK_FIELDS if arch == "deepseek_v3" else LLAMA_FIELDS)
    values = {"arch": arch}
    for key in fields:
        value = hf.get(key, defaults[key])
        if key == "num_nextn_predict_layers":
            value = hf.get(key, hf.get("num_mtp_layers", defaults[key]))
        values[key] = value
    if arch == "deepseek_v3":
        values["n_group"] = values["n_group"] or 1
        values["topk_group"] = values["topk_group"] or 1
    else:
        head_dim = values["head_dim"]
        if head_dim is not None and head_dim * values["num_attention_heads"] == values["hidden_size"]:
            values["head_dim"] = None  # the default, kept implicit
        if values["num_key_value_heads"] == values["num_attention_heads"]:
            values["num_key_value_heads"] = None
    values["rope_theta"], values["rope_scaling"] = _rope_from_hf(hf, values["max_position_embeddings"])
    extra = hf.get(EXTRA_KEY) or {}
    values.update({k: v for k, v in extra.items() if k in TRAINING_FIELDS[arch]})
    return _validated(values)


def _validated(model_values: dict) -> ModelConfig:
    """Type-check and validate through the config tree (its messages name model.<field>)."""
    n_mtp = model_values.get("num_nextn_predict_layers", 0) or 0
    train = {"seq_len": 1, "micro_batch_size": 1, "global_batch_size": 1}
    if model_values.get("max_position_embeddings", 1) <= n_mtp:
        raise HFFormatError(f"config.json field max_position_embeddings ({model_values['max_position_embeddings']}) "
                            f"must exceed num_nextn_predict_layers ({n_mtp}).")
    try:
        return config_from_dict({"model": model_values, "train": train}).model
    except ConfigError as e:
        raise HFFormatError(f"config.json is not a model we can build: {e}") from None


def _rope_to_hf(cfg: ModelConfig) -> dict:
    scaling = dict(cfg.rope_scaling or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    return {"rope_type": kind, "rope_theta": cfg.rope_theta, **scaling}


def model_config_to_hf(cfg: ModelConfig) -> dict:
    """Our ModelConfig -> a config.json dict that transformers' AutoConfig reads."""
    model_type, architecture = HF_CLASS[cfg.arch]
    hf = {"architectures": [architecture], "model_type": model_type}
    hf.update({key: getattr(cfg, key) for key in COMMON_FIELDS})
    hf["rope_parameters"] = _rope_to_hf(cfg)
    if cfg.arch == "deepseek_v3":
        if cfg.scoring_func != "sigmoid":
            raise HFFormatError(f"model.scoring_func {cfg.scoring_func!r} has no Hugging Face DeepSeek-V3 "
                                f"equivalent (its router always uses sigmoid).")
        hf.update({key: getattr(cfg, key) for key in DEEPSEEK_FIELDS})
        # MLA gives every head its own keys; transformers repeats kv heads num_attention_heads / this times
        hf["num_key_value_heads"] = cfg.num_attention_heads
    else:
        hf["num_key_value_heads"] = cfg.num_key_value_heads or cfg.num_attention_heads
        hf["head_dim"] = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        hf["mlp_bias"] = False
    if TRAINING_FIELDS[cfg.arch]:
        hf[EXTRA_KEY] = {key: getattr(cfg, key) for key in TRAINING_FIELDS[cfg.arch]}
    return hf


# ----------------------------------------------------------------------------- names

_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.*)$")
_MTP_KEY = re.compile(r"^mtp\.(\d+)\.(.*)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.")
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # DeepSeek's copies of the main ones
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")  # derived buffers some old checkpoints carry


def hf_to_our_name(name: str, num_hidden_layers: int) -> Optional[str]:
    """HF key -> our key (None: a key we skip on purpose). Experts stay per-expert here."""
    if name == "lm_head.weight":
        return name
    if not name.startswith("model."):
        return "?" + name  # unknown: reported as unexpected
    rest = name[len("model."):]
    m = _LAYER_KEY.match(rest)
    if m is None or int(m[1]) < num_hidden_layers:
        return rest
    k, sub = int(m[1]) - num_hidden_layers, m[2]
    if sub in _MTP_COPIES:
        return None
    if sub.startswith(_MTP_OWN):
        return f"mtp.{k}.{sub}"
    if sub.startswith("shared_head.norm."):
        return f"mtp.{k}.norm.{sub[len('shared_head.norm.'):]}"
    return f"mtp.{k}.block.{sub}"


def our_to_hf_name(name: str, num_hidden_layers: int) -> str:
    if name == "lm_head.weight":
        return name
    m = _MTP_KEY.match(name)
    if m is None:
        return "model." + name
    layer, sub = num_hidden_layers + int(m[1]), m[2]
    if sub.startswith("block."):
        sub = sub[len("block."):]
    elif sub.startswith("norm."):
        sub = "shared_head." + sub
    return f"model.layers.{layer}.{sub}"


# ----------------------------------------------------------------------------- reading

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


def load_checked(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
                 name_of=lambda k: k, optional_prefix: Optional[str] = None) -> None:
    """Copy `state` (our names) into `model` after checking key set and shapes; errors name keys via `name_of`.
    Keys under `optional_prefix` may be absent (they keep their initial values)."""
    expected = model.state_dict()
    optional = {"lm_head.weight"} if getattr(model.cfg, "tie_word_embeddings", False) else set()
    if optional_prefix:
        optional |= {k for k in expected if k.startswith(optional_prefix)}
    missing = sorted(name_of(k) for k in expected.keys() - state.keys() - optional)
    unexpected = sorted(name_of(k) for k in state.keys() - expected.keys())
    if missing:
        raise HFFormatError(f"{source} is missing {len(missing)} key(s) the config needs: {_listing(missing)}.")
    if unexpected:
        raise HFFormatError(f"{source} has {len(unexpected)} key(s) the config does not have: "
                            f"{_listing(unexpected)}.")
    for key, t in state.items():
        if tuple(t.shape) != tuple(expected[key].shape):
            raise HFFormatError(f"{source}: {name_of(key)} has shape {tuple(t.shape)} but the config implies "
                                f"{tuple(expected[key].shape)}.")
        if not (t.is_floating_point() or t.dtype == expected[key].dtype):
            raise HFFormatError(f"{source}: {name_of(key)} has dtype {t.dtype}, expected a floating point tensor.")
    # tied: lm_head is embed_tokens; a stored copy of the head is not loaded over it
    model.load_state_dict({k: t for k, t in state.items() if k not in optional}, strict=False)


def read_config(path: PathLike) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HFFormatError(f"{file} does not exist; a Hugging Face checkpoint directory needs config.json.")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{file} is not valid JSON ({e}).") from None


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


# ----------------------------------------------------------------------------- writing

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
    if path.exists() and not (path.is_dir() and not any(path.iterdir())) and not overwrite:
        raise HFFormatError(f"{path} already exists and is not an empty directory; choose another output path.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        _write_dir(tmp, hf_cfg, tensors, max_shard_bytes)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


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


# ----------------------------------------------------------------------------- the tokenizer of an export

def special_token_ids(tokenizer_dir: PathLike) -> dict[str, int]:
    """{"bos_token_id": .., "eos_token_id": .., "pad_token_id": ..} (those it names) of a directory
    holding tokenizer.json + tokenizer_config.json (a token directory, a run directory, an export)."""
    d = Path(tokenizer_dir)
    tok, cfg = _read_tokenizer(d)
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab = tok.get("model", {}).get("vocab")
    out = {}
    for kind in ("bos", "eos", "pad"):
        text = cfg.get(f"{kind}_token")
        text = text.get("content") if isinstance(text, dict) else text
        if text is None:
            continue
        found = ids.get(text, vocab.get(text) if isinstance(vocab, dict) else None)
        if found is None:
            raise HFFormatError(f"{d / 'tokenizer_config.json'} names {kind}_token {text!r}, which its "
                                f"tokenizer.json does not hold.")
        out[f"{kind}_token_id"] = found
    return out


def _read_tokenizer(d: Path) -> tuple[dict, dict]:
    try:
        return (json.loads((d / "tokenizer.json").read_text(encoding="utf-8")),
                json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        raise HFFormatError(f"{d} has no readable tokenizer.json and tokenizer_config.json ({e}).") from None


def tokenizer_size(tokenizer_dir: PathLike) -> int:
    """1 + the largest id a tokenizer.json can produce (its vocabulary and added tokens)."""
    tok, _ = _read_tokenizer(Path(tokenizer_dir))
    vocab = tok.get("model", {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: a list of pieces
    return 1 + max(ids + [t["id"] for t in tok.get("added_tokens", [])])


def export_tokenizer(export_dir: PathLike, tokenizer_dir: PathLike) -> dict[str, int]:
    """Give a Hugging Face export its tokenizer: tokenizer.json + tokenizer_config.json copied from
    `tokenizer_dir`, their BOS / EOS ids written into config.json and generation_config.json
    (there with a pad id: the tokenizer's, else EOS), each file replaced atomically; then
    AutoTokenizer.from_pretrained and generate work on the export. Returns the ids. A tokenizer
    with ids beyond the model's vocab_size (not the one it was trained with) is refused."""
    export_dir, src = Path(export_dir), Path(tokenizer_dir)
    ids = special_token_ids(src)
    config = json.loads((export_dir / "config.json").read_text())
    if tokenizer_size(src) > config["vocab_size"]:
        raise HFFormatError(f"the tokenizer in {src} has {tokenizer_size(src)} ids, more than the model's vocab_size "
                            f"({config['vocab_size']}); it is not the tokenizer this model was trained with.")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        _atomic_write(export_dir / name, (src / name).read_bytes())
    # no pad_token_id in config.json: transformers makes it the embedding's padding_idx
    config.update({k: v for k, v in ids.items() if k != "pad_token_id"})
    _atomic_write(export_dir / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    generation = {**ids, "pad_token_id": ids.get("pad_token_id", ids.get("eos_token_id"))}
    _atomic_write(export_dir / "generation_config.json", (json.dumps(generation, indent=2) + "\n").encode())
    return ids


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- our own weight files

def load_weights_file(model: torch.nn.Module, path: PathLike) -> None:
    """Load a safetensors file keyed by our names, or a run checkpoint directory
    (checkpoints/step_N/), into `model` (the whole model or one rank's part of it)."""
    from . import init_from
    path = Path(path)
    if init_from.is_run_checkpoint(path):
        return init_from.load_run_checkpoint(model, model.cfg, path)
    if not path.is_file():
        raise HFFormatError(f"weights {path} is neither a safetensors file nor a checkpoint directory with a "
                            f"manifest.json.")
    init_from.load_weights_file(model, model.cfg, path)


# fields that only shape training here, not the weights' meaning
_TRAINING_ONLY = {"bias_update_speed", "seq_aux_loss_alpha", "router_z_loss_coef", "capacity_factor", "moe_impl",
                  "mtp_loss_weight", "initializer_range", "max_position_embeddings"}


def load_initial_weights(model: torch.nn.Module, path: PathLike) -> None:
    """train.init_from: continue a Hugging Face DeepSeek-V3 / Llama checkpoint
    directory, a safetensors file of our names, or a run checkpoint directory.
    A Hugging Face directory must describe the same architecture as model.*.
    `model` may be one rank's part (a stage, its experts, its TP shards): only the rows it
    holds are read (init_from.py)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return load_weights_file(model, path)
    check_same_model(model.cfg, hf_dir_model(path), [f.name for f in dataclasses.fields(ModelConfig)], path)
    from .init_from import load_hf_dir
    load_hf_dir(model, model.cfg, path)


def hf_dir_model(path: PathLike) -> ModelConfig:
    """The model the config.json of Hugging Face directory `path` (train.init_from) describes."""
    try:
        return hf_config_to_model_config(read_config(path))
    except HFFormatError as e:
        raise HFFormatError(f"train.init_from {path}: {e}") from None


def init_from_model(path: PathLike, command: ModelConfig, given: Iterable[str]) -> ModelConfig:
    """The model section of a run that starts from Hugging Face directory `path`: its config.json's
    fields, and the command's values of the fields it sets itself (`given`), each of which must agree
    with config.json (check_same_model); vocab_size auto takes the directory's."""
    theirs = hf_dir_model(path)
    mine = {name: getattr(command, name) for name in given if getattr(command, name) != "auto"}
    model = dataclasses.replace(theirs, **mine)
    check_same_model(model, theirs, mine, path)
    return model


def check_same_model(ours: ModelConfig, theirs: ModelConfig, names: Iterable[str], path: PathLike) -> None:
    """Each of `names` (model fields) is the same in `ours` as in `theirs`, the model of Hugging Face
    directory `path`, else one sentence naming the first that is not. Fields that only shape training
    may differ, and so may num_nextn_predict_layers over a directory without MTP (its modules start
    from their initialisation)."""
    names = set(names)
    for name in [f.name for f in dataclasses.fields(ModelConfig) if f.name in names]:  # model.arch first
        if name in _TRAINING_ONLY or _value(ours, name) == _value(theirs, name):
            continue
        if name == "num_nextn_predict_layers" and theirs.num_nextn_predict_layers == 0:
            continue
        raise HFFormatError(f"model.{name} is {_value(ours, name)!r}, but the config.json of train.init_from "
                            f"{path} gives {_value(theirs, name)!r}; leave model.{name} unset to take the "
                            f"directory's value.")


def _value(cfg: ModelConfig, name: str):
    """A model field, with the fields whose None stands for a default (Llama's GQA) spelled out."""
    if name == "num_key_value_heads":
        return cfg.num_key_value_heads or cfg.num_attention_heads
    if name == "head_dim":
        return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    return getattr(cfg, name)


def save_weights_file(model: torch.nn.Module, path: PathLike) -> Path:
    """Our state dict -> one safetensors file (our names, as a run checkpoint's model.safetensors:
    a tied lm_head is not stored twice), written to a temp file and renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tied = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()
    tensors = {k: t.detach().cpu().contiguous().clone() for k, t in model.state_dict().items() if k not in tied}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def model_yaml(cfg: ModelConfig) -> str:
    """A config file holding just this model section (load_config fills in the rest)."""
    import yaml
    return yaml.safe_dump({"model": dataclasses.asdict(cfg)}, sort_keys=False)


def save_model_yaml(cfg: ModelConfig, path: PathLike) -> Path:
    """`model_yaml` written to a temp file and renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(model_yaml(cfg))
    os.replace(tmp, path)
    return path


__all__ = ["HFFormatError", "from_hf", "to_hf", "hf_config_to_model_config", "model_config_to_hf",
           "init_from_model", "hf_state_dict", "convert_hf_state_dict", "load_weights_file", "save_weights_file",
           "model_yaml", "save_model_yaml", "export_tokenizer", "special_token_ids", "tokenizer_size"]
