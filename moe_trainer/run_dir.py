"""The run directory keeps its word: its config.yaml is what a resume continues.

A start that resumes a checkpoint in a run directory with a config.yaml begins
from that saved config. The keys the command gives itself (in its YAML file or a
`--set`) that differ from it are either
- RESUMABLE (layout, length, checkpoint and logging cadence, metrics, debug):
  taken, printed and recorded; or
- anything else (data, model, seed, batch size, optimizer, dtype): they change
  what is trained, so the start stops with one sentence naming the key and both
  values, unless `train.resume_allow` lists the key (or its section).
Keys the command leaves at their defaults keep the saved values, so a forgotten
`--set data.path=...` cannot switch a run's corpus; only PER_JOB keys (when this
job stops, what it resumes, fault injection) are always the command's. A key the
command writes as `auto` is derived, not compared: model.vocab_size follows the
merged data, and a change of it is explained by the data key it follows. A
mixture is compared per source: `data.sources.<name>.weight` for a new weight,
`data.sources.<name>` for a source added or dropped (train.resume_allow takes
either, or `data.sources` for any). `data_fingerprint.json` records each source's
index hash and token count; a resume on changed data is refused.

Every start appends one line to `config_history.jsonl` (time, world, what it
resumed, what changed, the MFU peak used, what it runs on, the whole config) before config.yaml
is replaced, so no config a run ran with is lost. A start also copies the data's
tokenizer files into the run directory and writes `peak_tflops.json`.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from .config import Config, ConfigError, flatten
from .resolve import config_from_dict

RESTART_ENV = "MOE_TRAINER_RESTART"  # "<attempt>:<previous exit code>": set by moe_trainer.restart for restarted attempts

# keys a resume may change: they decide how and how long the same training runs, not what it computes
RESUMABLE = ("run.out_dir", "train.max_steps", "train.stop_at_step", "train.micro_batch_size",
             "train.checkpoint_every", "train.keep_checkpoints", "train.resume", "train.resume_allow",
             "train.init_from", "train.log_every", "train.eval_every", "train.eval_batches", "train.max_nan_skips",
             "train.keep_freed_memory", "train.replica_check_every", "train.spike_guard", "train.straggler_factor",
             "model.moe_impl", "parallel.", "metrics.", "debug.")
# keys of one job, not of the run: always the command's (set or default), never carried over from the saved config
PER_JOB = ("train.stop_at_step", "train.resume", "train.resume_allow", "debug.")
HISTORY = "config_history.jsonl"
FINGERPRINTS = "data_fingerprint.json"  # {source name: {path, hash, tokens}} of the data the run trains on


def resumable(key: str, allow: list) -> bool:
    """May a resume change `key`? RESUMABLE (a trailing dot: a whole section), or listed in
    train.resume_allow (a key, or a section name)."""
    if _matches(key, RESUMABLE):
        return True
    return any(key == a or key.startswith(f"{a}.") for a in allow)


def _matches(key: str, patterns: tuple) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


@dataclass
class Start:
    """What a start does, decided before any process group exists (every rank decides the same)."""

    cfg: Config  # the config this start runs with
    checkpoint: Optional[Path] = None  # to resume from
    changes: dict = field(default_factory=dict)  # key -> (saved value, this start's value), accepted
    fresh_over: bool = False  # a fresh start in a directory that held a run's config
    from_saved: bool = False  # a resume that continues the run directory's config.yaml
    resume: str = "auto"  # the command's train.resume (auto: a damaged newest checkpoint falls back)
    warned: set = field(default_factory=set)  # checkpoints already named in a skip warning
    set_aside: Optional[Path] = None  # where a start from step 0 moved the directory's earlier records


def _load_saved(path: Path) -> Config:
    from .data.loader import derived_tokenizer
    try:
        tree = yaml.safe_load(path.read_text()) or {}
        if isinstance(tree.get("data"), dict) and derived_tokenizer(tree["data"]):
            tree["data"]["tokenizer"] = ""  # recorded from data.path at start (train.plan_run): derived again
        return config_from_dict(tree)
    except (yaml.YAMLError, OSError) as e:
        raise ConfigError(f"the run directory's {path} is unreadable ({str(e).splitlines()[0]}); move it away "
                          f"to start over.") from None
    except ConfigError as e:
        raise ConfigError(f"the run directory's {path} is not a valid config ({e})") from None


def plan_start(cfg: Config, given: Optional[set] = None, warn: bool = True) -> Start:
    """This start: the checkpoint train.resume picks in run.out_dir, and the config to run with.

    `given`: the keys the command set itself (config.given_keys), or them with the values it wrote
    (config.given_values: a key it wrote as auto is then derived, not compared); None counts every
    key as given (a caller that built its Config in code). Raises ConfigError (one sentence) when a
    resume would change what is trained, or the data changed under the run (data_fingerprint.json)."""
    from .checkpoint import find_resume
    out = Path(cfg.run.out_dir)
    warned = set()
    # the manifest and file sizes only: the ranks check the checksums of what each reads (Trainer.find_checkpoint)
    checkpoint = find_resume(out, cfg.train.resume, warn=warn, files_read=lambda path: (), warned=warned)
    saved_file = out / "config.yaml"
    if not saved_file.is_file():
        return Start(cfg, checkpoint, warned=warned)
    if checkpoint is None:
        return Start(cfg, None, fresh_over=True, warned=warned)
    saved = _load_saved(saved_file)
    merged, changes = merge_for_resume(saved, cfg, given, saved_file)
    check_fingerprints(merged, out / FINGERPRINTS)
    return Start(merged, checkpoint, changes, from_saved=True, warned=warned)


def merge_for_resume(saved: Config, now: Config, given, where: Path) -> tuple[Config, dict]:
    """The saved config with the command's differing keys applied, and those changes; a key
    that may not change stops the start. A mixture's changes are judged per source
    (data.sources.<name>.weight, data.sources.<name> for a source added or removed), and
    model.vocab_size written as auto follows the merged data."""
    old, new = flatten(saved.to_dict()), flatten(now.to_dict())
    asked = given if isinstance(given, dict) else {}
    keys = set(new) if given is None else set(given) | {k for k in new if _matches(k, PER_JOB)}
    allow = now.train.resume_allow
    changes, applied = {}, {}
    for key in sorted(keys):
        if key not in old or key not in new or old[key] == new[key]:
            continue
        if new[key] == "auto" or asked.get(key) == "auto":  # derived (train.dtype, model.vocab_size): the saved
            continue  # config holds what auto resolved to; vocab_size is held to the merged data below
        parts = source_changes(old[key], new[key]) if key == "data.sources" else [("", old[key], new[key])]
        if not parts:
            continue  # the same mixture written otherwise: the saved one stays
        for sub, before, after in parts:
            if not resumable(key + sub, allow):
                raise ConfigError(refusal(key + sub, before, after, where))
            changes[key + sub] = (before, after)
        applied[key] = new[key]
    merged = saved.to_dict()
    for key, value in applied.items():
        section, name = key.split(".", 1)
        merged[section][name] = value
    if asked.get("model.vocab_size") == "auto" and any(k.startswith("data.") for k in applied):
        vocab = derived_vocab(saved, merged, [k for k in applied if k.startswith("data.")], allow, where)
        if vocab is not None:
            changes["model.vocab_size"] = (saved.model.vocab_size, vocab)
            merged["model"]["vocab_size"] = vocab
    return config_from_dict(merged), changes


def source_changes(old: list, new: list) -> list[tuple[str, object, object]]:
    """A mixture's changes as (".<name>[.weight|.path]" or "", before, after), by source name; equal
    shares written differently (8/2 and 0.8/0.2) are no change; a new order alone is the whole list's."""
    from .data.mixture import shares
    before, after = {e["name"]: e for e in old}, {e["name"]: e for e in new}
    out = [(f".{n}", before.get(n), after.get(n)) for n in sorted(set(before) ^ set(after))]
    for n in sorted(set(before) & set(after)):
        if before[n]["path"] != after[n]["path"]:
            out.append((f".{n}.path", before[n]["path"], after[n]["path"]))
    if not out and [e["name"] for e in old] == [e["name"] for e in new]:
        if shares([e["weight"] for e in old]) != shares([e["weight"] for e in new]):
            out += [(f".{n}.weight", before[n]["weight"], after[n]["weight"])
                    for n in after if before[n]["weight"] != after[n]["weight"]]
        return out
    return out or [("", old, new)]


