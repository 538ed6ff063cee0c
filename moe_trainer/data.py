"""Token files and deterministic global batches.

On disk (tools/prepare_data.py and the default corpus write the same thing): a
directory with `index.json` and one flat memmap per split (`train.bin`,
`val.bin`, uint16 or uint32 token ids, documents separated by EOS).

Batches: the train split is cut into windows of seq_len + 1 tokens (stride
seq_len). Each epoch visits the windows in a permutation drawn from the run's
seed, so sample i of the run is a pure function of (seed, i): the same global
batches on any layout, and the data position on resume is the step number.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

FORMAT = "moe_trainer.tokens.v1"
BYTE_VOCAB = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258  # specials after the 256 byte values
BYTE_VOCAB_PADDED = 320  # 259 rounded up to a multiple of 64


class DataError(ValueError):
    """Bad data files: the message is one user-facing sentence."""


def pad_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


# ----------------------------------------------------------------------------- writing

def _is_val(name: str, val_fraction: float) -> bool:
    """Deterministic per-document split from a hash of the document's name."""
    return (zlib.crc32(name.encode()) % 100_000) < val_fraction * 100_000


def write_token_dir(out_dir: Path, docs: Iterable[tuple[str, np.ndarray]], vocab_size: int, eos_id: int,
                    val_fraction: float, tokenizer: dict) -> dict:
    """Write (name, ids) documents as train/val memmaps + index.json, atomically.

    Everything goes to a temporary sibling directory renamed into place at the
    end, so a crash never leaves a token directory that looks complete.
    """
    out_dir = Path(out_dir)
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        index = _write_splits(tmp, docs, dtype, vocab_size, eos_id, val_fraction, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written token directory
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / "index.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # a concurrent writer (another rank) put it there first
    return index


def _write_splits(tmp: Path, docs, dtype, vocab_size: int, eos_id: int, val_fraction: float, tokenizer: dict
                  ) -> dict:
    counts = {"train": 0, "val": 0}
    n_docs = {"train": 0, "val": 0}
    sep = np.array([eos_id], dtype=dtype)
    with open(tmp / "train.bin", "wb") as ftrain, open(tmp / "val.bin", "wb") as fval:
        for name, ids in docs:
            if len(ids) == 0:
                continue
            if int(ids.max()) >= vocab_size:
                raise DataError(f"document {name} has token id {int(ids.max())} >= vocab_size {vocab_size}.")
            split = "val" if _is_val(name, val_fraction) else "train"
            f = fval if split == "val" else ftrain
            f.write(ids.astype(dtype).tobytes())
            f.write(sep.tobytes())
            counts[split] += len(ids) + 1
            n_docs[split] += 1
    if counts["train"] == 0 or counts["val"] == 0:
        raise DataError(f"the corpus is empty or too small to split: {counts['train']} train and "
                        f"{counts['val']} validation tokens.")
    index = {"format": FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "eos_id": eos_id,
             "tokenizer": tokenizer,
             "splits": {s: {"file": f"{s}.bin", "num_tokens": counts[s], "documents": n_docs[s]}
                        for s in ("train", "val")}}
    (tmp / "index.json").write_text(json.dumps(index, indent=1))
    return index


def stdlib_files() -> list[Path]:
    """The running Python's standard-library .py files in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def default_corpus_dir(val_fraction: float = 0.02) -> Path:
    """Build (once, cached) the default corpus: stdlib .py files as bytes. The cache is keyed by
    the standard library's place and the interpreter's exact version and build (an installed
    stdlib does not change under one build), so a start-up finds it without walking the tree."""
    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(json.dumps([str(root), sys.version, FORMAT, val_fraction]).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("MOE_TRAINER_CACHE", Path.home() / ".cache" / "moe_trainer"))
    out = cache / f"stdlib-{key}"
    if not (out / "index.json").is_file():
        files = stdlib_files()
        docs = ((str(p.relative_to(root)), np.frombuffer(p.read_bytes(), dtype=np.uint8)) for p in files)
        write_token_dir(out, docs, BYTE_VOCAB_PADDED, EOS_ID, val_fraction,
                        {"type": "bytes", "bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID})
    return out


# ----------------------------------------------------------------------------- reading

@dataclass
class TokenSplit:
    tokens: np.ndarray  # memmap (N,)
    name: str


def open_token_dir(path: str | Path, model_vocab: int) -> tuple[dict, dict[str, TokenSplit]]:
    """Open and check a token directory: format, sizes, ids within the model's vocabulary."""
    path = Path(path)
    index_file = path / "index.json"
    if not index_file.is_file():
        raise DataError(f"data.path {path} has no index.json; make token files with tools/prepare_data.py.")
    try:
        index = json.loads(index_file.read_text())
        dtype = np.dtype(index["dtype"])
        splits_meta = index["splits"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{index_file} is not a valid token index ({e}).") from None
    if index.get("format") != FORMAT:
        raise DataError(f"{index_file} has format {index.get('format')!r}, expected {FORMAT!r}.")
    if index["vocab_size"] > model_vocab:
        raise DataError(f"the data's vocab_size ({index['vocab_size']}) exceeds model.vocab_size ({model_vocab}).")
    splits = {}
    for name in ("train", "val"):
        meta = splits_meta.get(name)
        if meta is None:
            raise DataError(f"{index_file} lists no {name!r} split.")
        f = path / meta["file"]
        expected = meta["num_tokens"] * dtype.itemsize
        if not f.is_file() or f.stat().st_size != expected:
            size = f.stat().st_size if f.is_file() else 0
            raise DataError(f"token file {f} is truncated or missing: {size} bytes, index says {expected}.")
        if meta["num_tokens"] == 0:
            raise DataError(f"token file {f} is empty.")
        tokens = np.memmap(f, dtype=dtype, mode="r")
        top = _max_id(tokens)
        if top >= model_vocab:
            raise DataError(f"token file {f} holds id {top}, outside model.vocab_size ({model_vocab}).")
        splits[name] = TokenSplit(tokens, name)
    return index, splits


def _max_id(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    return max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))


class BatchSource:
    """Global batch `step` of `global_batch` windows, sliced for one data-parallel rank."""

    def __init__(self, split: TokenSplit, seq_len: int, seed: int, shuffle: bool = True):
        self.tokens, self.seq_len, self.seed, self.shuffle = split.tokens, seq_len, seed, shuffle
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"the {split.name} split has {len(self.tokens)} tokens, fewer than train.seq_len + 1 "
                            f"({seq_len + 1}).")
        self._perm_epoch, self._perm = -1, None

    def window(self, sample: int) -> int:
        """Global sample index -> window index (epoch-wise permutation)."""
        epoch, pos = divmod(sample, self.n_windows)
        if not self.shuffle:
            return pos
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.n_windows), epoch
        return int(self._perm[pos])

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Windows for global samples [start, start + count) -> (count, seq_len + 1) int64."""
        rows = []
        for s in range(start, start + count):
            w = self.window(s) * self.seq_len
            rows.append(np.asarray(self.tokens[w:w + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))

    def micro_batch(self, step: int, micro: int, global_batch: int, micro_batch: int, dp_rank: int, dp: int
                    ) -> torch.Tensor:
        """Rank `dp_rank`'s micro-batch `micro` of global batch `step`: a contiguous,
        disjoint slice, so the dp ranks together cover the global batch exactly once."""
        per_rank = global_batch // dp
        start = step * global_batch + dp_rank * per_rank + micro * micro_batch
        return self.samples(start, micro_batch)


def open_data(data_path: str, seq_len: int, seed: int, model_vocab: int, val_fraction: float = 0.02
              ) -> tuple[dict, BatchSource, BatchSource]:
    path = Path(data_path) if data_path else default_corpus_dir(val_fraction)
    index, splits = open_token_dir(path, model_vocab)
    return index, BatchSource(splits["train"], seq_len, seed), BatchSource(splits["val"], seq_len, seed,
                                                                           shuffle=False)


def unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    """Entropy (nats/token) of the token frequency distribution: the loss of the
    best model that ignores context."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def byte_tokenize(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def load_tokenizer(path: Optional[str]):
    """A local Hugging Face tokenizer.json (no download), or None for bytes."""
    if path is None:
        return None
    from tokenizers import Tokenizer
    if not Path(path).is_file():
        raise DataError(f"tokenizer file {path} does not exist.")
    return Tokenizer.from_file(str(path))


