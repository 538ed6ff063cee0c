"""Token sets read in place: our token directory, and Megatron's indexed dataset.

Our token directory (tools/prepare_data.py and the default corpus write it): `index.json`, the
tokenizer as Hugging Face files (`tokenizer.json`, `tokenizer_config.json`), and per split
(train, val) shards of uint16/uint32 ids, documents each ended by the tokenizer's end-of-text id.
Format v2 lists every shard with its token count and largest id, so the start checks sizes
with a stat and ids against the index, reading no token file in full. Format v1 (one file
per split, no largest id) is still read; its start scans the ids as it always did.

Megatron's indexed dataset (megatron-core's IndexedDatasetBuilder, tools/preprocess_data.py):
PREFIX.bin holds the sequences end to end; PREFIX.idx is a header (magic, version, dtype code,
sequence and document counts), then sequence lengths (int32), byte pointers (int64) and the
document index (int64, sequence numbers where documents start, then the total). It is read in
place: its last documents (data.val_fraction of them) are the validation split, as Megatron's
own contiguous split cuts them, and the tokens are whatever the builder wrote (with
`--append-eod`, each document ends with the end-of-text id).

Either way a split is a TokenStream: its files end to end, any window may cross a file boundary.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from .errors import DataError
from .tokenizer import describe_tokenizer

FORMAT_V1 = "moe_trainer.tokens.v1"
FORMAT = "moe_trainer.tokens.v2"
MEGATRON_FORMAT = "megatron.indexed"
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}
# ids checked at start: at most this many from the head of each split (a bounded read that catches a
# wrong dtype or a damaged first shard); the rest is held to the index's largest id and to each batch
HEAD_CHECK_TOKENS = 1 << 22


@dataclass
class TokenStream:
    """One split: its token files end to end, read in place (memmaps; nothing is loaded)."""
    name: str
    parts: list  # memmaps, (n_i,) each
    files: list  # their paths, for messages
    max_id: Optional[int] = None  # the largest id, from the index; None where no index holds it
    ends: np.ndarray = field(init=False)  # (F,) int64: cumulative token counts

    def __post_init__(self):
        self.ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) -> (count,) int64, across file boundaries."""
        out = np.empty(count, dtype=np.int64)
        got, pos = 0, start
        part = int(np.searchsorted(self.ends, pos, side="right"))
        while got < count:
            begin = int(self.ends[part - 1]) if part else 0
            piece = self.parts[part][pos - begin:pos - begin + count - got]
            out[got:got + len(piece)] = piece
            got, pos, part = got + len(piece), pos + len(piece), part + 1
        return out

    def where(self, token: int) -> str:
        """The file holding token `token` (for messages)."""
        return str(self.files[min(int(np.searchsorted(self.ends, token, side="right")), len(self.files) - 1)])


# ----------------------------------------------------------------------------- our token directory

def read_index(path: Path) -> dict:
    index_file = path / "index.json"
    if not index_file.is_file():
        raise DataError(f"data.path {path} has no index.json; make token files with tools/prepare_data.py.")
    try:
        index = json.loads(index_file.read_text())
        for key, check in (("dtype", np.dtype), ("splits", dict), ("vocab_size", int)):
            check(index[key])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{index_file} is not a valid token index ({e}).") from None
    if index.get("format") not in (FORMAT, FORMAT_V1):
        raise DataError(f"{index_file} has format {index.get('format')!r}, expected {FORMAT!r}.")
    return index


def _shards(index: dict, split: str) -> list[dict]:
    """The split's files as v2 lists them ({file, num_tokens, max_id}); v1's one file, no max_id."""
    meta = index["splits"][split]
    if index["format"] == FORMAT_V1:
        return [{"file": meta["file"], "num_tokens": meta["num_tokens"], "max_id": None}]
    return meta["shards"]


def _open_file(f: Path, dtype: np.dtype, num_tokens: int) -> np.ndarray:
    expected = num_tokens * dtype.itemsize
    size = f.stat().st_size if f.is_file() else 0
    if size != expected:
        raise DataError(f"token file {f} is truncated or missing: {size} bytes, index says {expected}.")
    return np.memmap(f, dtype=dtype, mode="r")


def _scan_max(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    return max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))


