"""The inputs of a preparation as chunks of whole records, in input order, and the split rule.

read_chunks streams text, JSON lines (plain, .gz, .zst) and Parquet rows from a position
(file, offset, record) on, cut into chunks of about chunk_bytes at record boundaries, each
carrying where the next one starts (the resume point after it). text_in_val is the split: a
document goes to validation by a hash of its text alone (SPLIT), so the same records split the
same way in any file, encoding or order, and identical documents always fall on one side.
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from .errors import DataError

SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".json", ".parquet", ".txt")
CHUNK_BYTES = 1 << 20  # text per task: ~1 MB, a few tens of MB of encodings in a worker
PARQUET_ROWS = 1024
# how a document's split is chosen (index.json's "split" and the settings a resume must find unchanged:
# a partial directory begun under another rule starts over)
SPLIT = "blake2b-64 of the document's UTF-8 text < val_fraction * 2^64"


def expand_inputs(specs: Iterable[str]) -> list[tuple[Path, str]]:
    """Files, directories (their files with a known suffix, recursively) and globs -> sorted
    (file, name): the name is the path inside a directory given, else the file's own name."""
    out = []
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            found = [(f, f.relative_to(p).as_posix()) for f in sorted(p.rglob("*"))
                     if f.is_file() and f.name.endswith(SUFFIXES)]
        elif p.is_file():
            found = [(p, p.name)]
        elif glob.has_magic(spec):
            found = [(Path(f), Path(f).name) for f in sorted(glob.glob(spec, recursive=True)) if Path(f).is_file()]
        else:
            raise DataError(f"input file {spec} does not exist.")
        if not found:
            raise DataError(f"input {spec} names no .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet file.")
        out.extend(found)
    return out


def kind_of(path: Path) -> str:
    """How a file is read: JSON lines (plain or compressed), Parquet rows, or one text document."""
    for suffix, kind in ((".jsonl.gz", "gz"), (".jsonl.zst", "zst"), (".jsonl", "lines"), (".json", "lines"),
                         (".parquet", "parquet")):
        if path.name.endswith(suffix):
            return kind
    return "text"


# ----------------------------------------------------------------------------- reading the inputs

@dataclass
class Chunk:
    """A run of whole records (or a piece of one .txt document) for one worker task."""
    name: str  # the input file, for messages
    first: int  # records (lines or rows) of the file before this chunk
    kind: str  # "lines": JSON lines as bytes; "rows": Parquet texts; "text": a piece of a .txt document
    payload: object
    end: tuple  # (file, offset, record) where the next chunk starts: the resume point after this one
    consumed: int  # input bytes read through this chunk, for progress
    ends_doc: bool = True  # False for a .txt piece whose document goes on in the next chunk
    is_val: bool = False  # "text": the document's split, from its first piece


def _open_stream(path: Path, kind: str):
    """(decompressed binary stream, the raw file whose tell() measures progress)."""
    raw = open(path, "rb")
    if kind == "gz":
        return gzip.GzipFile(fileobj=raw), raw
    if kind == "zst":
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise DataError(f"{path} needs the zstandard package (pip install -e '.[data]').") from None
        return zstandard.ZstdDecompressor().stream_reader(raw), raw
    return raw, raw


def _skip(f, offset: int) -> None:
    """Forward to `offset` of a decompressed stream (a resume: decompressing is cheap, tokenizing is not)."""
    if f.seekable() and not isinstance(f, gzip.GzipFile):
        f.seek(offset)
        return
    while offset > 0:
        got = len(f.read(min(offset, 1 << 24)))
        if got == 0:
            break
        offset -= got


def _utf8_end(data: bytes) -> int:
    """len(data) less a UTF-8 character cut short at its end."""
    for k in range(1, min(4, len(data)) + 1):
        b = data[-k]
        if b & 0xC0 != 0x80:  # ASCII or a lead byte: the last character starts here
            size = 1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return len(data) - k if size > k else len(data)
    return len(data)


def _blobs(f, chunk_bytes: int, whole_lines: bool) -> Iterator[bytes]:
    """Blocks ending at a newline: each the stream's next chunk_bytes cut after its last newline, so
    where the blocks fall depends only on where the first one starts (a resume cuts as the first
    run did). A line longer than that is kept whole when `whole_lines` (a JSON record), else cut
    where a UTF-8 character starts."""
    data = b""
    while True:
        block = f.read(chunk_bytes - len(data) if len(data) < chunk_bytes else chunk_bytes)
        data += block
        if not block:
            if data:
                yield data
            return
        if len(data) < chunk_bytes:
            continue  # a short read: fill the window first
        cut = data.rfind(b"\n") + 1
        if cut == 0 and not whole_lines:
            cut = _utf8_end(data)
        if cut == 0:
            continue  # a record longer than the window: read on
        yield data[:cut]
        data = data[cut:]


