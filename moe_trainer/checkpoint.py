"""Checkpoints: sharded, layout-independent safetensors, written by every rank in parallel.

checkpoints/step_<N>/
  part-r<rank>.safetensors  what rank <rank> owns, nothing gathered: its ZeRO-1 fragments of
                            the fp32 master weights and Adam moments (`<name>`,
                            `<name>.exp_avg`, `<name>.exp_avg_sq`; a parameter replicated over
                            tp is written by one tp rank only), the balancing biases of its
                            stage (one rank per stage) and its RNG state (`rng`)
  state.json                step, Adam step, data position, layout, model config
  manifest.json             size and sha256 of every file above (written last)
Names are global (layer and expert ids). Each tensor's entry in its file's header metadata
says where it lies in the global tensor: {"shape": global shape, "box": [offsets, sizes] of
the block the writer held (its experts, its TP shard), "flat": start of the fragment in that
block's row-major order}. A reader assembles whatever block it holds from the pieces that
overlap it, so a checkpoint loads under any pp / ep / dp / tp / cp.

Each rank hashes its own file; rank 0 writes state.json and the manifest from the sizes and
digests the ranks report, then renames the directory into place and moves `latest`. A
directory without a manifest is never resumed from. A resume checks the size of every file
and the checksum of every file, each hashed once by one rank (checkpoint_pick.py); a tool reading
in one process checks those it reads. No pickle is ever read.

Kept whole (over 500 lines): the file format is one contract between the writer and the
readers (the index, the box arithmetic and the manifest checks must change together).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from .models.init import global_view
from .parallel.zero import fp32_partitions
from .tensor_file import TensorFile, write_safetensors

MANIFEST = "manifest.json"
MOMENTS = ("exp_avg", "exp_avg_sq")
BIAS = "e_score_correction_bias"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: one user-facing sentence."""


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def part_name(rank: int) -> str:
    return f"part-r{rank:05d}.safetensors"


# ----------------------------------------------------------------------------- this rank's pieces

def link_optimizer_state(engine) -> None:
    """Make every parameter's ZeRO fragment see its Adam moments.

    DeepSpeed links optimizer state to parameters lazily after the first
    optimizer step, and only for the param groups that had state by then (the
    second group is missed); before any step torch's Adam has no state at all.
    Create missing state as torch's AdamW would (zeros, step 0), then relink.
    Both of DeepSpeed's ZeRO-1 optimizers (DeepSpeedZeroOptimizer, and BF16_Optimizer for bf16 with
    fp32 gradient accumulation) link fragments this way; only their partitions' names differ.
    """
    zero = engine.optimizer
    for flat in fp32_partitions(engine):
        st = zero.optimizer.state[flat]
        if "exp_avg" not in st:
            st["step"] = torch.tensor(0.0, device=flat.device)  # fused AdamW keeps it on the parameter's device
            st["exp_avg"] = torch.zeros_like(flat)
            st["exp_avg_sq"] = torch.zeros_like(flat)
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()


def _where(p: torch.Tensor, flat: int) -> str:
    shape, offsets = global_view(p)
    return json.dumps({"shape": list(shape), "box": [list(offsets), list(p.shape)], "flat": flat})


def local_pieces(trainer) -> tuple[dict, dict]:
    """(tensors, header metadata) this rank writes: its fragments, under global names. The tensors
    are views of the optimizer's fp32 partitions and the stage's buffers (no copies: the writer takes
    them to the host one at a time)."""
    link_optimizer_state(trainer.engine)
    mesh = trainer.mesh
    tensors, meta = {}, {}
    for name, p in trainer.engine.module.named_parameters():
        if mesh.index("tp") != 0 and not getattr(p, "tensor_model_parallel", False):
            continue  # a replica that tp rank 0 (or the first rank sharing a kv head) writes
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            continue  # ZeRO gave this rank no part of p
        where = _where(p, mapping.lp_fragment_address.start)
        for key, suffix in ((None, ""), *((k, f".{k}") for k in MOMENTS)):
            tensors[name + suffix] = mapping.get_hp_fragment(key).detach().float()
            meta[name + suffix] = where
    if mesh.index("dpcp") == 0 and mesh.index("tp") == 0:  # identical on every rank of a stage
        for name, buf in trainer.engine.module.named_buffers():
            if name.endswith(BIAS):
                tensors[name], meta[name] = buf.detach().float(), _where(buf, 0)
    tensors["rng"] = torch.get_rng_state()
    return tensors, meta


