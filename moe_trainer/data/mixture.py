"""Weighted mixtures of token sets (data.sources): which source global sample i reads, and which window.

Sample i of the run goes to a source by a fixed schedule, then to a window of that source by the
source's own keyed bijection (sampling.WindowOrder, keyed by the seed and the source's name;
epochs wrap per source). Both are pure functions of (seed, i): the same global batches on any
layout and after a resume, and no state to checkpoint beyond the step.

The schedule. The weights are read as exact fractions (0.8 is 4/5), normalised to shares
q_j / P with P the least common denominator (at most MAX_PERIOD; past that the shares are
rounded to multiples of 1 / MAX_PERIOD, largest remainders first). One period of P samples
holds exactly q_j samples of source j, placed by earliest deadline first: source j's m-th
sample of the period may go in no slot before floor(m P / q_j) and must go by
ceil((m + 1) P / q_j) - 1, the slots that keep its count within one sample of q_j n / P
after n samples; such a schedule exists for any shares (Tijdeman's chairman assignment theorem),
and earliest deadline first finds one. So over every prefix of the run, each source's realised
count is within one sample of its target, which Megatron's BlendedDataset keeps too (with
a greedy over the whole run's samples, cached per run). The period's table is the only state:
the source of each slot (uint16) and its rank among that source's slots (int32), 6 bytes a slot,
at most 384 KiB per rank whatever the run's length.
"""
from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from .errors import DataError
from .formats import megatron_prefix, open_token_set, read_megatron_index
from .sampling import BatchSource

MAX_PERIOD = 1 << 16


def source_name(entry: dict) -> str:
    """A source's name: `name`, else its path's basename (a Megatron prefix's, a token directory's)."""
    if entry.get("name"):
        return str(entry["name"])
    path = str(entry["path"]).rstrip("/")
    prefix = megatron_prefix(path)
    return Path(prefix if prefix is not None else path).name


def shares(weights: list) -> list[Fraction]:
    """Weights (numbers) as exact normalised fractions: 0.8 reads as 4/5, as written."""
    exact = [Fraction(str(w)) if isinstance(w, float) else Fraction(w) for w in weights]
    total = sum(exact)
    return [w / total for w in exact]


def period_counts(weights: list) -> list[int]:
    """q_j: samples of each source in one period (sum q_j = P <= MAX_PERIOD, each q_j >= 1)."""
    s = shares(weights)
    period = math.lcm(*(f.denominator for f in s))
    if period <= MAX_PERIOD:
        return [int(f * period) for f in s]
    raw = [f * MAX_PERIOD for f in s]  # rounded to 1 / MAX_PERIOD: largest remainders take the rest
    q = [max(1, int(r)) for r in raw]
    for j in sorted(range(len(q)), key=lambda j: raw[j] - int(raw[j]), reverse=True)[:MAX_PERIOD - sum(q)]:
        q[j] += 1
    return q


