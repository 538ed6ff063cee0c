"""Our own weight files: a safetensors file of our names (what tools/convert_hf.py import writes),
the model YAML beside it, and the model a Hugging Face directory in train.init_from gives
(init_from.py loads the weights of every train.init_from source)."""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from .config_json import hf_config_to_model_config, read_config, standard_rope_scaling
from .errors import HFFormatError, PathLike


# fields that only shape training here, not the weights' meaning
_TRAINING_ONLY = {"bias_update_speed", "seq_aux_loss_alpha", "router_z_loss_coef", "capacity_factor", "moe_impl",
                  "mtp_loss_weight", "initializer_range", "max_position_embeddings"}


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
    """A model field, with the fields whose None stands for a default (Llama's GQA) spelled out and
    RoPE scaling in its standard form."""
    if name == "num_key_value_heads":
        return cfg.num_key_value_heads or cfg.num_attention_heads
    if name == "head_dim":
        return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    if name == "rope_scaling":
        return standard_rope_scaling(cfg)
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
