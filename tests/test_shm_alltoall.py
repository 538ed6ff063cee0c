"""The shared-memory all-to-all (parallel/shm_alltoall.py) on real gloo ranks: the same bytes as
gloo's all_to_all_single for uneven splits, empty chunks, several dtypes and chunks many times a
ring's size; a peer that never arrives raises instead of hanging; ranks that cannot all use it all
get None; nothing is left in /dev/shm."""
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_trainer.parallel.comm import all_to_all_single, use_shm_transport
from moe_trainer.parallel.shm_alltoall import ShmAllToAll

from conftest import spawn_ranks


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _equal_to_gloo_worker(rank, world, port, ring_bytes, results):
    _init(rank, world, port)
    shm = ShmAllToAll.create(dist.group.WORLD, ring_bytes=ring_bytes)
    assert shm is not None
    ok = True
    for call in range(12):
        # the same table of splits on every rank: splits[i][j] rows from rank i to rank j
        g = torch.Generator().manual_seed(call)
        splits = torch.randint(0, 40, (world, world), generator=g)
        splits[call % world] = 0  # a rank that sends nothing
        if call % 3 == 0:
            splits[:, (call + 1) % world] = 0  # and one that receives nothing
        in_splits, out_splits = splits[rank].tolist(), splits[:, rank].tolist()
        dtype, cols = [(torch.float32, (7,)), (torch.bfloat16, (3, 5)), (torch.int64, ())][call % 3]
        x = (torch.randn(sum(in_splits), *cols, generator=torch.Generator().manual_seed(100 * call + rank)) * 100
             ).to(dtype)
        want = torch.empty((sum(out_splits),) + x.shape[1:], dtype=dtype)
        dist.all_to_all_single(want, x, out_splits, in_splits)
        got = torch.full_like(want, -1)
        shm.all_to_all_single(got, x, out_splits, in_splits)
        ok &= torch.equal(got, want)
    # equal splits (None) and the comm-level switch that the dispatchers call
    use_shm_transport(dist.group.WORLD, shm)
    x = torch.arange(world * 4, dtype=torch.float32) + 1000 * rank
    got, want = torch.empty_like(x), torch.empty_like(x)
    all_to_all_single(got, x, group=dist.group.WORLD)
    use_shm_transport(dist.group.WORLD, None)
    dist.all_to_all_single(want, x)
    ok &= torch.equal(got, want)
    shm.close()
    results[rank] = ok
    dist.destroy_process_group()


@pytest.mark.parametrize("world, ring_bytes", [(2, 4 << 20), (2, 256), (4, 1000)],
                         ids=["w2-big-ring", "w2-tiny-ring", "w4-small-ring"])
def test_shm_all_to_all_equals_gloo(world, ring_bytes):
    """Tiny rings make every chunk stream through in many passes (and wrap around)."""
    before = set(Path("/dev/shm").glob("moe_trainer_a2a_*"))
    res = spawn_ranks(_equal_to_gloo_worker, world, ring_bytes)
    assert all(res.values()), res
    assert set(Path("/dev/shm").glob("moe_trainer_a2a_*")) == before  # names removed once mapped


def _timeout_worker(rank, world, port, results):
    _init(rank, world, port)
    shm = ShmAllToAll.create(dist.group.WORLD, timeout_s=1.0)
    x = torch.ones(4)
    if rank == 0:  # rank 1 never takes part
        try:
            shm.all_to_all_single(torch.empty(4), x, [2, 2], [2, 2])
            results[rank] = "returned"
        except RuntimeError as e:
            results[rank] = str(e)
    dist.barrier()
    dist.destroy_process_group()


def test_missing_peer_raises_instead_of_hanging():
    res = spawn_ranks(_timeout_worker, 2)
    assert "waited" in res[0] and "did a rank fail or skip a collective" in res[0], res


def _other_host_worker(rank, world, port, results):
    _init(rank, world, port)
    if rank == 1:  # pretend rank 1 runs on another machine
        socket.gethostname = lambda: "elsewhere"
    results[rank] = ShmAllToAll.create(dist.group.WORLD) is None
    dist.destroy_process_group()


def test_ranks_on_different_hosts_all_stay_on_gloo():
    assert spawn_ranks(_other_host_worker, 2) == {0: True, 1: True}



def _all_reduce_worker(rank, world, port, results):
    _init(rank, world, port)
    shm = ShmAllToAll.create(dist.group.WORLD, ring_bytes=512)
    ok = True
    for dtype in (torch.float32, torch.float64, torch.int64):
        x = (torch.randn(3, 50, generator=torch.Generator().manual_seed(rank)) * 1000).to(dtype)
        for op, dist_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
            want = x.clone()
            dist.all_reduce(want, op=dist_op)
            got = shm.all_reduce_(x.clone(), op)
            ok &= torch.allclose(got.double(), want.double(), rtol=1e-6, atol=1e-3)
            mine = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(mine, got)
            ok &= all(torch.equal(m, got) for m in mine)  # the same bits on every rank
    shm.close()
    results[rank] = ok
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shm_all_reduce_equals_gloo_and_agrees_bitwise(world):
    assert all(spawn_ranks(_all_reduce_worker, world).values())


def _dead_peer_worker(rank, world, port, results):
    _init(rank, world, port)
    shm = ShmAllToAll.create(dist.group.WORLD, timeout_s=120.0)
    if rank == 1:
        os._exit(0)  # dies without taking part (and without tearing down the process group)
    t0 = time.monotonic()
    try:
        shm.all_to_all_single(torch.empty(4), torch.ones(4), [2, 2], [2, 2])
        results[rank] = ("returned", 0.0)
    except RuntimeError as e:
        results[rank] = (str(e), time.monotonic() - t0)


def test_dead_peer_raises_within_seconds():
    """Not after the 120 s timeout: the waiting rank watches its peers' processes."""
    import torch.multiprocessing as mp
    from conftest import free_port
    results = mp.Manager().dict()
    ctx = mp.start_processes(_dead_peer_worker, args=(2, free_port(), results), nprocs=2, join=False)
    for p in ctx.processes:
        p.join(60)
    msg, seconds = results[0]
    assert "rank 1" in msg and "has exited" in msg and seconds < 10, results[0]