def schedule(q: list[int]) -> np.ndarray:
    """One period's slots -> source, (P,) int64: earliest deadline first among released samples.

    Source j's m-th sample is released at slot floor(m P / q_j) and due by slot
    ceil((m + 1) P / q_j) - 1 (inclusive); ties go to the lower source index."""
    period = sum(q)
    taken = [0] * len(q)
    released = [(0, j) for j in range(len(q))]  # (release slot, source) of each source's next sample
    ready: list = []  # (deadline slot, source)
    out = np.empty(period, dtype=np.int64)
    for slot in range(period):
        while released and released[0][0] <= slot:
            _, j = heapq.heappop(released)
            heapq.heappush(ready, (-(-(taken[j] + 1) * period // q[j]) - 1, j))
        deadline, j = heapq.heappop(ready)
        assert deadline >= slot  # the chairman theorem: never late
        out[slot] = j
        taken[j] += 1
        if taken[j] < q[j]:
            heapq.heappush(released, (taken[j] * period // q[j], j))
    return out


class Mixture:
    """Global sample i -> (source, that source's own sample number), O(1) per sample."""

    def __init__(self, weights: list):
        self.q = np.asarray(period_counts(weights), dtype=np.int64)  # (k,)
        self.period = int(self.q.sum())
        slots = schedule(self.q.tolist())
        self.slot_source = slots.astype(np.uint16)  # (P,)
        rank = np.empty(self.period, dtype=np.int32)  # (P,) the slot's rank among its source's slots
        for j in range(len(self.q)):
            mine = slots == j
            rank[mine] = np.arange(int(mine.sum()), dtype=np.int32)
        self.slot_rank = rank

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(m,) global samples -> ((m,) source index, (m,) sample number within that source), int64."""
        cycle, slot = np.divmod(np.asarray(samples, dtype=np.int64), self.period)
        source = self.slot_source[slot].astype(np.int64)
        return source, cycle * self.q[source] + self.slot_rank[slot]

    def counts(self, n: int) -> np.ndarray:
        """(k,) int64: samples each source gave among global samples [0, n)."""
        cycle, rest = divmod(int(n), self.period)
        return cycle * self.q + np.bincount(self.slot_source[:rest], minlength=len(self.q)).astype(np.int64)


class MixtureSource:
    """A BatchSource over several token sets: the same micro_batch interface, one batch mixing them."""

    def __init__(self, names: list[str], sources: list[BatchSource], weights: list):
        self.names, self.sources, self.mixture = names, sources, Mixture(weights)
        self.seq_len = sources[0].seq_len
        self.vocab_size = sources[0].vocab_size

    def samples(self, start: int, count: int):
        """Global samples [start, start + count) -> (count, seq_len + 1) int64 tensor, in sample order."""
        import torch
        which, number = self.mixture.locate(np.arange(start, start + count, dtype=np.int64))
        rows = torch.empty(count, self.seq_len + 1, dtype=torch.int64)
        for j in np.unique(which).tolist():  # host numpy: a batch's sources, each read in one call
            sel = np.flatnonzero(which == j)
            rows[torch.from_numpy(sel)] = self.sources[j].samples_at(number[sel])
        return rows

    def micro_batch(self, step: int, micro: int, global_batch: int, micro_batch: int, dp_rank: int, dp: int):
        per_rank = global_batch // dp
        return self.samples(step * global_batch + dp_rank * per_rank + micro * micro_batch, micro_batch)

    def drawn(self, n: int) -> dict[str, int]:
        """{source name: samples of it among global samples [0, n)}."""
        return dict(zip(self.names, (int(c) for c in self.mixture.counts(n))))


@dataclass
class OpenedSource:
    name: str
    index: dict
    train: BatchSource
    val: BatchSource


def open_sources(entries: list[dict], seq_len: int, seed: int, model_vocab: int, val_fraction: float,
                 tokenizer: str) -> list[OpenedSource]:
    """Each data.sources entry as train/val batch sources; they must share one tokenizer."""
    opened = []
    for e in entries:
        name = source_name(e)
        index, streams = open_token_set(str(e["path"]), model_vocab, tokenizer, val_fraction)
        vocab = min(model_vocab, index["vocab_size"])
        opened.append(OpenedSource(name, index,
                                   BatchSource(streams["train"], seq_len, seed, vocab_size=vocab, key=name),
                                   BatchSource(streams["val"], seq_len, seed, shuffle=False, vocab_size=vocab)))
    for o in opened[1:]:
        check_same_tokenizer(o, opened[0], "data.sources")
    return opened


def check_same_tokenizer(o: OpenedSource, first: OpenedSource, what: str) -> None:
    """One tokenizer for a mixture: the same vocabulary and end-of-text id, and the same tokenizer.json
    (its sha256) where both indexes record one (the byte-level default records its type instead)."""
    def ident(index: dict) -> tuple:
        tok = index.get("tokenizer") or {}
        return index["vocab_size"], index.get("eos_id", tok.get("eos_id")), tok.get("sha256")
    mine, theirs = ident(o.index), ident(first.index)
    if mine[:2] != theirs[:2] or (mine[2] and theirs[2] and mine[2] != theirs[2]):
        raise DataError(f"{what} {o.name!r} was made with another tokenizer than data.sources {first.name!r} "
                        f"(vocab, end-of-text id, tokenizer.json sha256: {mine} vs {theirs}); prepare every source "
                        f"with one tokenizer.")


def open_mixture(entries: list[dict], val_entries: list[dict], seq_len: int, seed: int, model_vocab: int,
                 val_fraction: float = 0.02, tokenizer: str = "") -> tuple[dict, MixtureSource, dict]:
    """(a summary index, the training MixtureSource, {name: validation BatchSource}). Validation is
    each source's own val split, or the val splits of data.val_sources where it lists any."""
    train = open_sources(entries, seq_len, seed, model_vocab, val_fraction, tokenizer)
    val = open_sources(val_entries, seq_len, seed, model_vocab, val_fraction, tokenizer) if val_entries else train
    if val is not train:
        check_same_tokenizer(val[0], train[0], "data.val_sources")
    source = MixtureSource([o.name for o in train], [o.train for o in train], [e["weight"] for e in entries])
    first = train[0].index
    index = {**{k: v for k, v in first.items() if k in ("format", "dtype", "vocab_size", "eos_id", "tokenizer")},
             "splits": {split: {"num_tokens": sum(o.index["splits"][split]["num_tokens"] for o in train)}
                        for split in ("train", "val")},
             "sources": {o.name: {"path": str(e["path"]), "weight": e["weight"],
                                  "train_tokens": o.index["splits"]["train"]["num_tokens"]}
                         for o, e in zip(train, entries)}}
    return index, source, {o.name: o.val for o in val}


# ----------------------------------------------------------------------------- fingerprints

FINGERPRINT_EDGE = 1 << 20  # bytes of a Megatron .idx hashed at each end (its arrays grow with the corpus)


def fingerprint(path: str) -> dict:
    """What identifies a token set without reading its tokens: {hash, tokens}. A token directory:
    the sha256 of its index.json. A Megatron prefix: the sha256 of its .idx's size and first and
    last MiB (header, the first sequence lengths, the document index's tail) and the .bin's size."""
    prefix = megatron_prefix(path)
    if prefix is None:
        from .formats import read_index
        raw = (Path(path) / "index.json").read_bytes() if (Path(path) / "index.json").is_file() else b""
        index = read_index(Path(path))
        tokens = sum(int(index["splits"][s]["num_tokens"]) for s in index["splits"])
        return {"hash": hashlib.sha256(raw).hexdigest()[:16], "tokens": tokens}
    idx, bin_file = Path(prefix + ".idx"), Path(prefix + ".bin")
    size = idx.stat().st_size
    h = hashlib.sha256(f"{size}:{bin_file.stat().st_size}".encode())
    with open(idx, "rb") as f:
        h.update(f.read(FINGERPRINT_EDGE))
        f.seek(max(0, size - FINGERPRINT_EDGE))
        h.update(f.read(FINGERPRINT_EDGE))
    m = read_megatron_index(prefix)
    return {"hash": h.hexdigest()[:16], "tokens": int(m.pointers[-1]) // m.dtype.itemsize + int(m.lengths[-1])}