def refusal(key: str, before, after, where: Path) -> str:
    if key.startswith("data.sources.") and (before is None or after is None):
        name = key.split(".")[2]
        what = (f"adds source {name!r} ({after['path']}) to data.sources" if before is None else
                f"drops source {name!r} ({before['path']}) from data.sources")
        return (f"this command {what}, which would change what the resumed run trains ({where} has "
                f"{'no such source' if before is None else 'it'}); allow it with --set train.resume_allow=[{key}] "
                f"(or [data.sources] for any mixture change), or start a new run with another run.out_dir.")
    return (f"{key} would change what the resumed run trains ({where} has {before!r}, this command gives "
            f"{after!r}); drop the setting to resume with the saved value, allow the change with --set "
            f"train.resume_allow=[{key}], or start a new run with another run.out_dir (or "
            f"train.resume=none to start over in this one).")


def derived_vocab(saved: Config, merged: dict, data_keys: list, allow: list, where: Path) -> Optional[int]:
    """model.vocab_size written as auto, after an allowed data change: the new data's vocabulary
    (None: the saved model's still fits it). A different one changes the model: refused, naming
    the data key it follows, unless model.vocab_size is allowed too."""
    from .config import DataConfig
    from .data import DataError, run_vocab_size
    data = DataConfig(**merged["data"])
    try:
        vocab = run_vocab_size(data)
    except DataError as e:
        raise ConfigError(f"model.vocab_size is auto, but {e}") from None
    if vocab == saved.model.vocab_size:
        return None
    if resumable("model.vocab_size", allow):
        return vocab
    keys = ", ".join(data_keys)
    raise ConfigError(f"model.vocab_size is auto, so it follows {keys}: the data this command gives has vocabulary "
                      f"{vocab}, the resumed run's model {saved.model.vocab_size} ({where}); resume on data of the "
                      f"run's tokenizer, allow the new model size with --set train.resume_allow=[{keys}, "
                      f"model.vocab_size], or start a new run with another run.out_dir.")


