"""Which checkpoint a start (or a rollback) resumes, decided once for all ranks. Collective.

Rank 0 alone lists the checkpoint directory: the candidates newest first (train.resume=auto, of
step `at_most` or before), or the one path train.resume names, each with its manifest's file list,
checked for completeness and sizes (metadata only). It broadcasts that list: the only listing any
rank uses, so a node whose network filesystem still shows a pruned or renamed checkpoint makes the
same calls as the others. Then the candidates are verified in that order, each file's sha256
computed once, by one rank: the files are shared out by size (`shares`), every rank hashes its
share, and the verdicts are gathered. The first candidate whose every file matches is the pick.

Collectives, the same on every rank whatever it sees: the listing's broadcast (its length, then its
bytes), then one gather of verdicts per candidate examined (one when the newest is intact). Bytes hashed per resume: the checkpoint's size,
once, not every rank the files it reads.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from . import checkpoint


def shares(files: dict, world: int) -> list[list[str]]:
    """The files each rank hashes: every file once, largest first to the rank with the fewest bytes so
    far (ties to the lower rank). `files`: the manifest's {name: {"bytes", "sha256"}}. Pure."""
    load, out = [0] * world, [[] for _ in range(world)]
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(name)
        load[r] += files[name]["bytes"]
    return out


def candidates(out_dir: Path, resume: str, at_most: Optional[int] = None) -> list[tuple[str, dict, Optional[str]]]:
    """(path, manifest files, problem or None) in the order to try them: rank 0's view. The problem
    here is one of completeness (no manifest, a file missing or of the wrong size)."""
    if resume == "none":
        return []
    paths = [Path(resume)] if resume != "auto" else [
        p for p in checkpoint._candidates(out_dir) if at_most is None or checkpoint.step_of(p) <= at_most]
    out = []
    for path in paths:
        problem = "it does not exist" if not path.is_dir() else checkpoint.verify(path, read=())
        files = {} if problem else checkpoint._manifest_files(path)[0]
        out.append((str(path), files, problem))
    return out


def _hash_problem(path: Path, files: dict, names: list[str]) -> Optional[str]:
    for name in names:
        f = path / name
        if not f.is_file():  # seen by rank 0, not here
            return f"{name} is missing"
        if checkpoint.sha256(f) != files[name]["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _broadcast(obj, rank: int, device: torch.device):
    """Rank 0's `obj` (JSON) on every rank: its length, then its bytes, as tensors on the rank's device
    (NCCL takes nothing else). One host sync on the receiving ranks, for the length."""
    if rank == 0:
        data = json.dumps(obj).encode()
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=device), src=0)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), src=0)
        return obj
    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(n, src=0)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)  # host sync: once per pick
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().tolist()))


def pick(out_dir: Path, resume: str, rank: int, world: int, device: torch.device = torch.device("cpu"),
         warn: bool = True, at_most: Optional[int] = None, warned: Optional[set] = None) -> Optional[Path]:
    """train.resume on every rank alike (rank 0's `resume` and view count; the others' are ignored):
    none -> None; a path -> that checkpoint (CheckpointError if it is damaged); auto -> the newest
    intact checkpoint (of step `at_most` or before), skipping damaged ones with a warning (once: not
    for the paths in `warned`, to which the warned ones are added). Collective when world > 1."""
    together = world > 1 and dist.is_initialized()
    listing = [resume == "auto", candidates(out_dir, resume, at_most) if rank == 0 else []]
    if together:
        listing = _broadcast(listing, rank, device)
    auto, entries = listing
    for path, files, problem in entries:
        path = Path(path)
        if problem is None:
            mine = _hash_problem(path, files, shares(files, world)[rank])
            verdicts = [mine]
            if together:
                verdicts = [None] * world
                dist.all_gather_object(verdicts, mine)
            problem = next((p for p in verdicts if p is not None), None)
        if problem is None:
            return path
        if not auto:  # every rank stops, with the same sentence
            raise checkpoint.CheckpointError(f"cannot resume from {path}: {problem}.")
        if warn and (warned is None or path not in warned):
            print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
        if warned is not None:
            warned.add(path)
    return None
