"""The pipeline's shared-memory point-to-point (ShmAllToAll.exchange, parallel/p2p.PeerExchange) on
real gloo ranks: the same tensors arrive as through gloo's batch_isend_irecv, several to one peer in
one call and across calls in order, messages many times a ring's size; with NCCL's rule on
(MOE_TRAINER_STRICT_P2P) the crossing order that deadlocks on GPUs fails with a sentence and the
batched order passes, while eager rings pass both; a dead peer ends a wait."""
import os

import pytest
import torch
import torch.distributed as dist

from moe_trainer.kernels.cpu.shm_alltoall import ShmAllToAll
from moe_trainer.parallel.p2p import PeerExchange, Transfer

from conftest import spawn_ranks


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _ring_worker(rank, world, port, ring_bytes, strict, results):
    """Every rank sends to both neighbours on a ring of ranks and receives from both, three
    tensors per neighbour per call (two calls), through shm and through gloo; the same bytes."""
    _init(rank, world, port)
    shm = ShmAllToAll.create(dist.group.WORLD, ring_bytes=ring_bytes, timeout_s=30)
    assert shm is not None
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    ok = True
    for call in range(2):
        def payload(src, dst, k, call=call):
            g = torch.Generator().manual_seed(1000 * call + 100 * src + 10 * dst + k)
            return torch.randn(300 + 7 * k, 5, generator=g)  # sizes differ per message
        sends = [(peer, payload(rank, peer, k)) for k in range(3) for peer in (nxt, prv)]
        shapes = {(peer, k): payload(peer, rank, k).shape for k in range(3) for peer in (nxt, prv)}
        got = [(peer, torch.full(shapes[(peer, k)], -1.0)) for k in range(3) for peer in (prv, nxt)]
        shm.exchange(sends, got, rendezvous=strict)
        want = [(peer, torch.empty(shapes[(peer, k)])) for k in range(3) for peer in (prv, nxt)]
        ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends] + \
            [dist.P2POp(dist.irecv, t, peer) for peer, t in want]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        ok &= all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    dist.barrier()
    shm.close()
    results[rank] = ok
    dist.destroy_process_group()


@pytest.mark.parametrize("world, ring_bytes, strict", [(2, 2 << 20, False), (2, 1000, True), (3, 4096, False)],
                         ids=["w2-eager", "w2-tiny-ring-strict", "w3-small-ring"])
def test_shm_exchange_delivers_what_gloo_delivers(world, ring_bytes, strict):
    """With two ranks both neighbours are one peer: six messages each way share one ring, in order."""
    res = spawn_ranks(_ring_worker, world, ring_bytes, strict)
    assert res == {r: True for r in range(world)}, res


def _crossing_worker(rank, world, port, batched, strict, results):
    """Each rank sends 64 KiB to the other and then receives: 1F1B's steady state between two
    stages issued one transfer at a time (or as one batch)."""
    _init(rank, world, port)
    shm = ShmAllToAll.create(dist.group.WORLD, timeout_s=2.0)
    out, buf = torch.full((1 << 14,), float(rank)), torch.empty(1 << 14)
    peer = 1 - rank
    try:
        if batched:
            shm.exchange([(peer, out)], [(peer, buf)], rendezvous=strict)
        else:
            shm.exchange([(peer, out)], [], rendezvous=strict)
            shm.exchange([], [(peer, buf)], rendezvous=strict)
        results[rank] = ("ok", float(buf[0]))
    except RuntimeError as e:
        results[rank] = ("error", str(e))
    dist.barrier()
    shm.close()
    dist.destroy_process_group()


def test_strict_rule_fails_the_crossing_order_and_passes_the_batched_one():
    bad = spawn_ranks(_crossing_worker, 2, False, True)
    assert [bad[r][0] for r in (0, 1)] == ["error", "error"], bad
    assert "send to rank 1" in bad[0][1] and "under NCCL this order deadlocks" in bad[0][1], bad[0][1]
    assert spawn_ranks(_crossing_worker, 2, True, True) == {0: ("ok", 1.0), 1: ("ok", 0.0)}
    # eager rings (the default, as gloo): the crossing order passes, like a send into NCCL's buffers
    assert spawn_ranks(_crossing_worker, 2, False, False) == {0: ("ok", 1.0), 1: ("ok", 0.0)}


def _dead_peer_worker(rank, world, port, results):
    _init(rank, world, port)
    shm = ShmAllToAll.create(dist.group.WORLD, timeout_s=60.0)
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone without receiving
    try:
        shm.exchange([(1, torch.ones(1 << 12))], [], rendezvous=True)
        results[rank] = "returned"
    except RuntimeError as e:
        results[rank] = str(e)


def test_a_dead_peer_ends_a_wait():
    res = spawn_ranks(_dead_peer_worker, 2)
    assert "rank 1" in res[0] and "has exited" in res[0], res


def _peer_exchange_worker(rank, world, port, results):
    """PeerExchange (the executor's) with the transport: global ranks mapped to the group's, keys
    kept, and the bytes counted as on gloo."""
    from moe_trainer.parallel.comm import CommCounter
    _init(rank, world, port)
    ranks = [0, 1]
    group = dist.new_group(ranks)
    shm = ShmAllToAll.create(group, timeout_s=30)
    counter = CommCounter()
    ex = PeerExchange((2, 3), torch.float32, torch.device("cpu"), counter=counter, transport=shm, ranks=ranks)
    peer = 1 - rank
    batch = [Transfer("act", 0, peer, send=True), Transfer("grad", 1, peer, send=True),
             Transfer("act", 0, peer, send=False), Transfer("grad", 1, peer, send=False)]
    outgoing = {("act", 0, 0): torch.full((2, 3), 10.0 + rank), ("grad", 1, 0): torch.full((2, 3), 20.0 + rank)}
    got = ex.run(batch, outgoing)
    counted = counter.reset()
    results[rank] = ({k: float(v[0, 0]) for k, v in got.items()}, counted["sent"], outgoing)
    dist.barrier()
    shm.close()
    dist.destroy_process_group()


def test_peer_exchange_runs_its_batches_through_the_rings():
    res = spawn_ranks(_peer_exchange_worker, 2)
    for rank in (0, 1):
        got, sent, left = res[rank]
        assert got == {("act", 0, 0): 10.0 + 1 - rank, ("grad", 1, 0): 20.0 + 1 - rank}
        assert sent == {"pp_send": 2 * 6 * 4, "pp_recv": 0} and left == {}