def check_fingerprints(cfg: Config, recorded: Path) -> None:
    """A resume on a token set whose index changed since the run recorded it (its hash or token count) is
    refused, naming the source, unless train.resume_allow lists data.fingerprint.<name>. A source whose
    path the resume changed (allowed) is new data, not changed data."""
    if not recorded.is_file():
        return  # a run from before fingerprints
    from .data import DataError, run_fingerprints
    before = json.loads(recorded.read_text())
    try:
        now = run_fingerprints(cfg.data)
    except (DataError, OSError) as e:
        raise ConfigError(f"the run's data cannot be read ({e})") from None
    for name, fp in now.items():
        old = before.get(name)
        if old is None or old["path"] != fp["path"] or (old["hash"], old["tokens"]) == (fp["hash"], fp["tokens"]):
            continue
        key = f"data.fingerprint.{name}"
        if not resumable(key, cfg.train.resume_allow):
            raise ConfigError(
                f"data source {name!r} ({fp['path'] or 'the default corpus'}) changed since the run recorded it in "
                f"{recorded}: index hash {old['hash']} -> {fp['hash']}, {old['tokens']:,} -> {fp['tokens']:,} "
                f"tokens; restore the data the run trained on, allow it with --set train.resume_allow=[{key}], or "
                f"start a new run with another run.out_dir.")


def describe(start: Start) -> list[str]:
    """Console lines about this start's decisions (rank 0 prints them)."""
    lines = []
    if start.from_saved and start.changes:
        changed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in start.changes.items())
        lines.append(f"resuming with the run directory's config.yaml, changed: {changed} (recorded in {HISTORY})")
    elif start.from_saved:
        lines.append("resuming with the run directory's config.yaml, unchanged")
    elif start.checkpoint is not None:
        lines.append(f"resuming {start.checkpoint} with this command's config (a new run directory)")
    if start.fresh_over:
        lines.append(f"warning: {start.cfg.run.out_dir} holds a run's config.yaml but no checkpoint to resume "
                     f"(train.resume={start.cfg.train.resume}); starting from step 0, its previous configs stay "
                     f"in {HISTORY}")
    if start.set_aside is not None:
        moved = ", ".join(sorted(p.name for p in start.set_aside.iterdir()))
        lines.append(f"starting at step 0: the directory's earlier records ({moved}) are kept in {start.set_aside}")
    return lines


