"""The resolve step above the config: what a config names outside its YAML, read and checked.

config.py parses, types and validates a config from its YAML and --set lines alone. Here the
values that depend on files are resolved before the config is validated: a Hugging Face
directory in train.init_from gives the model section (its config.json), model.vocab_size auto
becomes the data's vocabulary, data.sources entries get their names, and data.tokenizer and the
fault specs of debug.faults are checked. train, restart, the dry run, plan and the tools load
their configs here (load_config); run_dir reads a run directory's config.yaml here
(config_from_dict).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from .config import Config, ConfigError, given_keys, is_number, read_config, typed_config, validate


class DataVocabError(ConfigError):
    """model.vocab_size auto could not be resolved from the config's data (which a resume may take
    from the run directory's config.yaml instead)."""


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, check_data: bool = False,
                read_init_from: bool = False, resolve_data: bool = True) -> Config:
    """Defaults <- YAML file <- `--set` overrides (config.read_config), resolved, then validated.

    `read_init_from` (a run's start, tools/plan.py): a Hugging Face directory in train.init_from
    gives the model section (resolve_init_from), so its precedence is defaults <- the directory's
    config.json <- the file's and the overrides' model fields, which must agree with it.
    `resolve_data=False` leaves model.vocab_size auto unresolved (a resume's command, whose data
    keys may be in the run directory's config.yaml only: the merge resolves it)."""
    cfg = read_config(path, overrides)
    if read_init_from:
        resolve_init_from(cfg, given_keys(path, overrides))
    if resolve_data:
        resolve_auto(cfg, check_data)
    else:
        resolve_sources(cfg)
    check(cfg)
    return cfg


def config_from_dict(data: dict) -> Config:
    """A config tree from nested dicts (a run directory's config.yaml, a resume's merge), resolved
    and validated as load_config's is."""
    cfg = typed_config(data)
    resolve_auto(cfg)
    check(cfg)
    return cfg


def check(cfg: Config) -> None:
    """config.validate, then the checks that read more than the config: data.tokenizer exists, and
    debug.faults parses (faults.parse_faults)."""
    validate(cfg)
    _require(not cfg.data.tokenizer or Path(cfg.data.tokenizer).exists(),
             f"data.tokenizer {cfg.data.tokenizer} does not exist (give a tokenizer.json or a Hugging Face "
             f"tokenizer directory).")
    check_overlap(cfg)
    from .faults import FaultSpecError, parse_faults
    try:
        parse_faults(cfg.debug.faults)
    except FaultSpecError as e:
        raise ConfigError(str(e)) from None


def check_overlap(cfg: Config) -> None:
    """parallel.overlap=a2a where the overlapped executor (parallel/overlap.py; at pp > 1 the pipeline
    executor's interleaved 1F1B pairs) runs; auto (the default) stays auto there (overlap_runs decides per
    device: train.resolve_device_settings) and becomes none elsewhere; debug.link_* >= 0."""
    d = cfg.debug
    _require(is_number(d.link_gbps) and d.link_gbps >= 0 and is_number(d.link_latency_us) and d.link_latency_us >= 0,
             f"debug.link_gbps and debug.link_latency_us must be numbers >= 0 (0 = off), got {d.link_gbps!r} and "
             f"{d.link_latency_us!r}.")
    p, m = cfg.parallel, cfg.model
    if p.overlap == "none":
        return
    why = ("model.arch is llama3, which has no all-to-all to hide" if m.arch != "deepseek_v3" else
           "parallel.ep is 1: there is no all-to-all to hide" if p.ep == 1 else
           "parallel.schedule is gpipe: at pp > 1 the overlapped pairs are interleaved 1F1B's" if p.pp > 1 and
           p.schedule != "1f1b" else
           "parallel.pp > 1 and parallel.virtual_stages is 1: plain 1F1B's overlapped pairs would make neighbouring "
           "stages wait for each other's whole pair, half the steady state's speed (set parallel.virtual_stages >= 2 "
           "for interleaved 1F1B)" if p.pp > 1 and p.virtual_stages == 1 else
           "parallel.tp or parallel.cp > 1: the overlapped executor runs without tensor or context parallelism"
           if p.tp > 1 or p.cp > 1 else None)
    if p.overlap == "auto":
        p.overlap = "auto" if why is None else "none"
        return
    _require(why is None, f"parallel.overlap=a2a cannot run here: {why}; set parallel.overlap=none.")


def overlap_runs(cfg: Config, device_type: str = "cuda") -> bool:
    """Whether parallel.overlap, as check_overlap left it, runs the overlapped executor on ranks of
    `device_type` (the planner and the dry run plan CUDA ranks): a2a always; auto on accelerators
    only where the run stays eager (train.compile false, or auto off CUDA). Where it compiles, the
    compiled blocking path is the one a GPU has measured (2x eager on an H200) and the planner
    predicts an eager overlapped run host-bound, 0.35x of it (moe_1b_8gpu on H100); overlapped and
    compiled regions (parallel.overlap a2a with train.compile true, predicted 1.19x) wait for a GPU to
    measure them. Between CPU ranks there is nothing to hide (train.resolve_device_settings)."""
    o = cfg.parallel.overlap
    if o != "auto":
        return o == "a2a"
    compiles = cfg.train.compile is True or (cfg.train.compile == "auto" and device_type == "cuda")
    return device_type != "cpu" and not compiles


