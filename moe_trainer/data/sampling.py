"""Which window a sample reads: a keyed bijection over the windows, and the batches built on it.

The train split is cut into windows of seq_len + 1 tokens (stride seq_len). Epoch e visits the
windows in the order of a Feistel permutation keyed by (seed, e), so sample i of the run is a
pure function of (seed, i): the same global batches on any layout, the data position on resume
is the step number, and every epoch is as deterministic as the first. The permutation is
computed per sample from its keys (O(1) memory per rank, whatever the number of windows),
where a drawn permutation costs 8 bytes per window on every rank (2 GB at 1T tokens).

The Feistel network runs on 2h-bit integers, 4^h >= n windows (at most 4n); positions that land
at or past n walk the cycle (apply the permutation again) until they fall inside, which keeps it
a bijection on [0, n) and costs under 4 rounds of walking on average. Six rounds with a
splitmix64 round function: a pseudo-random permutation (Luby-Rackoff needs four).
"""
from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np

from .errors import DataError
from .formats import TokenStream

ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, (n,) uint64 -> (n,) uint64 (multiplication wraps mod 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class WindowOrder:
    """A bijection of [0, n) keyed by (seed, epoch) and, for a mixture's source, its name: position -> window."""

    def __init__(self, n: int, seed: int, epoch: int, key: str = ""):
        if n < 1:
            raise ValueError(f"a window order needs at least one window, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # 4^half >= n
        self.mask = np.uint64((1 << self.half) - 1)
        label = f"moe_trainer.windows:{seed}:{epoch}" + (f":{key}" if key else "")  # no key: one data.path's order
        digest = hashlib.blake2b(label.encode(), digest_size=8 * ROUNDS).digest()
        self.keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)  # (ROUNDS,)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        """One pass of the network over [0, 4^half), (m,) uint64."""
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """(m,) positions in [0, n) -> (m,) int64 windows, distinct positions to distinct windows."""
        y = self._feistel(np.asarray(positions, dtype=np.uint64))
        out = y >= np.uint64(self.n)
        while out.any():  # cycle walking: bounded, as each walk stays on the position's own cycle
            y[out] = self._feistel(y[out])
            out = y >= np.uint64(self.n)
        return y.astype(np.int64)


class BatchSource:
    """Global batch `step` of `global_batch` windows, sliced for one data-parallel rank."""

    def __init__(self, split: TokenStream, seq_len: int, seed: int, shuffle: bool = True,
                 vocab_size: Optional[int] = None, key: str = ""):
        self.stream, self.seq_len, self.seed, self.shuffle, self.key = split, seq_len, seed, shuffle, key
        self.vocab_size = vocab_size
        self.n_windows = (split.num_tokens - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"the {split.name} split has {split.num_tokens} tokens, fewer than train.seq_len + 1 "
                            f"({seq_len + 1}).")
        self._order: Optional[WindowOrder] = None  # the current epoch's (keys only: O(1) memory)
        self._order_epoch = -1

    def order(self, epoch: int) -> WindowOrder:
        if self._order is None or self._order_epoch != epoch:
            self._order, self._order_epoch = WindowOrder(self.n_windows, self.seed, epoch, self.key), epoch
        return self._order

    def windows(self, start: int, count: int) -> np.ndarray:
        """Global samples [start, start + count) -> (count,) window indices (int64)."""
        return self.windows_of(np.arange(start, start + count, dtype=np.int64))

    def windows_of(self, samples: np.ndarray) -> np.ndarray:
        """(m,) sample numbers of this source -> (m,) window indices (int64)."""
        epochs, positions = np.divmod(np.asarray(samples, dtype=np.int64), self.n_windows)
        if not self.shuffle:
            return positions
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs).tolist():  # host numpy: one or two epochs in a batch
            sel = epochs == epoch
            out[sel] = self.order(epoch)(positions[sel])
        return out

    def window(self, sample: int) -> int:
        return int(self.windows(sample, 1)[0])

    def samples(self, start: int, count: int):
        """Windows for global samples [start, start + count) -> (count, seq_len + 1) int64 tensor."""
        return self.samples_at(np.arange(start, start + count, dtype=np.int64))

    def samples_at(self, samples: np.ndarray):
        """(m,) sample numbers of this source (a mixture's, in any order) -> (m, seq_len + 1) int64 tensor."""
        import torch  # here, not at the top: prepare_data's workers import this package and never need torch
        windows = self.windows_of(samples)
        rows = np.stack([self.stream.read(int(w) * self.seq_len, self.seq_len + 1) for w in windows])
        if self.vocab_size is not None:  # host numpy, before the device: ids past the checked head
            top = rows.max(axis=1)
            if int(top.max()) >= self.vocab_size:
                at = int(windows[int(np.argmax(top))]) * self.seq_len
                raise DataError(f"token file {self.stream.where(at)} holds id {int(top.max())} (the {self.stream.name} "
                                f"split's token {at} on), outside model.vocab_size ({self.vocab_size}).")
        return torch.from_numpy(rows)

    def micro_batch(self, step: int, micro: int, global_batch: int, micro_batch: int, dp_rank: int, dp: int):
        """Rank `dp_rank`'s micro-batch `micro` of global batch `step`: a contiguous,
        disjoint slice, so the dp ranks together cover the global batch exactly once."""
        per_rank = global_batch // dp
        start = step * global_batch + dp_rank * per_rank + micro * micro_batch
        return self.samples(start, micro_batch)