# what a run records as it trains, moved aside (never deleted) when a start in its directory begins at
# step 0: the metrics, the TensorBoard events, the expert counts and the checkpoints it wrote
RECORDS_OF_A_RUN = ("metrics.jsonl", "tensorboard", "expert_load", "checkpoints")
SET_ASIDE = "previous"


def set_aside_records(start: Start) -> Optional[Path]:
    """Rank 0, for a start from step 0 (nothing resumed): the run directory's earlier records move
    into previous/<time>/ (a rename: free, and nothing is lost), so the new run's metrics and
    events never mix with the old ones nor replace them. The directory moved into, or None when
    there was nothing to move."""
    out = Path(start.cfg.run.out_dir)
    found = [name for name in RECORDS_OF_A_RUN if (out / name).exists()]
    if start.checkpoint is not None or not found:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = out / SET_ASIDE / stamp
    n = 1
    while dest.exists():  # two starts within a second
        dest, n = out / SET_ASIDE / f"{stamp}-{n}", n + 1
    dest.mkdir(parents=True)
    for name in found:
        os.replace(out / name, dest / name)
    start.set_aside = dest
    return dest


def record_start(start: Start, world: int, peak: tuple[float, str], data_dir: Optional[Path]) -> None:
    """Rank 0: append this start to config_history.jsonl (its data fingerprints too), then write
    config.yaml, data_fingerprint.json, the data's tokenizer files and peak_tflops.json (each file
    replaced atomically)."""
    from .checkpoint import atomic_write_text
    out = Path(start.cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from .data import run_fingerprints
    fingerprints = run_fingerprints(start.cfg.data)
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "world": world,
             "resumed_from": str(start.checkpoint) if start.checkpoint else None,
             "changes": {k: [old, new] for k, (old, new) in start.changes.items()}, "data": fingerprints,
             "peak_tflops": peak[0], "peak_source": peak[1], "runtime": runtime(), "config": start.cfg.to_dict()}
    saved = out / "config.yaml"
    with open(out / HISTORY, "a") as f:
        if f.tell() == 0 and saved.is_file():  # a run from before the history: keep the config it ran with
            old = yaml.safe_load(saved.read_text())
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(saved.stat().st_mtime)),
                                "note": "config.yaml found before the history began", "config": old}) + "\n")
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
    atomic_write_text(out / "config.yaml", start.cfg.to_yaml())
    atomic_write_text(out / FINGERPRINTS, json.dumps(fingerprints, indent=1) + "\n")
    atomic_write_text(out / "peak_tflops.json", json.dumps({"peak_tflops": peak[0], "source": peak[1],
                                                            "dtype": start.cfg.train.dtype}, indent=1) + "\n")
    copy_tokenizer(data_dir, out)


SHARED_PATIENCE_S = 5.0  # how long a rank looks for rank 0's marker before it says it cannot see it


def check_shared(out: Path, rank: int, world: int, device) -> None:
    """Every rank sees the run directory rank 0 writes (every rank writes its own checkpoint part into
    a directory rank 0 makes, and reads faults.jsonl and the checkpoints back): rank 0 leaves a
    marker named by a token it broadcasts, and each rank looks for it. A rank on a node whose
    run.out_dir is its own local directory is named in one sentence (ConfigError) at start, not by
    a missing file at the first checkpoint. Collective."""
    import secrets
    import socket

    import torch
    import torch.distributed as dist
    if world == 1:
        return
    token = torch.tensor([secrets.randbits(62) if rank == 0 else 0], dtype=torch.int64, device=device)
    dist.broadcast(token, 0)
    mark = Path(out) / f".shared-{int(token.item()):x}"  # host sync, once per start
    if rank == 0:
        mark.write_text(socket.gethostname())
    dist.barrier()
    found, patience = mark.is_file(), time.time() + SHARED_PATIENCE_S
    while not found and time.time() < patience:  # a network filesystem may show a new file late
        time.sleep(0.2)
        found = mark.is_file()
    seen = [None] * world
    dist.all_gather_object(seen, (found, socket.gethostname()))
    dist.barrier()  # every rank has looked
    if rank == 0:
        mark.unlink(missing_ok=True)
    blind = [(r, host) for r, (found, host) in enumerate(seen) if not found]
    if blind:
        ranks = ", ".join(str(r) for r, _ in blind[:16]) + (f" and {len(blind) - 16} more" if len(blind) > 16 else "")
        hosts = ", ".join(sorted({h for _, h in blind})[:4])
        raise ConfigError(f"run.out_dir {os.path.abspath(out)} is not one directory for every rank: rank(s) {ranks} "
                          f"(on {hosts}) do not see what rank 0 wrote there; every rank writes its checkpoint part "
                          f"into it, so put it on storage every node shares.")


