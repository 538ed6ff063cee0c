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
from moe_trainer.kernels.cpu.shm_alltoall import ShmAllToAll

from conftest import spawn_ranks


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _equal_to_gloo_worker(rank, world, port, ring_bytes, results):
    _init(rank, world, port)
    from moe_trainer.kernels.cpu import extension
    ops, names = extension.kernels(), []
    create = ops.shm_channel_create  # the name this job's channel gets (another worker's jobs make theirs)
    ops.shm_channel_create = lambda name, *a: names.append(name) or create(name, *a)
    shm = ShmAllToAll.create(dist.group.WORLD, ring_bytes=ring_bytes)
    ops.shm_channel_create = create
    assert shm is not None and len(names) == 1
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
    results[rank] = (ok, names[0])
    dist.destroy_process_group()


@pytest.mark.parametrize("world, ring_bytes", [(2, 4 << 20), (2, 256), (4, 1000)],
                         ids=["w2-big-ring", "w2-tiny-ring", "w4-small-ring"])
def test_shm_all_to_all_equals_gloo(world, ring_bytes):
    """Tiny rings make every chunk stream through in many passes (and wrap around)."""
    res = spawn_ranks(_equal_to_gloo_worker, world, ring_bytes)
    assert all(ok for ok, _ in res.values()), res
    name = res[0][1]  # one name for the job, a file per rank under it: removed once every rank mapped it
    assert name.startswith("/dev/shm/moe_trainer_a2a_") and {n for _, n in res.values()} == {name}
    assert not list(Path("/dev/shm").glob(Path(name).name + "*"))


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



def _same_on_every_rank(t: torch.Tensor) -> bool:
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, t)
    return all(torch.equal(c, t) for c in copies)


def _collectives_worker(rank, world, port, results):
    _init(rank, world, port)
    shm = ShmAllToAll.create(dist.group.WORLD, ring_bytes=4096)  # large tensors stream through
    failures = []

    def check(what, got, want, tol, scale=1.0):
        if not torch.allclose(got.double(), want.double(), rtol=tol, atol=tol * scale):
            failures.append(f"{what}: max diff {(got.double() - want.double()).abs().max().item()}")

    ops = (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("max", dist.ReduceOp.MAX),
           ("min", dist.ReduceOp.MIN))
    # 150 elements: the gather-all path; 3 x 20001 (not a multiple of world): reduce-scatter + all-gather
    for shape in ((3, 50), (3, 20001)):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
            x = (torch.randn(*shape, generator=torch.Generator().manual_seed(rank)) * 1000).to(dtype)
            for op, dist_op in ops:
                if dtype == torch.int64 and op == "avg":
                    continue
                want = x.double().clone()  # gloo's result in float64: ours adds 16-bit copies in float32
                dist.all_reduce(want, op=dist_op if op != "avg" else dist.ReduceOp.SUM)
                if op == "avg":
                    want /= world
                got = shm.all_reduce_(x.clone(), op)
                check(f"all_reduce {op} {dtype} {shape}", got, want.to(dtype), 1e-2 if dtype == torch.bfloat16 else 1e-6,
                      scale=1000.0 * world)  # rounding is relative to the addends' size
                if not _same_on_every_rank(got):
                    failures.append(f"all_reduce {op} {dtype} {shape}: ranks differ")
    # reduce to each rank in turn: the destination has the sum, the others keep their input
    x = torch.randn(1000, 7, generator=torch.Generator().manual_seed(10 + rank))
    total = x.clone()
    dist.all_reduce(total)
    for dst in range(world):
        got = shm.reduce_(x.clone(), dst, "sum")
        check(f"reduce to {dst}", got, total if rank == dst else x, 1e-5)
    # all_gather_into_tensor and reduce_scatter_tensor
    part = torch.arange(5003, dtype=torch.float32) * (rank + 1)
    out = torch.empty(world * 5003)
    shm.all_gather_into_(out, part)
    want = torch.cat([torch.arange(5003, dtype=torch.float32) * (r + 1) for r in range(world)])
    check("all_gather_into_tensor", out, want, 0.0)
    one = torch.empty(world)  # a one-element share (its copies per rank must be a real copy)
    shm.all_gather_into_(one, torch.tensor([float(rank)]))
    check("all_gather_into_tensor of one element", one, torch.arange(world, dtype=torch.float32), 0.0)
    full = torch.randn(world * 3001, generator=torch.Generator().manual_seed(20 + rank))
    got, want = torch.empty(3001), torch.empty(3001)
    shm.reduce_scatter_(got, full, "sum")
    dist.reduce_scatter_tensor(want, full)
    check("reduce_scatter_tensor", got, want, 1e-5)
    shm.close()
    results[rank] = failures
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shm_collectives_equal_gloo_and_agree_bitwise(world):
    """all_reduce_ (both algorithms, every op, 16-bit and integer dtypes), reduce_ to every rank,
    all_gather_into_ and reduce_scatter_ against gloo's results; the all-reduce leaves the same
    bits on every rank."""
    res = spawn_ranks(_collectives_worker, world)
    assert all(not f for f in res.values()), res


def _deepspeed_routing_worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    import deepspeed.comm as ds_dist
    from moe_trainer.parallel.comm import enable_shm_transport, route_deepspeed_collectives
    from moe_trainer.parallel.launch import init_distributed
    init_distributed(120)
    group = dist.new_group(list(range(world)))
    assert enable_shm_transport(group) and route_deepspeed_collectives()
    from moe_trainer.parallel.comm import _SHM_TRANSPORTS
    transport, calls = _SHM_TRANSPORTS[group], []
    inner = transport.all_to_all_single
    transport.all_to_all_single = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    x = torch.randn(40000, generator=torch.Generator().manual_seed(rank))
    want = x.clone()
    dist.all_reduce(want, group=group)  # torch's gloo, untouched
    failures = []
    got = x.clone()
    ds_dist.all_reduce(got, group=group)  # as ZeRO calls it
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        failures.append("all_reduce")
    norm = torch.tensor([float(rank + 1)])
    ds_dist.all_reduce(norm, op=ds_dist.ReduceOp.MAX, group=group)
    if norm.item() != world:
        failures.append(f"all_reduce MAX gave {norm.item()}")
    red = x.clone()
    handle = ds_dist.reduce(red, dst=world - 1, group=group, async_op=True)
    handle.wait()
    if rank == world - 1 and not torch.allclose(red, want, rtol=1e-5, atol=1e-5):
        failures.append("reduce")
    out = torch.empty(world * 3)
    ds_dist.all_gather_into_tensor(out, torch.full((3,), float(rank)), group=group)
    if not torch.equal(out, torch.arange(world).float().repeat_interleave(3)):
        failures.append("all_gather_into_tensor")
    routed = len(calls)
    other = x.clone()
    ds_dist.all_reduce(other)  # the world group has no transport here: gloo
    if len(calls) != routed or not torch.allclose(other, want, rtol=1e-5, atol=1e-5):
        failures.append("the world group's call did not stay on gloo")
    results[rank] = (failures, routed)
    dist.destroy_process_group()


def test_deepspeed_collectives_route_through_shared_memory():
    """deepspeed.comm's all_reduce (SUM, MAX), async reduce and all_gather_into_tensor on a group
    with a transport go through its rings and give gloo's results; a group without one stays on
    gloo."""
    res = spawn_ranks(_deepspeed_routing_worker, 2)
    for rank, (failures, routed) in res.items():
        assert not failures, (rank, failures)
        assert routed >= 5, (rank, routed)  # all-reduce: 2 exchanges, then 1 each


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
