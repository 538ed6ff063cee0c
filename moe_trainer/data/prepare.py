"""Preparation: text in, a token directory out, streaming, in parallel, resumable.

The main process reads the inputs as streams and cuts them into chunks of about CHUNK_BYTES at
record boundaries; `workers` processes parse and tokenize each chunk in one batch (the tokenizers
library's batch encode) and return its ids split into train and validation; the main process
appends them, in input order, to the open shard of each split. When the train shard reaches
`shard_tokens` every open shard is closed (flushed, fsynced) and progress.json records the shards
and the input position after the chunk: a checkpoint. Memory is bounded by the chunks in
flight (2 per worker) and the tokenizer, whatever the corpus's size.

All of it happens in OUT.partial; the index (shards with their token counts and largest ids) is
written there last and the directory renamed to OUT, so OUT is complete or absent. A rerun with
the same inputs and settings resumes from the last checkpoint (finished shards are kept; the
open ones are written again), and starts over when they changed.

A document goes to validation by a hash of its text (inputs.SPLIT: blake2b of its UTF-8 bytes),
so the split is a property of the document alone: the same records as .jsonl, .jsonl.gz,
.jsonl.zst or Parquet rows fall the same way, identical documents always on one side, and
neither the files' names, their order nor where a record sits in them moves a document. A .txt
file is one document, hashed whole (its bytes, read once before its first piece is sent). The
default corpus (write_token_dir) keeps its split by file name (crc32), so the runs that trained
on it resume on the same tokens.
"""
from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import shutil
import signal
import time
from collections import deque
from contextlib import closing
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from .errors import DataError
from .formats import FORMAT
from .inputs import CHUNK_BYTES, SPLIT, Chunk, expand_inputs, name_in_val, read_chunks, text_in_val
from .tokenizer import byte_tokenize, describe_tokenizer, load_tokenizer

SHARD_TOKENS = 1 << 28  # 268M tokens per train shard (512 MB as uint16)
IN_FLIGHT_PER_WORKER = 2  # chunks queued per worker: enough to keep it busy, a bound on memory
PROGRESS = "progress.json"
PROGRESS_EVERY_S = 5.0


# ----------------------------------------------------------------------------- tokenizing (in the workers)

class Encoder:
    """Chunk -> its documents' ids per split, ended by EOS; bad records reported or counted."""

    def __init__(self, tokenizer: Optional[str], field: str, eos_id: int, dtype: str, val_fraction: float,
                 on_error: str):
        self.tok = load_tokenizer(tokenizer)
        self.field, self.eos_id, self.dtype = field, eos_id, np.dtype(dtype)
        self.val_fraction, self.on_error = val_fraction, on_error

    def records(self, chunk: Chunk) -> tuple[list[str], list[str]]:
        """(texts, messages of the records that are not a JSON object with a string field, naming
        their 1-based line or row)."""
        if chunk.kind == "text":
            return [chunk.payload], []
        if chunk.kind == "rows":
            rows = list(enumerate(chunk.payload, chunk.first + 1))
            bad = [f"{chunk.name} row {n} has no {self.field!r} string" for n, t in rows if not isinstance(t, str)]
            return [t for t in chunk.payload if isinstance(t, str)], bad
        texts, bad = [], []
        for n, line in enumerate(chunk.payload.split(b"\n"), chunk.first + 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[self.field]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError):
                text = None
            if isinstance(text, str):
                texts.append(text)
            else:
                bad.append(f"{chunk.name} line {n} is not a JSON object with a {self.field!r} string")
        return texts, bad

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.tok is None:
            return [byte_tokenize(t).tolist() for t in texts]
        batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # fast: no offsets computed
        # add_special_tokens=False: documents are separated by EOS alone, whatever the post-processor adds
        return [e.ids for e in batch(texts, add_special_tokens=False)]

    def __call__(self, chunk: Chunk) -> dict:
        texts, bad = self.records(chunk)
        if bad and self.on_error == "fail":
            return {"error": bad[0] + " (--on-error skip counts such records and goes on)."}
        out = {"skipped": len(bad), "skipped_examples": bad[:3], "ends_doc": chunk.ends_doc}
        val = [chunk.is_val] if chunk.kind == "text" else [text_in_val(t, self.val_fraction) for t in texts]
        for split, want in (("train", False), ("val", True)):
            out[split] = self._pack(self.encode([t for t, v in zip(texts, val) if v == want]), chunk.ends_doc)
        return out

    def _pack(self, docs: list[list[int]], ends_doc: bool) -> tuple[np.ndarray, int, int]:
        """(ids with EOS after each ended document, documents ended, largest id)."""
        docs = [d for d in docs if d]
        if ends_doc:
            for d in docs:
                d.append(self.eos_id)
        n = sum(len(d) for d in docs)
        ids = np.fromiter(itertools.chain.from_iterable(docs), dtype=self.dtype, count=n)
        return ids, (len(docs) if ends_doc else 0), (int(ids.max()) if n else -1)


