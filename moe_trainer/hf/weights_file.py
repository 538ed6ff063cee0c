"""Our own weight files: a safetensors file of our names (what tools/convert_hf.py import writes),
the model YAML beside it, and train.init_from, which also takes a Hugging Face directory or a
run checkpoint."""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from .config_json import hf_config_to_model_config, read_config
from .errors import HFFormatError, PathLike

def load_weights_file(model: torch.nn.Module, path: PathLike) -> None:
    """Load a safetensors file keyed by our names, or a run checkpoint directory
    (checkpoints/step_N/), into `model` (the whole model or one rank's part of it)."""
    from .. import init_from
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
    theirs = hf_config_to_model_config(read_config(path))
    ours = model.cfg
    differ = [f.name for f in dataclasses.fields(ours) if f.name not in _TRAINING_ONLY
              and getattr(ours, f.name) != getattr(theirs, f.name)
              and not (f.name == "num_nextn_predict_layers" and getattr(theirs, f.name) == 0)]
    if differ:
        name = differ[0]
        raise HFFormatError(f"train.init_from {path} has {name}={getattr(theirs, name)!r} but model.{name} is "
                            f"{getattr(ours, name)!r}; use the model section tools/convert_hf.py import writes.")
    from ..init_from import load_hf_dir
    load_hf_dir(model, ours, path)


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
