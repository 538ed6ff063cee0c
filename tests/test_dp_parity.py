"""Same seed and config on 1 rank and on 2 data-parallel ranks: the same loss and
gradient norm before clipping at every step, and the same final weights."""
from conftest import MOE_STEPS, TINY, assert_same_final_weights, assert_same_steps, check, launch, train_losses


def test_one_rank_equals_two_data_parallel_ranks(tmp_path, moe_reference):
    two = tmp_path / "two"
    check(launch(2, two, TINY + MOE_STEPS))
    # a gradient summed instead of averaged over the two ranks doubles the norm (clipping and Adam hide it)
    assert_same_steps(moe_reference, two)
    assert_same_final_weights(moe_reference, two)
    one = train_losses(moe_reference)
    assert one[5] < one[1]  # it trains