def iter_documents(files: list[str], jsonl_field: str = "text") -> Iterable[tuple[str, str]]:
    """(name, text) for plain text files (one document each) and JSONL files (one per line)."""
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise DataError(f"input file {f} does not exist.")
        if p.suffix in (".jsonl", ".json"):
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[jsonl_field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DataError(f"{f} line {i + 1} is not a JSON object with a {jsonl_field!r} string.") from None
                yield f"{f}:{i}", text
        else:
            yield str(f), p.read_text(encoding="utf-8", errors="replace")


def prepare(files: list[str], out_dir: str, tokenizer_path: Optional[str] = None, jsonl_field: str = "text",
            val_fraction: float = 0.02) -> dict:
    """Text/JSONL files -> token directory (byte-level, or a local tokenizer.json)."""
    tok = load_tokenizer(tokenizer_path)
    if tok is None:
        vocab, eos = BYTE_VOCAB_PADDED, EOS_ID
        meta = {"type": "bytes", "bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID}
        encode = byte_tokenize
    else:
        n = tok.get_vocab_size()
        eos = n  # one extra id for the document separator
        vocab = pad_vocab(n + 1)
        meta = {"type": "tokenizer.json", "path": str(Path(tokenizer_path).resolve()), "eos_id": eos}
        encode = lambda text: np.asarray(tok.encode(text).ids, dtype=np.int64)  # noqa: E731
    docs = ((name, encode(text)) for name, text in iter_documents(files, jsonl_field))
    return write_token_dir(Path(out_dir), docs, vocab, eos, val_fraction, meta)
