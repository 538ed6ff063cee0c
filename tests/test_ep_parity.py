"""Expert parallelism through the real trainer and DeepSpeed engine: the same
losses for 5 steps as one rank, and experts synchronised only within their
expert-data-parallel group."""
import pytest

from conftest import MOE_STEPS, TINY, assert_same_final_weights, assert_same_losses, check, launch


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_matches_one_rank(tmp_path, moe_reference, world, ep):
    out = tmp_path / f"w{world}ep{ep}"
    proc = check(launch(world, out, TINY + MOE_STEPS + [f"parallel.ep={ep}"]))
    assert_same_losses(moe_reference, out)
    # final weights (gathered from every EP rank under global expert ids) equal the 1-rank run's
    assert_same_final_weights(moe_reference, out)
    assert "Traceback" not in proc.stderr
