"""Expert parallelism through the real trainer and DeepSpeed engine: the same
losses for 5 steps as one rank, and experts synchronised only within their
expert-data-parallel group."""
import pytest
import torch

from conftest import MOE_STEPS, TINY, assert_same_final_weights, assert_same_steps, check, launch, train_losses


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_matches_one_rank(tmp_path, moe_reference, world, ep):
    out = tmp_path / f"w{world}ep{ep}"
    proc = check(launch(world, out, TINY + MOE_STEPS + [f"parallel.ep={ep}"]))
    assert_same_steps(moe_reference, out)
    # final weights (gathered from every EP rank under global expert ids) equal the 1-rank run's
    assert_same_final_weights(moe_reference, out)
    assert "Traceback" not in proc.stderr


def test_shared_memory_and_gloo_all_to_alls_give_identical_runs(tmp_path):
    """world 2, ep 2, bf16 (the padded expert GEMMs too): the same loss bits and the same final
    weights whether the all-to-alls and small all-reduces go through /dev/shm or gloo."""
    runs = {}
    for transport in ("shm", "gloo"):
        out = tmp_path / transport
        check(launch(2, out, TINY + ["train.max_steps=3", "train.checkpoint_every=3", "parallel.ep=2",
                                     "train.dtype=bf16", f"parallel.cpu_alltoall={transport}"]))
        runs[transport] = out
    assert train_losses(runs["shm"]) == train_losses(runs["gloo"]) and len(train_losses(runs["shm"])) == 3
    from moe_trainer.checkpoint import read_full
    a, b = (read_full(runs[t] / "checkpoints" / "step_3") for t in ("shm", "gloo"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