def adam_step(engine) -> int:
    for state in engine.optimizer.optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


# ----------------------------------------------------------------------------- save

def save(trainer) -> Optional[Path]:
    """Write checkpoints/step_<N> (collective): every rank its own part, in parallel. Slot-owned experts
    that moved (parallel/slots.py) go home for it and back after, so the names stay expert ids."""
    slots = getattr(trainer, "slots", None)
    with slots.at_home(trainer.engine) if slots is not None else contextlib.nullcontext():
        return _save(trainer)


def _save(trainer) -> Optional[Path]:
    root = trainer.out_dir / "checkpoints"
    final = root / f"step_{trainer.step}"
    tmp = root / f".step_{trainer.step}.tmp"
    rank = trainer.mesh.rank
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    trainer.barrier()
    tensors, meta = local_pieces(trainer)
    part = tmp / part_name(rank)
    digest = write_safetensors(part, tensors, meta)  # one tensor at a time: the part is never in memory whole
    del tensors
    reports = _gather_reports(trainer, part.stat().st_size, digest)
    path = _finish(trainer, tmp, final, reports) if rank == 0 else None
    trainer.barrier()
    return path


def _gather_reports(trainer, size: int, digest: str) -> list[tuple[int, str]]:
    """(bytes, sha256) of every rank's part: one all-gather of 5 int64 per rank."""
    raw = bytes.fromhex(digest)
    # on the rank's device: the default group is NCCL on GPUs, and NCCL takes device tensors only
    mine = torch.tensor([size] + [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 32, 8)],
                        dtype=torch.int64, device=trainer.device)
    world = trainer.layout.world
    if not (dist.is_initialized() and world > 1):
        return [(size, digest)]
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    rows = torch.stack(parts).tolist()  # host sync: once per checkpoint
    return [(int(t[0]), b"".join(int(v).to_bytes(8, "little", signed=True) for v in t[1:]).hex()) for t in rows]


def _finish(trainer, tmp: Path, final: Path, reports: list[tuple[int, str]]) -> Path:
    state = {"step": trainer.step, "adam_step": adam_step(trainer.engine),
             "data_position": trainer.step + trainer.data_offset,
             "arch": trainer.cfg.model.arch, "layout": trainer.layout.__dict__,
             "model": trainer.cfg.to_dict()["model"], "noise_scale": trainer.observers.noise.state_dict(),
             "guards": trainer.guards.state_dict()}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    files = {part_name(r): {"bytes": size, "sha256": digest} for r, (size, digest) in enumerate(reports)}
    f = tmp / "state.json"
    files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    (tmp / MANIFEST).write_text(json.dumps({"step": trainer.step, "world": len(reports), "files": files}, indent=1))
    for name in ("state.json", MANIFEST):
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(final.parent / "latest", final.name + "\n")
    prune(final.parent, trainer.cfg.train.keep_checkpoints)
    return final


