"""config.json <-> ModelConfig: transformers' DeepseekV3Config / LlamaConfig fields mapped to ours,
transformers' defaults for fields a config.json leaves out, the RoPE variants, our training-only
fields kept under one key so that a round trip restores them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..config import ConfigError, ModelConfig, is_number, typed_config, validate
from .errors import HFFormatError, PathLike

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
    theta = params.pop("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA))
    if not is_number(theta):
        raise HFFormatError(f"config.json field rope_theta must be a number, got {theta!r}.")
    theta = float(theta)
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind not in ROPE_KEYS:
        raise HFFormatError(f"config.json field {field}.rope_type is {kind!r}; supported RoPE types are "
                            f"{', '.join(ROPE_KEYS)}.")
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFFormatError(f"config.json field partial_rotary_factor is {partial!r}; only full rotary (1.0) is "
                            f"supported.")
    for key, value in params.items():
        if key != "truncate" and value is not None and not is_number(value):
            raise HFFormatError(f"config.json field {field}.{key} must be a number, got {value!r}.")
    unknown = sorted(set(params) - ROPE_KEYS[kind])
    if unknown:
        raise HFFormatError(f"config.json field {field} has keys {', '.join(unknown)} that {kind} RoPE does not "
                            f"use; valid keys are {', '.join(sorted(ROPE_KEYS[kind])) or 'none'}.")
    if kind == "default":
        return theta, None
    # transformers' standardisation: the pre-scaling context defaults to max_position_embeddings
    original = params.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings",
                                                                            max_position_embeddings))
    for key, value in (("max_position_embeddings", max_position_embeddings),
                       ("original_max_position_embeddings", original)):
        if not is_number(value):
            raise HFFormatError(f"config.json field {key} must be a number, got {value!r}.")
    if params.get("factor") is None:
        if kind != "yarn":
            raise HFFormatError(f"config.json field {field}.factor is required for {kind} RoPE.")
        params["factor"] = max_position_embeddings / original
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise HFFormatError(f"config.json field {field}.{key} is required for llama3 RoPE.")
    return theta, {"rope_type": kind, **params}


def standard_rope_scaling(cfg: ModelConfig) -> Optional[dict]:
    """model.rope_scaling as transformers standardises it (rope_type named, its defaults filled in), so
    that two spellings of one RoPE compare equal; a setting it cannot read stays as written."""
    if not cfg.rope_scaling:
        return None
    try:
        return _rope_from_hf({"rope_scaling": dict(cfg.rope_scaling)}, cfg.max_position_embeddings)[1]
    except HFFormatError:
        return dict(cfg.rope_scaling)


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
    train = {"seq_len": 1, "micro_batch_size": 1, "global_batch_size": 1}
    try:
        cfg = typed_config({"model": model_values, "train": train})
        validate(cfg)
        model = cfg.model
    except ConfigError as e:
        raise HFFormatError(f"config.json is not a model we can build: {e}") from None
    if model.vocab_size == "auto":  # the config tree leaves auto to the resolve step: a config.json has no data
        raise HFFormatError("config.json field vocab_size must be a positive integer, got 'auto'.")
    n_mtp = model.num_nextn_predict_layers or 0
    if model.max_position_embeddings <= n_mtp:  # both type-checked by now
        raise HFFormatError(f"config.json field max_position_embeddings ({model.max_position_embeddings}) "
                            f"must exceed num_nextn_predict_layers ({n_mtp}).")
    return model


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


def read_config(path: PathLike) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise HFFormatError(f"{file} does not exist; a Hugging Face checkpoint directory needs config.json.")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{file} is not valid JSON ({e}).") from None
