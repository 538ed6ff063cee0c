"""checkpoint_pick: rank 0 lists the checkpoints and every rank follows its list (a node that sees
another directory listing makes the same calls), and a resume hashes each file once, spread over
the ranks by size, with a damaged file still refused on every rank."""
import hashlib
import json
import os
from pathlib import Path

import pytest

from moe_trainer.checkpoint_pick import shares

from conftest import spawn_ranks


def test_shares_give_every_file_to_one_rank_balanced_by_bytes():
    files = {f"part-r{i:05d}.safetensors": {"bytes": b} for i, b in enumerate([90, 10, 40, 40, 30, 5, 5, 80])}
    files["state.json"] = {"bytes": 1}
    got = shares(files, 3)
    names = [n for share in got for n in share]
    assert sorted(names) == sorted(files) and len(names) == len(files)  # each file exactly once
    loads = [sum(files[n]["bytes"] for n in share) for share in got]
    # largest-first greedy: within 4/3 of the best split (Graham's bound), which is >= 301 / 3 bytes
    assert max(loads) <= 4 / 3 * max(sum(loads) / 3, 90), loads
    assert shares(files, 1) == [sorted(files, key=lambda n: (-files[n]["bytes"], n))]
    assert shares({"a": {"bytes": 3}}, 4) == [["a"], [], [], []]


def _write_checkpoint(path: Path, sizes: list[int]) -> None:
    """A checkpoint directory as checkpoint.save leaves it: files and a manifest of their sizes and digests."""
    path.mkdir(parents=True)
    files = {}
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        (path / f"part-r{i:05d}.safetensors").write_bytes(data)
        files[f"part-r{i:05d}.safetensors"] = {"bytes": size, "sha256": hashlib.sha256(data).hexdigest()}
    (path / "state.json").write_text("{}")
    files["state.json"] = {"bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    (path / "manifest.json").write_text(json.dumps({"files": files}))


def _pick_worker(rank, world, port, out, results):
    import torch.distributed as dist
    from moe_trainer import checkpoint, checkpoint_pick
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    hashed, calls = [], []
    real_sha = checkpoint.sha256
    checkpoint.sha256 = lambda path: hashed.append(Path(path).name) or real_sha(path)
    # what this rank's filesystem shows: rank 1 sees no checkpoint at all, rank 2 one that rank 0's
    # prune removed (a stale network-filesystem listing); only rank 0's view may count
    views = {1: [], 2: [out / "checkpoints" / "step_9"] + checkpoint._candidates(out)}
    if rank in views:
        checkpoint._candidates = lambda _: views[rank]
    for name in ("broadcast_object_list", "all_gather_object", "all_reduce", "broadcast"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    found = checkpoint_pick.pick(out, "auto", rank, world, warn=rank == 0)
    results[rank] = {"found": str(found), "hashed": hashed, "calls": calls}
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("damaged", [False, True])
def test_rank_0_picks_and_each_file_is_hashed_once_over_the_ranks(tmp_path, damaged):
    out = tmp_path / "run"
    _write_checkpoint(out / "checkpoints" / "step_4", [3000, 1000, 2000, 500])
    _write_checkpoint(out / "checkpoints" / "step_8", [3000, 1000, 2000, 500])
    if damaged:  # one byte of one part changed, its size kept: only its checksum tells
        f = out / "checkpoints" / "step_8" / "part-r00002.safetensors"
        data = bytearray(f.read_bytes())
        data[7] ^= 0xFF
        f.write_bytes(bytes(data))
    res = spawn_ranks(_pick_worker, 3, out)
    want = out / "checkpoints" / ("step_4" if damaged else "step_8")
    assert {r["found"] for r in res.values()} == {str(want)}  # every rank, whatever its own listing shows
    assert len({tuple(r["calls"]) for r in res.values()}) == 1  # the same collectives on every rank
    examined = 2 if damaged else 1
    assert res[0]["calls"] == ["broadcast", "broadcast"] + ["all_gather_object"] * examined
    hashed = [n for r in res.values() for n in r["hashed"]]
    assert sorted(hashed) == sorted(([f"part-r{i:05d}.safetensors" for i in range(4)] + ["state.json"]) * examined)
    assert len(res[0]["hashed"]) < 5 * examined  # a rank hashes its share, not every file
    sizes = [sum((want / n).stat().st_size for n in set(r["hashed"])) for r in res.values()]
    assert max(sizes) <= 3000  # the largest part alone; the rest shared by the others