def settle_overlap(cfg: Config, device_type: str) -> None:
    """parallel.overlap auto made a2a or none for ranks of `device_type` (overlap_runs)."""
    if cfg.parallel.overlap == "auto":
        cfg.parallel.overlap = "a2a" if overlap_runs(cfg, device_type) else "none"


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def resolve_init_from(cfg: Config, given: set[str]) -> None:
    """train.init_from, checked before any process group: it must exist, and a directory must be a
    Hugging Face checkpoint (config.json) or a run checkpoint (manifest.json). A Hugging Face
    directory's config.json gives the model section: the family (model_type / architectures) and
    every field the command does not set itself (`given`: given_keys). A field the command sets
    must agree with config.json, unless it only shapes training (bias_update_speed, moe_impl,
    max_position_embeddings, ...); vocab_size auto takes the directory's (hf.init_from_model)."""
    if not cfg.train.init_from:
        return
    path = Path(cfg.train.init_from)
    _require(path.exists(), f"train.init_from {path} does not exist.")
    if not path.is_dir() or (path / "manifest.json").is_file():
        return  # a safetensors file of our names or a run checkpoint: the config describes the model
    _require((path / "config.json").is_file(),
             f"train.init_from {path} is a directory with neither config.json (a Hugging Face checkpoint) nor "
             f"manifest.json (a run checkpoint).")
    from .hf import HFFormatError, init_from_model
    try:
        cfg.model = init_from_model(path, cfg.model, [k.split(".", 1)[1] for k in given if k.startswith("model.")])
    except HFFormatError as e:
        raise ConfigError(str(e)) from None


SOURCE_KEYS = {"data.sources": ("path", "weight", "name"), "data.val_sources": ("path", "name")}


def resolve_sources(cfg: Config) -> None:
    """data.sources and data.val_sources checked and completed in place: every entry gets its
    name (the path's basename unless given), so config.yaml records the names metrics use."""
    from .data import source_name
    d = cfg.data
    _require(not (d.sources and d.path), "data.path and data.sources exclude each other: give one token set as "
             "data.path or a mixture as data.sources.")
    _require(not d.val_sources or d.sources, "data.val_sources needs data.sources (a mixture).")
    for key, entries in (("data.sources", d.sources), ("data.val_sources", d.val_sources)):
        valid = SOURCE_KEYS[key]
        names = []
        for i, e in enumerate(entries):
            where = f"{key}[{i}]"
            _require(isinstance(e, dict), f"{where} must be a mapping with keys {', '.join(valid)}, got {e!r}.")
            unknown = sorted(set(e) - set(valid))
            if unknown:
                raise ConfigError(f"unknown key {where}.{unknown[0]}; valid keys here are: {', '.join(valid)}.")
            _require(isinstance(e.get("path"), str) and e["path"] != "",
                     f"{where}.path must name a token directory or a Megatron prefix, got {e.get('path')!r}.")
            if "weight" in valid:
                w = e.get("weight")
                _require(is_number(w) and 0 < w < math.inf,
                         f"{where}.weight must be a positive number, got {w!r}.")
            _require(e.get("name") is None or (isinstance(e["name"], str) and e["name"] != ""),
                     f"{where}.name must be a non-empty string, got {e.get('name')!r}.")
            e["name"] = source_name(e)
            _require(e["name"] not in names,
                     f"{key} names {e['name']!r} twice; give each entry its own name.")
            names.append(e["name"])


def resolve_auto(cfg: Config, check_data: bool = False) -> None:
    """model.vocab_size=auto -> the vocabulary of data.path (read from its index.json; 320 for
    the default corpus). Explicit values stay; `check_data` (the trainer's start) holds them
    against the data's vocabulary now, else the data checks them when it opens (a model
    built from a Hugging Face config.json has no data to ask)."""
    resolve_sources(cfg)
    if cfg.model.vocab_size == "auto":
        from .data import DataError, run_vocab_size
        try:
            cfg.model.vocab_size = run_vocab_size(cfg.data)
        except DataError as e:
            raise DataVocabError(f"model.vocab_size is auto, but {e}") from None
    elif check_data and isinstance(cfg.model.vocab_size, int):  # an explicit value: at least the data's
        # (when the data is there to ask; any other value is config.validate's to refuse)
        from .data import DataError, run_vocab_size
        try:
            need = run_vocab_size(cfg.data)
        except DataError:
            return
        _require(cfg.model.vocab_size >= need,
                 f"model.vocab_size ({cfg.model.vocab_size}) is below the data's vocab_size ({need}); set "
                 f"model.vocab_size=auto (the data's vocabulary) or at least {need}.")
