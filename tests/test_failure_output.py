"""What a failed job prints: the one-line verdict and nothing else of the failure, with the collective
that failed named for what it was (a ZeRO all-gather on the shared-memory rings is not an
"all-to-all" to the user, though it runs on the all-to-all rings)."""
import os
import re

import torch
import torch.distributed as dist

from moe_trainer.kernels.cpu.shm_alltoall import ShmAllToAll

from conftest import TINY, launch, spawn_ranks



def _skipped_peer_worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shm = ShmAllToAll.create(dist.group.WORLD, timeout_s=1.0)
    calls = {"all-to-all": lambda: shm.all_to_all_single(torch.empty(4), torch.ones(4), [2, 2], [2, 2]),
             "all-reduce": lambda: shm.all_reduce_(torch.ones(4)),
             "reduce": lambda: shm.reduce_(torch.ones(4), dst=0),
             "all-gather": lambda: shm.all_gather_into_(torch.empty(8), torch.ones(4)),
             "reduce-scatter": lambda: shm.reduce_scatter_(torch.empty(2), torch.ones(4))}
    if rank == 0:  # rank 1 never takes part
        out = {}
        for name, call in calls.items():
            try:
                call()
                out[name] = "returned"
            except dist.DistError as e:
                out[name] = str(e)
        results[rank] = out
    dist.barrier()
    dist.destroy_process_group()


def test_a_collective_on_the_shared_memory_rings_fails_under_its_own_name():
    res = spawn_ranks(_skipped_peer_worker, 2)[0]
    for name, message in res.items():
        assert message.startswith(f"shm {name}: rank 0 waited"), (name, message)


def test_a_hung_rank_ends_the_job_with_the_verdict_and_no_cpp_stack_trace(tmp_path):
    """hang@3:1 at ep 1: rank 0 waits in a ZeRO collective on the shared-memory rings and reports;
    rank 1 (alive, hung) answers and leaves, and rank 0, the store's host, exits last, so no rank
    asks a store that is gone (torch logs that with a C++ stack trace of 25 lines)."""
    proc = launch(2, tmp_path / "hang", TINY + ["train.max_steps=6", "parallel.timeout_s=10",
                                               "debug.faults=[hang@3:1]"], timeout=300)
    assert proc.returncode != 0
    verdicts = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(verdicts) == 1 and "Rank(s) 1 stopped making progress (at step 3: start)" in verdicts[0], \
        proc.stderr[-3000:]
    # a ZeRO gradient reduction or the loss all-reduce, by its name, not the rings' "all-to-all"
    assert re.search(r"\(shm (all-reduce|all-gather|reduce-scatter|reduce): rank 0 waited", verdicts[0]), verdicts[0]
    for trace in ("Exception raised from", "frame #", "TCPStore.cpp"):
        assert trace not in proc.stderr, proc.stderr[-3000:]