def open_token_dir(path: str | Path, model_vocab: int) -> tuple[dict, dict[str, TokenStream]]:
    """Open and check a token directory: format, file sizes (a stat each), ids within the model's
    vocabulary (the index's largest ids; a v1 directory's files are scanned)."""
    path = Path(path)
    index = read_index(path)
    dtype = np.dtype(index["dtype"])
    if index["vocab_size"] > model_vocab:
        raise DataError(f"the data's vocab_size ({index['vocab_size']}) exceeds model.vocab_size ({model_vocab}); "
                        f"set model.vocab_size=auto (the data's vocabulary) or at least {index['vocab_size']}.")
    limit = min(model_vocab, index["vocab_size"])
    streams = {}
    for name in ("train", "val"):
        if name not in index["splits"]:
            raise DataError(f"{path / 'index.json'} lists no {name!r} split.")
        shards = [s for s in _shards(index, name) if s["num_tokens"] > 0]
        if not shards:
            raise DataError(f"the {name} split of {path} is empty.")
        parts, files, top = [], [], -1
        for s in shards:
            f = path / s["file"]
            parts.append(_open_file(f, dtype, s["num_tokens"]))
            files.append(f)
            s_max = _scan_max(parts[-1]) if s["max_id"] is None else int(s["max_id"])  # v1: scanned
            if s_max >= limit:
                _refuse_id(f, s_max, model_vocab, index["vocab_size"])
            top = max(top, s_max)
        stream = TokenStream(name, parts, files, top)
        check_head(stream, limit, model_vocab, index["vocab_size"])
        streams[name] = stream
    return index, streams


def _refuse_id(f, top: int, model_vocab: int, data_vocab: int):
    raise DataError(f"token file {f} holds id {top}, outside model.vocab_size ({model_vocab}) or the data's "
                    f"vocab_size ({data_vocab}); remake it with tools/prepare_data.py.")


def check_head(stream: TokenStream, limit: int, model_vocab: int, data_vocab: int) -> None:
    """The first HEAD_CHECK_TOKENS ids of the split against the vocabulary and the index: a bounded
    read, whatever the corpus's size, that catches a wrong dtype or a damaged file before the first step."""
    head = stream.read(0, min(stream.num_tokens, HEAD_CHECK_TOKENS))  # (n,) int64, host numpy
    outside = (head >= limit) | (head < 0)
    if outside.any():
        at = int(np.argmax(outside))
        _refuse_id(stream.where(at), int(head[at]), model_vocab, data_vocab)
    if stream.max_id is not None and int(head.max()) > stream.max_id:
        at = int(np.argmax(head))
        raise DataError(f"token file {stream.where(at)} holds id {int(head[at])}, above the largest id its index "
                        f"records ({stream.max_id}): it changed after preparation; remake it with "
                        f"tools/prepare_data.py.")


# ----------------------------------------------------------------------------- Megatron's indexed dataset

def megatron_prefix(data_path: str) -> Optional[str]:
    """The Megatron prefix data.path names (PREFIX, PREFIX.bin or PREFIX.idx with both files there), else None."""
    prefix = data_path[:-4] if data_path.endswith((".bin", ".idx")) else data_path
    if data_path and Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file():
        return prefix
    return None


@dataclass
class MegatronIndex:
    """PREFIX.idx's header and arrays (memmaps: opening reads only the header)."""
    dtype: np.dtype
    lengths: np.ndarray  # (S,) int32: tokens per sequence
    pointers: np.ndarray  # (S,) int64: byte offset of each sequence in PREFIX.bin
    documents: np.ndarray  # (D + 1,) int64: the first sequence of each document, then S


def read_megatron_index(prefix: str) -> MegatronIndex:
    idx = Path(prefix + ".idx")
    raw = idx.read_bytes()[:MEGATRON_HEADER.size] if idx.stat().st_size >= MEGATRON_HEADER.size else b""
    if len(raw) < MEGATRON_HEADER.size or raw[:9] != MEGATRON_MAGIC:
        raise DataError(f"{idx} is not a Megatron indexed dataset index (no MMIDIDX header).")
    _, version, code, n_seq, n_doc = MEGATRON_HEADER.unpack(raw)
    if version != 1 or code not in MEGATRON_DTYPES:
        raise DataError(f"{idx} has version {version} and dtype code {code}; version 1 with codes "
                        f"{sorted(MEGATRON_DTYPES)} are read.")
    need = MEGATRON_HEADER.size + 12 * n_seq + 8 * n_doc
    if idx.stat().st_size < need:
        raise DataError(f"{idx} is truncated: {idx.stat().st_size} bytes, its header needs {need}.")
    off = MEGATRON_HEADER.size
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=off, shape=(n_seq,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=off + 4 * n_seq, shape=(n_seq,))
    documents = np.memmap(idx, dtype=np.int64, mode="r", offset=off + 12 * n_seq, shape=(n_doc,))
    return MegatronIndex(np.dtype(MEGATRON_DTYPES[code]), lengths, pointers, documents)