def runtime() -> dict:
    """What this start runs on, as rank 0 sees it (the history's `runtime`: the GPU checks read it):
    the device, the process group's back end, the kernel back end and what DS_ACCELERATOR asked for."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from . import kernels
    device = get_accelerator().current_device_name()  # "cuda:0", "cpu": where the trainer put this rank
    return {"device": device, "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "dist_backend": dist.get_backend() if dist.is_initialized() else None,
            "kernels": kernels.backend().name, "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
            "torch": torch.__version__}


def copy_tokenizer(src: Optional[Path], dst: Path) -> list[str]:
    """The tokenizer files (data.TOKENIZER_FILES) of a token or run directory into another one."""
    from .data import TOKENIZER_FILES
    copied = []
    for name in TOKENIZER_FILES:
        if src is not None and (Path(src) / name).is_file():
            tmp = dst / f".{name}.tmp{os.getpid()}"
            shutil.copyfile(Path(src) / name, tmp)
            os.replace(tmp, dst / name)
            copied.append(name)
    return copied


def before_launch(out: Path) -> tuple[Optional[Path], set]:
    """What a launch finds of its run directory: (the outermost of its directories that does not
    exist yet, None when it exists; the names it holds), for undo_refused_start."""
    missing, p = None, Path(out).absolute()
    while not p.exists():
        missing, p = p, p.parent
    return missing, (set(os.listdir(out)) if missing is None else set())


def undo_refused_start(out: Path, before: tuple[Optional[Path], set], ours: tuple = ()) -> None:
    """After a start refused as bad input (exit 2): when the only new entries of the run directory
    are the launch wrapper's own (`ours`: its log), they go, and so do the directories the launch
    made for them, so a refused start leaves no run directory that holds nothing of a run. Anything
    a rank wrote keeps it all."""
    missing, held = before
    out = Path(out).absolute()
    new = set(os.listdir(out)) - held if out.is_dir() else set()
    if not new <= set(ours):
        return
    for name in new:
        (out / name).unlink(missing_ok=True)
    d = out
    while missing is not None and d != missing.parent and d.is_dir() and not any(d.iterdir()):
        d.rmdir()  # only empty directories: another run may have made a sibling meanwhile
        d = d.parent


# a finished run's checkpoint up to this size is verified before any launcher (sha256 at ~1 GB/s);
# a larger one is left to the ranks, which check the files they read in parallel (Trainer)
VERIFY_BEFORE_LAUNCH_BYTES = 4 << 30


def nothing_left(start, verify_up_to: int = VERIFY_BEFORE_LAUNCH_BYTES) -> Optional[str]:
    """The sentence for a start whose run already reached train.max_steps: its newest complete
    checkpoint is at or past it and intact (every checksum, when its files hold at most
    `verify_up_to` bytes). None otherwise, or when only the ranks can tell."""
    from .checkpoint import step_of, verify
    path = start.checkpoint
    if path is None or step_of(path) < start.cfg.train.max_steps:
        return None
    if sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file()) > verify_up_to or verify(path):
        return None
    return finished_sentence(start.cfg, path)


def finished_sentence(cfg, path) -> str:
    from .checkpoint import step_of
    return (f"nothing left to do: {os.path.abspath(cfg.run.out_dir)} already reached step {step_of(path)} "
            f"(checkpoint {path}), and train.max_steps is {cfg.train.max_steps}; raise train.max_steps to train "
            f"on, or start over with train.resume=none.")


# ----------------------------------------------------------------------------- the banner

def parameter_counts(model_cfg) -> tuple[int, int]:
    """(total, activated per token) parameters of the whole model (MTP included), from a meta-device
    build: a token runs num_experts_per_tok of each MoE layer's n_routed_experts."""
    from .models.registry import meta_model
    model = meta_model(model_cfg)
    total = routed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".mlp.experts." in name:
            routed += p.numel()
    idle = routed * (1 - model_cfg.num_experts_per_tok / model_cfg.n_routed_experts) if routed else 0
    return total, int(total - idle)


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def banner(trainer, start: Start) -> str:
    """What this start decided, printed by rank 0 before the first step."""
    cfg, lay = trainer.cfg, trainer.layout
    t, m, p = cfg.train, cfg.model, cfg.parallel
    total, active = parameter_counts(m)
    mine = sum(q.numel() for q in trainer.engine.module.parameters())
    from .data import BYTE_SPECIALS
    from .parallel.order import describe_nodes
    index = trainer.data_index
    splits, tok = index["splits"], index.get("tokenizer", {})
    eos = tok.get("eos_token") or BYTE_SPECIALS.get(tok.get("eos_id"), tok.get("eos_id"))  # older indexes: an id
    data = cfg.data.path or "the default corpus (standard-library .py files as bytes)"
    tokenizer = cfg.data.tokenizer or ("byte-level" if tok.get("type") == "bytes" else "the data's own")
    if cfg.data.sources:
        data = "mixture " + ", ".join(f"{e['name']} {e['weight']:g} ({e['path']})" for e in cfg.data.sources)
    if trainer.resume_from is not None:  # start.checkpoint unless the ranks' checksums refused it
        source = f"resumed from {trainer.resume_from} at step {trainer.step}"
    elif t.init_from:
        source = f"weights from {t.init_from} (train.init_from), step 0"
    else:
        source = f"fresh initialisation from run.seed {cfg.run.seed}, step 0"
    out = Path(cfg.run.out_dir).resolve()
    tokens = t.global_batch_size * t.seq_len
    lines = [
        f"world {lay.world}: dp {lay.dp}, ep {lay.ep} (expert-dp {lay.edp}), pp {lay.pp} "
        f"(virtual stages {getattr(p, 'virtual_stages', 1)}, schedule {p.schedule}), tp {lay.tp}, cp {lay.cp}; "
        f"{lay.grad_accum} micro-batch{'es' if lay.grad_accum != 1 else ''} of {t.micro_batch_size} per step, "
        f"{t.dtype}",
        *describe_nodes(lay, m.n_routed_experts if m.arch == "deepseek_v3" else 0, m.n_group, m.topk_group),
        f"model {m.arch}: {_count(total)} parameters, {_count(active)} activated per token, "
        f"{_count(mine)} on this rank (rank 0); vocab {m.vocab_size}",
        f"tokens per step {tokens:,} ({t.global_batch_size} sequences x {t.seq_len}); {t.max_steps} steps",
        f"data {data}: {splits['train']['num_tokens']:,} train / {splits['val']['num_tokens']:,} val tokens, "
        f"tokenizer {tokenizer}, vocab {index['vocab_size']}, documents end with {eos!r}",
        f"start: {source}",
        f"MFU peak {trainer.peak:.3g} TFLOP/s per rank ({trainer.peak_source})",
        f"run directory {out}  (config history: {HISTORY})",
        *([f"earlier records kept in {start.set_aside}"] if start.set_aside is not None else []),
        f"tensorboard --logdir {out / 'tensorboard'}",
    ]
    return "\n".join(["=" * 20 + " moe_trainer " + "=" * 20, *lines, "=" * 53])


def print_lines(lines: list[str], stream=sys.stdout) -> None:
    for line in lines:
        print(line, file=stream, flush=True)


__all__ = ["RESUMABLE", "HISTORY", "Start", "plan_start", "nothing_left", "finished_sentence", "merge_for_resume",
           "record_start", "set_aside_records", "check_shared", "banner",
           "parameter_counts", "copy_tokenizer", "describe", "resumable", "runtime", "before_launch",
           "undo_refused_start"]
