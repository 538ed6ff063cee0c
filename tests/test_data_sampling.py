"""The window order (a keyed Feistel bijection) and a start that does not grow with the corpus."""
import json
import time
import tracemalloc

import numpy as np
import pytest

from moe_trainer.data import BatchSource, WindowOrder, open_data

VAL_TOKENS = 10_000


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 65, 1000, 4097, 100_003])
def test_the_order_is_a_bijection_of_the_windows(n):
    for epoch in (0, 1, 7):
        windows = WindowOrder(n, seed=11, epoch=epoch)(np.arange(n))
        assert np.array_equal(np.sort(windows), np.arange(n))


def test_the_order_is_keyed_by_seed_and_epoch_and_looks_shuffled():
    n = 50_000
    pos = np.arange(n)
    a = WindowOrder(n, 3, 0)(pos)
    assert np.array_equal(a, WindowOrder(n, 3, 0)(pos))  # a pure function of (seed, epoch, position)
    for other in (WindowOrder(n, 3, 1)(pos), WindowOrder(n, 4, 0)(pos)):
        assert (other == a).mean() < 0.01  # about 1/n of positions agree by chance
    # shuffled: neighbours land far apart, and a prefix of the epoch covers the windows evenly
    assert np.median(np.abs(np.diff(a))) > n / 8
    counts = np.bincount(a[: n // 10] * 10 // n, minlength=10)  # the first 10% of the epoch, in tenths of the data
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()
    assert abs(np.corrcoef(pos, a)[0, 1]) < 0.03


def test_sample_i_is_a_pure_function_of_seed_and_i_across_epochs(tmp_path):
    from moe_trainer.data import prepare
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": f"line {i} " * 30}) for i in range(200)))
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "t"), val_fraction=0.1)
    _, train, _ = open_data(str(tmp_path / "t"), 16, 5, 320)
    n = train.n_windows
    ran = [train.window(i) for i in range(3 * n)]  # three epochs in order
    for e in range(3):
        assert sorted(ran[e * n:(e + 1) * n]) == list(range(n))
    _, fresh, _ = open_data(str(tmp_path / "t"), 16, 5, 320)
    assert [fresh.window(i) for i in range(2 * n + 3, 2 * n + 40)] == ran[2 * n + 3:2 * n + 40]
    batch = fresh.samples(n - 2, 4)  # a batch across the epoch boundary
    assert batch.shape == (4, 17) and batch.dtype.is_floating_point is False


def fake_token_dir(path, train_tokens: int):
    """A v2 token directory whose train shard is a sparse file of `train_tokens` ids (zeros read
    back, no disk used) and a small val shard: an index as prepare_data writes it."""
    path.mkdir()
    with open(path / "train-00000.bin", "wb") as f:
        f.truncate(train_tokens * 2)
    (np.arange(VAL_TOKENS) % 300).astype(np.uint16).tofile(path / "val-00000.bin")
    shard = {"train": {"file": "train-00000.bin", "num_tokens": train_tokens, "documents": 1, "max_id": 257},
             "val": {"file": "val-00000.bin", "num_tokens": VAL_TOKENS, "documents": 1, "max_id": 299}}
    index = {"format": "moe_trainer.tokens.v2", "dtype": "uint16", "vocab_size": 320, "eos_id": 257,
             "tokenizer": {"type": "bytes", "eos_id": 257, "eos_token": "<|endoftext|>"},
             "splits": {s: {"num_tokens": m["num_tokens"], "documents": 1, "max_id": m["max_id"], "shards": [m]}
                        for s, m in shard.items()}}
    (path / "index.json").write_text(json.dumps(index))
    return path


def _start(path) -> tuple[float, int]:
    """(seconds, peak bytes allocated by Python and numpy) to open the data and read 4 batches."""
    tracemalloc.start()
    t0 = time.perf_counter()
    _, train, _ = open_data(str(path), 4096, 0, 320)
    for step in range(4):
        train.micro_batch(step, 0, 64, 8, 0, 1)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak


def test_a_10g_token_set_starts_as_fast_and_as_small_as_a_small_one(tmp_path):
    """No full scan and no per-window array: 10G tokens (2.4M windows of 4,096) open and batch in
    the time and memory of 10M tokens. A full read of the 20 GB file would take minutes; a
    permutation of the windows would allocate 20 MB."""
    small = fake_token_dir(tmp_path / "small", 10_000_000)
    large = fake_token_dir(tmp_path / "large", 10_000_000_000)
    _start(small), _start(large)  # imports and page caches warm
    # the best of 3 each: this machine's cores are shared, a slow run says nothing about the data
    (t_small, m_small), (t_large, m_large) = (min(_start(p) for _ in range(3)) for p in (small, large))
    assert t_large < 1.2 * t_small + 0.02, (t_small, t_large)
    assert m_large < m_small + (1 << 20) and m_large < 64 << 20, (m_small, m_large)


def test_ids_past_the_checked_head_are_caught_by_the_batch(tmp_path):
    """A shard damaged after preparation past the start's bounded check fails at the batch that reads it."""
    from moe_trainer.data import DataError
    from moe_trainer.data.formats import HEAD_CHECK_TOKENS
    d = fake_token_dir(tmp_path / "d", HEAD_CHECK_TOKENS + 64 * 17)
    arr = np.memmap(d / "train-00000.bin", dtype=np.uint16, mode="r+")
    arr[HEAD_CHECK_TOKENS:] = 1000  # every window past the head
    arr.flush()
    _, train, _ = open_data(str(d), 16, 0, 320)
    late = next(i for i in range(train.n_windows) if train.window(i) * 16 > HEAD_CHECK_TOKENS)
    with pytest.raises(DataError, match="holds id 1000.*outside model.vocab_size"):
        train.samples(late, 1)
    assert isinstance(train, BatchSource)