def open_megatron(prefix: str, model_vocab: int, tokenizer: str, val_fraction: float
                  ) -> tuple[dict, dict[str, TokenStream]]:
    """A Megatron prefix as train/val streams over PREFIX.bin in place, with the vocabulary and
    end-of-text id of `tokenizer` (data.tokenizer); O(1) reads of the index whatever its size."""
    vocab, meta, _ = megatron_tokenizer(prefix, tokenizer)
    if vocab > model_vocab:
        raise DataError(f"data.tokenizer's vocab_size ({vocab}) exceeds model.vocab_size ({model_vocab}); set "
                        f"model.vocab_size=auto (the tokenizer's vocabulary) or at least {vocab}.")
    m = read_megatron_index(prefix)
    n_docs = len(m.documents) - 1
    if n_docs < 2 or m.documents[0] != 0 or m.documents[-1] != len(m.lengths):
        raise DataError(f"{prefix}.idx holds {max(n_docs, 0)} documents; a train and a validation split need "
                        f"at least 2.")
    itemsize = m.dtype.itemsize
    bin_file = Path(prefix + ".bin")
    total = int(m.pointers[-1]) // itemsize + int(m.lengths[-1])  # the builder writes sequences end to end
    if bin_file.stat().st_size != total * itemsize or m.pointers[0] != 0:
        raise DataError(f"{bin_file} is {bin_file.stat().st_size} bytes, its index says {total * itemsize}.")
    n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
    cut = int(m.pointers[int(m.documents[n_docs - n_val])]) // itemsize  # first token of the validation documents
    tokens = np.memmap(bin_file, dtype=m.dtype, mode="r")
    streams = {"train": TokenStream("train", [tokens[:cut]], [bin_file]),
               "val": TokenStream("val", [tokens[cut:]], [bin_file])}
    limit = min(model_vocab, vocab)
    for s in streams.values():
        check_head(s, limit, model_vocab, vocab)
    index = {"format": MEGATRON_FORMAT, "dtype": m.dtype.name, "vocab_size": vocab, "eos_id": meta["eos_id"],
             "tokenizer": meta, "prefix": prefix,
             "splits": {"train": {"num_tokens": cut, "documents": n_docs - n_val},
                        "val": {"num_tokens": total - cut, "documents": n_val}}}
    return index, streams


def megatron_tokenizer(prefix: str, tokenizer: str) -> tuple[int, dict, dict]:
    if not tokenizer:
        raise DataError(f"data.path {prefix} is a Megatron indexed dataset, which carries no tokenizer; name the "
                        f"one it was made with as data.tokenizer (a tokenizer.json or a Hugging Face tokenizer "
                        f"directory).")
    return describe_tokenizer(tokenizer)


# ----------------------------------------------------------------------------- either

def open_token_set(data_path: str, model_vocab: int, tokenizer: str = "", val_fraction: float = 0.02
                   ) -> tuple[dict, dict[str, TokenStream]]:
    """A token directory or a Megatron prefix: (index, {train, val} streams). One interface, so a
    mixture's sources can be either."""
    prefix = megatron_prefix(data_path)
    if prefix is not None:
        return open_megatron(prefix, model_vocab, tokenizer, val_fraction)
    index, streams = open_token_dir(data_path, model_vocab)
    if tokenizer:
        check_tokenizer(data_path, index, tokenizer)
    return index, streams


def check_tokenizer(data_path: str, index: dict, tokenizer: str) -> None:
    """data.tokenizer beside a token directory must be the one its tokens were made with."""
    vocab, meta, _ = describe_tokenizer(tokenizer)
    if vocab != index["vocab_size"] or meta["eos_id"] != index["eos_id"]:
        raise DataError(f"data.tokenizer {tokenizer} (vocab {vocab}, end-of-text id {meta['eos_id']}) is not the "
                        f"tokenizer of data.path {data_path} (vocab {index['vocab_size']}, end-of-text id "
                        f"{index['eos_id']}); drop data.tokenizer, or prepare the data with it.")


def token_set_vocab(data_path: str, tokenizer: str = "") -> int:
    """The vocabulary a token set was made for, from its index.json or, for a Megatron prefix,
    from data.tokenizer (padded to a multiple of 64)."""
    prefix = megatron_prefix(data_path)
    if prefix is not None:
        return megatron_tokenizer(prefix, tokenizer)[0]
    return int(read_index(Path(data_path))["vocab_size"])