def write_model(model: torch.nn.Module, path: Path, step: int = 0) -> Path:
    """A weights-only checkpoint of a whole model in one process (tools and tests): the same
    format, one part, no optimizer state."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors, meta = {}, {}
    named = dict(model.named_parameters())
    named.update({n: b for n, b in model.named_buffers() if n.endswith(BIAS)})
    for name, t in named.items():
        tensors[name], meta[name] = t.detach().float().reshape(-1), _where(t, 0)
    part = tmp / part_name(0)
    digests = {part.name: write_safetensors(part, tensors, meta)}  # hashed on the way: not read back
    del tensors
    state = tmp / "state.json"
    state.write_text(json.dumps({"step": step, "arch": model.cfg.arch}))
    digests[state.name] = sha256(state)
    files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": digests[name]} for name in sorted(digests)}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "world": 1, "files": files}, indent=1))
    os.replace(tmp, path)
    return path


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop leftovers of interrupted writes."""
    steps = sorted((int(p.name.split("_")[1]), p) for p in root.glob("step_*") if p.name.split("_")[1].isdigit())
    for _, p in steps[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- find / verify

def _manifest_files(path: Path) -> tuple[Optional[dict], Optional[str]]:
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None, "it has no manifest (incomplete write)"
    try:
        return json.loads(manifest.read_text())["files"], None
    except (json.JSONDecodeError, KeyError, TypeError):
        return None, "its manifest is unreadable"


def verify(path: Path, read: Optional[Iterable[str]] = None) -> Optional[str]:
    """None if the checkpoint is complete and intact, else why not: every file listed, of its
    size; the checksums of the files in `read` (all of them when None) match."""
    files, problem = _manifest_files(path)
    if problem:
        return problem
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}"
    for name in sorted(files if read is None else read):
        if name in files and sha256(path / name) != files[name]["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _candidates(out_dir: Path) -> list[Path]:
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = [(int(p.name.split("_")[1]), p) for p in root.glob("step_*") if p.name.split("_")[1].isdigit()]
    return [p for _, p in sorted(steps, reverse=True)]


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def find_resume(out_dir: Path, resume: str, warn: bool = True,
                files_read: Optional[Callable[[Path], Iterable[str]]] = None,
                any_rank: Callable[[bool], bool] = lambda bad: bad, at_most: Optional[int] = None,
                warned: Optional[set] = None) -> Optional[Path]:
    """train.resume: none -> None; a path -> that checkpoint (must be valid);
    auto -> the newest complete checkpoint (of step `at_most` or before, if given), skipping broken
    ones with a warning (once: not for the paths in `warned`, to which the warned ones are added).
    `files_read(path)`: the files this rank will read (their checksums are checked here, by this
    rank); `any_rank` makes every rank agree (a checkpoint is refused if any rank finds a fault)."""
    if resume == "none":
        return None

    def problem_of(path: Path) -> Optional[str]:
        if not path.is_dir():
            return "it does not exist"
        problem = verify(path, read=())
        if problem is None:
            problem = verify(path, read=files_read(path) if files_read else None)
        if any_rank(problem is not None) and problem is None:
            problem = "another rank found a damaged file"
        return problem

    if resume != "auto":
        path = Path(resume)
        problem = problem_of(path)
        if problem:
            raise CheckpointError(f"cannot resume from {path}: {problem}.")
        return path
    for path in _candidates(out_dir):
        if at_most is not None and step_of(path) > at_most:
            continue
        problem = problem_of(path)
        if problem is None:
            return path
        if warn and (warned is None or path not in warned):
            print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
        if warned is not None:
            warned.add(path)
    return None


# ----------------------------------------------------------------------------- reading pieces

@dataclass
class Piece:
    file: str
    key: str
    shape: tuple  # the global tensor's
    offsets: tuple  # of the block the writer held
    sizes: tuple
    flat: int  # start of this fragment in the block's row-major order
    numel: int

    def overlaps(self, offsets, sizes) -> bool:
        return all(a < b + m and b < a + n for a, n, b, m in zip(self.offsets, self.sizes, offsets, sizes))


class Index:
    """Where every saved tensor's pieces are, from the headers of a checkpoint's part files."""

    def __init__(self, path: Path):
        self.path = path
        self.pieces: dict[str, list[Piece]] = {}
        self.rng_files: set = set()
        self._handles: dict = {}
        self._last = None
        files, problem = _manifest_files(path)
        if problem:
            raise CheckpointError(f"checkpoint {path}: {problem}.")
        for fname in sorted(f for f in files if f.startswith("part-")):
            try:
                with TensorFile(path / fname) as f:
                    for key in f.keys():
                        if key == "rng":
                            self.rng_files.add(fname)
                            continue
                        info = json.loads(f.metadata[key])
                        off, sizes = info["box"]
                        numel = f.shape(key)[0]
                        self.pieces.setdefault(key, []).append(
                            Piece(fname, key, tuple(info["shape"]), tuple(off), tuple(sizes), info["flat"], numel))
            except (OSError, KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path / fname} is not a readable checkpoint part ({e}).") from None

    def names(self) -> set:
        return {k for k in self.pieces if not k.endswith(tuple(f".{m}" for m in MOMENTS))}

    def shape(self, key: str) -> tuple:
        return self.pieces[key][0].shape

    def check_fits(self, expected: dict, error=None) -> None:
        """Its weights are those of the model `expected` describes (name -> shape), else one sentence
        (`error`, CheckpointError by default): hf.check_keys_and_shapes, every weights source's check."""
        from .hf import check_keys_and_shapes
        check_keys_and_shapes({n: self.shape(n) for n in self.names()}, expected, f"checkpoint {self.path}",
                              error=error or CheckpointError)

    def files_for(self, boxes: dict) -> set:
        """Part files holding a piece of any of `boxes` ({key: (offsets, sizes)})."""
        out = set()
        for key, (offsets, sizes) in boxes.items():
            out |= {p.file for p in self.pieces.get(key, []) if p.overlaps(offsets, sizes)}
        return out

    def _read(self, piece: Piece) -> torch.Tensor:
        if self._last is not None and self._last[0] is piece:  # consecutive blocks of one piece (export)
            return self._last[1]
        f = self._handles.get(piece.file)
        if f is None:  # plain reads (TensorFile), not a memory map whose pages would stay resident
            f = self._handles[piece.file] = TensorFile(self.path / piece.file)
        try:
            self._last = (piece, f.get(piece.key))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{self.path / piece.file} is not a readable checkpoint part ({e}).") from None
        return self._last[1]

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()
        self._last = None

    def rng(self, rank: int) -> Optional[torch.Tensor]:
        name = part_name(rank)
        if name not in self.rng_files:
            return None
        with TensorFile(self.path / name) as f:
            return f.get("rng")

    def block(self, key: str, offsets: Optional[tuple] = None, sizes: Optional[tuple] = None) -> torch.Tensor:
        """The block [offsets, offsets + sizes) of global tensor `key` (all of it by default), fp32,
        assembled from the pieces that overlap it; every element must be covered."""
        shape = self.shape(key)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
        sizes = tuple(sizes) if sizes is not None else shape
        out = torch.empty(sizes)
        pieces = [p for p in self.pieces[key] if p.overlaps(offsets, sizes)]
        copied = sum(_place(p, self._read(p), out, offsets) for p in pieces)
        # pieces are disjoint, so count == size means covered; else (overlapping writers) ask the mask
        if copied != out.numel() and not _covered(pieces, offsets, sizes):
            raise CheckpointError(f"checkpoint {self.path} lacks part of {key} (a part file is missing its piece).")
        return out


def _place(piece: Piece, data: torch.Tensor, out: torch.Tensor, offsets: tuple) -> int:
    """Copy what a flat fragment holds of the target block `out` (at global `offsets`); returns the
    number of elements copied. The fragment is the range [flat, flat + numel) of the writer's block
    in row-major order: at most 2 x ndim + 1 boxes (a part row at each end, per dimension, and the
    whole rows between), each found by arithmetic and copied as one strided slice, so the cost is
    that of the bytes copied. _place_reference is the simple version (tests/test_checkpoint_reshard.py)."""
    return _copy_range(data.reshape(-1), piece.flat, piece.flat + piece.numel, piece.offsets, piece.sizes, out,
                       offsets, 0)


def _copy_range(src: torch.Tensor, lo: int, hi: int, origin: tuple, shape: tuple, out: torch.Tensor,
                offsets: tuple, dim: int) -> int:
    """Elements [lo, hi) (row-major) of the box `shape` at global `origin`, whose dimensions before
    `dim` have size 1, into `out`; src[i] is element lo + i."""
    row = math.prod(shape[dim + 1:])  # elements per index of dimension `dim`
    if dim == len(shape) or (lo == 0 and hi == math.prod(shape)):
        return _copy_box(src, origin, shape, out, offsets)
    first, last = -(-lo // row), hi // row  # the whole rows [first, last)

    def part_row(r: int, a: int, b: int, at: int) -> int:  # elements [a, b) of row r, from src[at:]
        return _copy_range(src[at:at + b - a], a, b, _at(origin, dim, origin[dim] + r), _at(shape, dim, 1),
                           out, offsets, dim + 1)

    if first > last:  # inside one row
        r = lo // row
        return part_row(r, lo - r * row, hi - r * row, 0)
    n = part_row(first - 1, lo - (first - 1) * row, row, 0) if lo < first * row else 0
    if first < last:
        n += _copy_box(src[first * row - lo:last * row - lo], _at(origin, dim, origin[dim] + first),
                       _at(shape, dim, last - first), out, offsets)
    if last * row < hi:
        n += part_row(last, 0, hi - last * row, last * row - lo)
    return n


def _at(t: tuple, i: int, v: int) -> tuple:
    return t[:i] + (v,) + t[i + 1:]


def _copy_box(src: torch.Tensor, origin: tuple, shape: tuple, out: torch.Tensor, offsets: tuple) -> int:
    """The whole box `shape` at global `origin` (src, flat, row-major) where it meets `out`."""
    box, dst = src.view(shape), out
    for d in range(len(shape)):
        a, b = max(origin[d], offsets[d]), min(origin[d] + shape[d], offsets[d] + out.shape[d])
        if a >= b:
            return 0
        box, dst = box.narrow(d, a - origin[d], b - a), dst.narrow(d, a - offsets[d], b - a)
    dst.copy_(box)
    return dst.numel()


def _covered(pieces: list, offsets: tuple, sizes: tuple) -> bool:
    """Does the union of the pieces cover the block? With a mask (_place_reference)."""
    out, written = torch.empty(sizes), torch.zeros(sizes, dtype=torch.bool)
    for piece in pieces:
        _place_reference(piece, torch.zeros(piece.numel), out, written, offsets)
    return bool(written.all())


def _place_reference(piece: Piece, data: torch.Tensor, out: torch.Tensor, written: torch.Tensor,
                     offsets: tuple) -> None:
    """_place's simple reference: copy the elements of a flat fragment into the target block `out`
    (at global `offsets`) with a mask of the elements the fragment has, marking them in `written`.
    The fragment covers whole rows of the writer's block except perhaps its first and last; only
    the rows the target also holds are rebuilt."""
    row = math.prod(piece.sizes[1:])
    r0 = max(piece.flat // row, offsets[0] - piece.offsets[0])
    r1 = min(-(-(piece.flat + piece.numel) // row), offsets[0] + out.shape[0] - piece.offsets[0])
    if r0 >= r1:
        return
    lo, hi = max(piece.flat, r0 * row), min(piece.flat + piece.numel, r1 * row)  # flat range inside these rows
    rows = (r1 - r0,) + tuple(piece.sizes[1:])
    buf = torch.empty(math.prod(rows))
    have = torch.zeros(math.prod(rows), dtype=torch.bool)
    buf[lo - r0 * row:hi - r0 * row] = data.reshape(-1)[lo - piece.flat:hi - piece.flat].float()
    have[lo - r0 * row:hi - r0 * row] = True
    buf, have = buf.view(rows), have.view(rows)
    src_off = (piece.offsets[0] + r0,) + tuple(piece.offsets[1:])
    dst, dst_w = out, written
    for d in range(len(rows)):
        a = max(src_off[d], offsets[d])
        b = min(src_off[d] + rows[d], offsets[d] + out.shape[d])
        if a >= b:
            return
        buf, have = buf.narrow(d, a - src_off[d], b - a), have.narrow(d, a - src_off[d], b - a)
        dst, dst_w = dst.narrow(d, a - offsets[d], b - a), dst_w.narrow(d, a - offsets[d], b - a)
    dst.copy_(torch.where(have, buf, dst))
    dst_w |= have


def read_full(path: Path, moments: bool = False) -> dict[str, torch.Tensor]:
    """Whole fp32 tensors by global name (weights and balancing biases; with `moments`, also
    `<name>.exp_avg` / `<name>.exp_avg_sq`). For tests and small models: it holds everything."""
    index = Index(Path(path))
    keys = sorted(index.pieces if moments else index.names())
    return {k: index.block(k) for k in keys}


# ----------------------------------------------------------------------------- load

def full_model_shapes(model_cfg) -> dict:
    """Name -> shape of every weight (and balancing bias) of the whole model,
    built on the meta device: no memory, no initialisation cost."""
    from .models.registry import meta_model
    model = meta_model(model_cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith(BIAS)})
    return shapes


def full_model_names(model_cfg) -> set:
    return set(full_model_shapes(model_cfg))


def _local_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters())
    out.update({n: b for n, b in module.named_buffers() if n.endswith(BIAS)})
    return out


def _boxes(module: torch.nn.Module) -> dict:
    """{key: (offsets, sizes)} of every tensor this rank reads (weights, and moments of parameters)."""
    boxes = {}
    for name, t in _local_tensors(module).items():
        shape, offsets = global_view(t)
        boxes[name] = (offsets, tuple(t.shape))
        if isinstance(t, torch.nn.Parameter):
            boxes.update({f"{name}.{m}": boxes[name] for m in MOMENTS})
    return boxes


def read_state(path: Path) -> dict:
    """state.json: step, data position, layout, and the run-wide state of the noise scale and the guards."""
    return json.loads((Path(path) / "state.json").read_text())


def load(path: Path, trainer) -> int:
    """Restore weights, optimizer state, RNG and step from a verified checkpoint: this rank reads
    only the pieces that overlap what it holds."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    state = read_state(path)
    if state.get("arch") != trainer.cfg.model.arch:
        raise CheckpointError(f"checkpoint {path} holds a {state.get('arch')} model, but model.arch is "
                              f"{trainer.cfg.model.arch}.")
    index = Index(path)
    index.check_fits(full_model_shapes(trainer.cfg.model))  # the whole model's: a rank holds only some of it
    link_optimizer_state(trainer.engine)
    if getattr(trainer, "slots", None) is not None:
        trainer.slots.reset_home()  # the rows read are in expert-id order (parallel/slots.py)
    boxes = _boxes(trainer.engine.module)
    with torch.no_grad():
        for name, target in _local_tensors(trainer.engine.module).items():
            value = index.block(name, *boxes[name]).to(target.device)
            target.copy_(value.to(target.dtype))
            if isinstance(target, torch.nn.Parameter) and hasattr(target, "_hp_mapping"):
                safe_set_full_fp32_param(target, value)
                for m in MOMENTS:
                    if f"{name}.{m}" in index.pieces:
                        safe_set_full_optimizer_state(target, index.block(f"{name}.{m}", *boxes[name]).to(
                            target.device), m)
        for st in trainer.engine.optimizer.optimizer.state.values():
            if "step" in st:
                st["step"] = (torch.tensor(float(state["adam_step"]), dtype=st["step"].dtype,
                                           device=st["step"].device)
                              if torch.is_tensor(st["step"]) else state["adam_step"])
    if "noise_scale" in state:
        trainer.observers.noise.load_state_dict(state["noise_scale"])
    # batches a spike rollback skipped: sample positions run ahead of the step by that many
    trainer.data_offset = int(state.get("data_position", state["step"])) - int(state["step"])
    rng = index.rng(trainer.mesh.rank)
    index.close()
    if rng is not None:
        torch.set_rng_state(rng)
    return int(state["step"])
