"""Same seed and config on 1 rank and on 2 data-parallel ranks: the same loss at every step."""
from conftest import TINY, check, launch, train_losses


def test_one_rank_equals_two_data_parallel_ranks(tmp_path):
    steps = ["train.max_steps=5"]
    one = train_losses(check(launch(1, tmp_path / "one", TINY + steps, launcher="python")) and tmp_path / "one")
    two = train_losses(check(launch(2, tmp_path / "two", TINY + steps)) and tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5]
    for s in one:
        assert abs(one[s] - two[s]) / abs(one[s]) < 1e-4, (s, one[s], two[s])
    assert one[5] < one[1]  # it trains