def _line_chunks(fi: int, path: Path, kind: str, offset: int, record: int, chunk_bytes: int,
                 before: int) -> Iterator[Chunk]:
    f, raw = _open_stream(path, kind)
    with f, raw:
        _skip(f, offset)
        for blob in _blobs(f, chunk_bytes, whole_lines=True):
            lines = blob.count(b"\n") + (not blob.endswith(b"\n"))
            offset += len(blob)
            yield Chunk(str(path), record, "lines", blob, (fi, offset, record + lines), before + raw.tell())
            record += lines


def _text_chunks(fi: int, path: Path, offset: int, chunk_bytes: int, before: int, val_fraction: float
                 ) -> Iterator[Chunk]:
    """One document per .txt file, in pieces at line ends when it is larger than a chunk. Shards
    close only between documents, so a resume starts at a file's beginning or its end."""
    with open(path, "rb") as f:
        val = offset == 0 and text_in_val(_file_digest(f), val_fraction)
        f.seek(offset)
        pieces = _blobs(f, chunk_bytes, whole_lines=False)
        piece = next(pieces, None)
        while piece is not None:
            following = next(pieces, None)
            offset += len(piece)
            yield Chunk(str(path), 0, "text", piece.decode("utf-8", errors="replace"), (fi, offset, 0),
                        before + f.tell(), following is None, val)
            piece = following


def _file_digest(f) -> "hashlib.blake2b":
    """SPLIT's hash of a whole file, read in blocks (a .txt document may be larger than memory allows)."""
    h = hashlib.blake2b(digest_size=8)
    for block in iter(lambda: f.read(1 << 24), b""):
        h.update(block)
    return h


def _parquet_chunks(fi: int, path: Path, row: int, field: str, before: int) -> Iterator[Chunk]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path} needs the pyarrow package (pip install -e '.[data]').") from None
    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path} has no column {field!r} (it has {', '.join(pf.schema_arrow.names)}); name the "
                        f"text column with --field.")
    total, size = pf.metadata.num_rows, path.stat().st_size
    starts = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
    group = int(np.searchsorted(starts, row, side="right")) - 1  # the row group holding `row`
    at = int(starts[max(group, 0)])
    for batch in pf.iter_batches(batch_size=PARQUET_ROWS, row_groups=range(max(group, 0), pf.num_row_groups),
                                 columns=[field]):
        texts = batch.column(0).to_pylist()[max(row - at, 0):]
        at += batch.num_rows
        if texts:
            yield Chunk(str(path), row, "rows", texts, (fi, at, at), before + size * at // max(total, 1))
            row = at


def read_chunks(files: list[tuple[Path, str]], start: tuple, chunk_bytes: int, field: str, val_fraction: float
                ) -> Iterator[Chunk]:
    """The inputs from position `start` = (file, offset, record) on, as chunks in input order."""
    sizes = [f.stat().st_size for f, _ in files]
    for fi in range(start[0], len(files)):
        offset, record = (start[1], start[2]) if fi == start[0] else (0, 0)
        path, before = files[fi][0], sum(sizes[:fi])
        kind = kind_of(path)
        if kind == "parquet":
            yield from _parquet_chunks(fi, path, record, field, before)
        elif kind == "text":
            yield from _text_chunks(fi, path, offset, chunk_bytes, before, val_fraction)
        else:
            yield from _line_chunks(fi, path, kind, offset, record, chunk_bytes, before)



# ----------------------------------------------------------------------------- the split

def text_in_val(text, val_fraction: float) -> bool:
    """SPLIT: does a document go to validation? `text`: its str, its UTF-8 bytes, or a blake2b
    (digest_size 8) already fed with them. A pure function of the text: where and how the document
    is stored never enters, so identical documents share a side."""
    if isinstance(text, str):
        text = text.encode("utf-8", errors="surrogatepass")  # a JSON string may hold a lone surrogate escape
    h = text if hasattr(text, "digest") else hashlib.blake2b(text, digest_size=8)
    return int.from_bytes(h.digest(), "little") < val_fraction * 2.0 ** 64


def name_in_val(name: str, val_fraction: float) -> bool:
    """The default corpus's split (write_token_dir), from a document's name: crc32 into 100,000 buckets."""
    return (zlib.crc32(name.encode()) % 100_000) < val_fraction * 100_000