_WORKER: dict = {}  # the worker process's Encoder, made once by _init_worker (the Pool initializer)


def _init_worker(args: tuple) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers is the parallelism
    # Ctrl-C reaches the whole process group: the main process stops the pool (a worker's own
    # KeyboardInterrupt would print its traceback and leave the pool half alive)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER["encoder"] = Encoder(*args)


def _encode_in_worker(chunk: Chunk) -> dict:
    return _WORKER["encoder"](chunk)


# ----------------------------------------------------------------------------- writing the shards

class ShardWriter:
    """One split's shards in the partial directory: the open one takes ids as they come; close()
    flushes and fsyncs it and lists it ({file, num_tokens, documents, max_id})."""

    def __init__(self, root: Path, split: str, closed: list[dict]):
        self.root, self.split, self.closed = root, split, list(closed)
        self.f, self.tokens, self.documents, self.max_id = None, 0, 0, -1

    def write(self, ids: np.ndarray, documents: int, max_id: int) -> None:
        if len(ids) == 0 and documents == 0:
            return
        if self.f is None:
            self.f = open(self.root / f"{self.split}-{len(self.closed):05d}.bin", "wb")
        self.f.write(ids.tobytes())
        self.tokens += len(ids)
        self.documents += documents
        self.max_id = max(self.max_id, max_id)

    def close(self) -> None:
        if self.f is None:
            return
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        self.closed.append({"file": Path(self.f.name).name, "num_tokens": self.tokens, "documents": self.documents,
                            "max_id": self.max_id})
        self.f, self.tokens, self.documents, self.max_id = None, 0, 0, -1

    def totals(self) -> dict:
        shards = self.closed
        return {"num_tokens": sum(s["num_tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                "max_id": max((s["max_id"] for s in shards), default=-1), "shards": shards}


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _checkpoint(root: Path, writers: dict, settings: dict, position: tuple, stats: dict) -> None:
    """Close every open shard, then record them with the input position after them."""
    for w in writers.values():
        w.close()
    _write_json(root / PROGRESS, {"settings": settings, "position": list(position), "stats": stats,
                                  "shards": {s: w.closed for s, w in writers.items()}})


def _begin(partial: Path, settings: dict, say: Callable[[str], None]) -> dict:
    """progress.json of a partial directory begun with the same settings (its unfinished shards
    removed), else a fresh partial directory's."""
    try:
        state = json.loads((partial / PROGRESS).read_text())
    except (OSError, ValueError):
        state = None
    if state is not None and state.get("settings") == settings:
        keep = {s["file"] for shards in state["shards"].values() for s in shards} | {PROGRESS}
        for f in partial.iterdir():
            if f.name not in keep:
                f.unlink()
        say(f"resuming {partial}: {len(state['shards']['train'])} train and {len(state['shards']['val'])} validation "
            f"shards kept, from input file {state['position'][0] + 1} record {state['position'][2] + 1}")
        return state
    if partial.exists():
        say(f"starting {partial} over: its inputs or settings differ from this command's")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    state = {"settings": settings, "position": [0, 0, 0], "shards": {"train": [], "val": []},
             "stats": {"skipped": 0, "tokens": 0}}
    _write_json(partial / PROGRESS, state)
    return state


def _check_splits(totals: dict, val_fraction: float) -> None:
    train, val = totals["train"]["num_tokens"], totals["val"]["num_tokens"]
    if train == 0 and val == 0:
        raise DataError("the corpus is empty or too small to split: 0 train and 0 validation tokens.")
    if val == 0:
        raise DataError(f"no document fell into validation ({train} train tokens): raise --val-fraction (now "
                        f"{val_fraction}) or give more documents.")
    if train == 0:
        raise DataError(f"every document fell into validation ({val} tokens): lower --val-fraction (now "
                        f"{val_fraction}) or give more documents.")


def _publish(tmp: Path, out: Path) -> None:
    """tmp -> out by rename; an existing out is moved aside first and deleted after, so out is
    never missing a file its index lists."""
    old = None
    if out.exists():
        old = out.with_name(out.name + f".old{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / "index.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # a concurrent writer put it there first
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _finish(root: Path, out: Path, writers: dict, head: dict, files: dict[str, str], val_fraction: float) -> dict:
    """Check the splits, write the tokenizer's files and the index (last), and publish."""
    for w in writers.values():
        w.close()
    totals = {s: w.totals() for s, w in writers.items()}
    _check_splits(totals, val_fraction)
    for name, text in files.items():
        (root / name).write_text(text)
    index = {"format": FORMAT, **head, "splits": totals}
    _write_json(root / "index.json", index)
    (root / PROGRESS).unlink(missing_ok=True)
    _publish(root, out)
    return index


def _dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


# ----------------------------------------------------------------------------- the preparation

class Progress:
    """Throughput and ETA, said every PROGRESS_EVERY_S seconds. The rate counts this session's
    bytes only: from the first chunk it finished (a resume's first chunk already stands far into
    the inputs), so the ETA is the bytes left at that rate."""

    def __init__(self, total_bytes: int, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.total, self.say, self.clock = total_bytes, say, clock
        self.t0 = self.last = self.start_bytes = None
        self.tokens, self.consumed = 0, 0

    def update(self, consumed: int, tokens: int) -> None:
        now, self.consumed = self.clock(), consumed
        if self.t0 is None:  # the baseline: where this session's first finished chunk ends
            self.t0 = self.last = now
            self.start_bytes = consumed
            return
        self.tokens += tokens
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last, dt = now, max(now - self.t0, 1e-9)
        rate = (consumed - self.start_bytes) / dt  # input bytes/s
        eta = f"ETA {(self.total - consumed) / rate:.0f} s" if rate > 0 else "no ETA yet"
        self.say(f"{self.done()} of {self.total / 1e6:,.0f} MB, {rate / 1e6:.1f} MB/s, "
                 f"{self.tokens / dt / 1e6:.2f}M tokens/s, {eta}")

    def done(self) -> str:
        return f"{100 * self.consumed / max(self.total, 1):.1f}%"


def _encoded(chunks: Iterator[Chunk], workers: int, encoder_args: tuple) -> Iterator[tuple[Chunk, dict]]:
    """(chunk, its encoding) in input order; `workers` processes, at most IN_FLIGHT_PER_WORKER
    chunks queued per worker (Pool.imap would read ahead without bound), or in this process for 1."""
    if workers <= 1:
        encoder = Encoder(*encoder_args)
        for c in chunks:
            yield c, encoder(c)
        return
    # spawn: workers start clean (no inherited tokenizer threads) and import numpy, not torch
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(encoder_args,)) as pool:
        pending: deque = deque()
        for c in chunks:
            pending.append((c, pool.apply_async(_encode_in_worker, (c,))))
            if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                c0, r = pending.popleft()
                yield c0, r.get()
        while pending:
            c0, r = pending.popleft()
            yield c0, r.get()


def _settings(inputs: list[tuple[Path, str]], tok_meta: dict, field: str, val_fraction: float, shard_tokens: int,
              on_error: str) -> dict:
    """What a resume must find unchanged: the inputs (path, size, mtime), the tokenizer and the settings."""
    return {"format": FORMAT, "inputs": [[str(p.resolve()), key, p.stat().st_size, p.stat().st_mtime_ns]
                                         for p, key in inputs],
            "tokenizer": tok_meta, "field": field, "val_fraction": val_fraction, "shard_tokens": shard_tokens,
            "on_error": on_error, "split": SPLIT}


def prepare(files: list[str], out_dir: str, tokenizer_path: Optional[str] = None, jsonl_field: str = "text",
            val_fraction: float = 0.02, eos_token: Optional[str] = None, *, workers: int = 1,
            shard_tokens: int = SHARD_TOKENS, on_error: str = "fail", chunk_bytes: int = CHUNK_BYTES,
            say: Optional[Callable[[str], None]] = None) -> dict:
    """Text/JSONL/Parquet files, directories or globs -> token directory (byte-level, or a local
    Hugging Face tokenizer whose own end-of-text token separates documents); the tokenizer's files
    go with the tokens. Resumes an interrupted run of the same command."""
    if on_error not in ("fail", "skip"):
        raise DataError(f"--on-error must be fail or skip, got {on_error!r}.")
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction must be between 0 and 1, got {val_fraction}.")
    say = say or (lambda line: None)
    inputs = expand_inputs(files)
    vocab, meta, tok_files = describe_tokenizer(tokenizer_path, eos_token)
    meta = {k: v for k, v in meta.items() if k != "source"}  # where the tokenizer lay does not make the tokens
    out = Path(out_dir)
    partial = out.with_name(out.name + ".partial")
    settings = _settings(inputs, meta, jsonl_field, val_fraction, shard_tokens, on_error)
    state = _begin(partial, settings, say)
    writers = {s: ShardWriter(partial, s, state["shards"][s]) for s in ("train", "val")}
    progress = Progress(sum(p.stat().st_size for p, _ in inputs), say)
    try:
        stats = _run(inputs, partial, writers, state, settings, vocab, tokenizer_path, meta["eos_id"], workers,
                     chunk_bytes, say, progress)
        head = {"dtype": _dtype(vocab), "vocab_size": vocab, "eos_id": meta["eos_id"], "tokenizer": meta,
                "skipped": stats["skipped"], "val_fraction": val_fraction,
                "split": SPLIT}
        return _finish(partial, out, writers, head, tok_files, val_fraction)
    except DataError:
        shutil.rmtree(partial, ignore_errors=True)  # bad input: a rerun would meet it again
        raise
    except KeyboardInterrupt as e:  # SIGINT, or a signal the caller turned into one (tools/prepare_data.py)
        raise Interrupted(stopped_sentence(str(e) or "an interrupt", progress, partial, len(inputs))) from None


class Interrupted(KeyboardInterrupt):
    """prepare() stopped by a signal; its message says where, and that the same command resumes."""


def stopped_sentence(what: str, progress: Progress, partial: Path, files: int) -> str:
    """Where an interrupted preparation stopped and where a rerun picks up (the last checkpoint)."""
    try:
        state = json.loads((partial / PROGRESS).read_text())
        kept, (fi, _, record) = len(state["shards"]["train"]), state["position"]
        resume = (f"which keeps {kept} finished train shard{'s' if kept != 1 else ''} and goes on from input "
                  f"file {fi + 1} of {files}, record {record + 1}")
    except (OSError, ValueError, KeyError):
        resume = "from the start"
    return (f"stopped by {what} at {progress.done()} of the input; the worker processes are shut down; run the "
            f"same command again to resume from {partial}, {resume}.")


def _run(inputs, partial, writers, state, settings, vocab, tokenizer_path, eos_id, workers, chunk_bytes, say,
         progress: Progress) -> dict:
    """Encode and write from the recorded position on; a checkpoint whenever the train shard fills.
    Whatever ends it (an error, an interrupt), the worker pool is shut down on the way out."""
    stats = dict(state["stats"])
    args = (tokenizer_path, settings["field"], eos_id, _dtype(vocab), settings["val_fraction"], settings["on_error"])
    chunks = read_chunks(inputs, tuple(state["position"]), chunk_bytes, settings["field"], settings["val_fraction"])
    with closing(_encoded(chunks, workers, args)) as encoded:
        for chunk, enc in encoded:
            _take(chunk, enc, partial, writers, settings, stats, progress, say)
    return stats


def _take(chunk: Chunk, enc: dict, partial: Path, writers: dict, settings: dict, stats: dict, progress: Progress,
          say: Callable[[str], None]) -> None:
    """One encoded chunk: its ids appended to the open shards, its counts, and a checkpoint when
    the train shard is full."""
    if "error" in enc:
        raise DataError(enc["error"])
    for split, w in writers.items():
        w.write(*enc[split])
    for example in enc["skipped_examples"][:max(0, 3 - stats["skipped"])]:
        say(f"skipped: {example}")
    stats["skipped"] += enc["skipped"]
    tokens = len(enc["train"][0]) + len(enc["val"][0])
    stats["tokens"] += tokens
    progress.update(chunk.consumed, tokens)
    if enc["ends_doc"] and writers["train"].tokens >= settings["shard_tokens"]:
        _checkpoint(partial, writers, settings, chunk.end, stats)


# ----------------------------------------------------------------------------- ids already made (the default corpus)


def write_token_dir(out_dir: Path, docs: Iterable[tuple[str, np.ndarray]], vocab_size: int, eos_id: int,
                    val_fraction: float, tokenizer: dict, files: Optional[dict[str, str]] = None,
                    shard_tokens: int = SHARD_TOKENS) -> dict:
    """Write (name, ids) documents as train/val shards + index.json (+ `files`, name -> text:
    the tokenizer's), atomically: a temporary sibling renamed into place at the end, so a crash
    never leaves a token directory that looks complete."""
    out_dir = Path(out_dir)
    dtype = _dtype(vocab_size)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        writers = {s: ShardWriter(tmp, s, []) for s in ("train", "val")}
        for name, ids in docs:
            if len(ids) == 0:
                continue
            top = int(ids.max())
            if top >= vocab_size:
                raise DataError(f"document {name} has token id {top} >= vocab_size {vocab_size}.")
            w = writers["val" if name_in_val(name, val_fraction) else "train"]
            w.write(np.append(ids.astype(dtype), np.array([eos_id], dtype=dtype)), 1, max(top, eos_id))
            if w.tokens >= shard_tokens:
                w.close()
        head = {"dtype": dtype, "vocab_size": vocab_size, "eos_id": eos_id, "tokenizer": tokenizer, "skipped": 0,
                "val_fraction": val_fraction, "split": "by crc32 of each document's name"}
        return _finish(tmp, out_dir, writers, head, files or {}, val_fraction)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written token directory
        raise
