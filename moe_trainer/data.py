"""Token files and deterministic global batches.

On disk (tools/prepare_data.py and the default corpus write the same thing): a
directory with `index.json` and one flat memmap per split (`train.bin`,
`val.bin`, uint16 or uint32 token ids, documents separated by the tokenizer's
end-of-text token), and the tokenizer as Hugging Face files (`tokenizer.json`,
`tokenizer_config.json`), so `AutoTokenizer.from_pretrained(token_dir)` loads it;
the run directory and the Hugging Face export carry the same two files.

Batches: the train split is cut into windows of seq_len + 1 tokens (stride
seq_len). Each epoch visits the windows in a permutation drawn from the run's
seed, so sample i of the run is a pure function of (seed, i): the same global
batches on any layout, and the data position on resume is the step number.
"""
from __future__ import annotations

import fcntl
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
BYTE_SPECIALS = {BOS_ID: "<|bos|>", EOS_ID: "<|endoftext|>", PAD_ID: "<|pad|>"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# end-of-text tokens of common tokenizers (GPT-2 / Qwen, Llama 3 base, Llama 2 / Mistral, Gemma), in the
# order tried when no tokenizer_config.json beside the tokenizer.json names one
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>")


class DataError(ValueError):
    """Bad data files: the message is one user-facing sentence."""


def pad_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


# ----------------------------------------------------------------------------- writing

def _is_val(name: str, val_fraction: float) -> bool:
    """Deterministic per-document split from a hash of the document's name."""
    return (zlib.crc32(name.encode()) % 100_000) < val_fraction * 100_000


def write_token_dir(out_dir: Path, docs: Iterable[tuple[str, np.ndarray]], vocab_size: int, eos_id: int,
                    val_fraction: float, tokenizer: dict, files: Optional[dict[str, str]] = None) -> dict:
    """Write (name, ids) documents as train/val memmaps + index.json (+ `files`, name -> text:
    the tokenizer's), atomically.

    Everything goes to a temporary sibling directory renamed into place at the
    end, so a crash never leaves a token directory that looks complete.
    """
    out_dir = Path(out_dir)
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        index = _write_splits(tmp, docs, dtype, vocab_size, eos_id, val_fraction, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written token directory
        raise
    old = None
    if out_dir.exists():  # moved aside, not deleted first: out_dir is never missing a file it lists
        old = out_dir.with_name(out_dir.name + f".old{os.getpid()}")
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not (out_dir / "index.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # a concurrent writer put it there first
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
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
    if (out / "index.json").is_file() and all((out / name).is_file() for name in TOKENIZER_FILES):
        return out
    cache.mkdir(parents=True, exist_ok=True)
    # one builder: every rank of a job starts here at once, and the others wait for its directory
    # (two builders would replace one another's directory under a rank that is reading it)
    with open(cache / f"stdlib-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "index.json").is_file():
            files = stdlib_files()
            docs = ((str(p.relative_to(root)), np.frombuffer(p.read_bytes(), dtype=np.uint8)) for p in files)
            write_token_dir(out, docs, BYTE_VOCAB_PADDED, EOS_ID, val_fraction, BYTE_TOKENIZER,
                            byte_tokenizer_files())
        elif not all((out / name).is_file() for name in TOKENIZER_FILES):  # a cache from before they were
            for name, text in byte_tokenizer_files().items():
                tmp = out / f".{name}.tmp{os.getpid()}"
                tmp.write_text(text)
                os.replace(tmp, out / name)
    return out


BYTE_TOKENIZER = {"type": "bytes", "bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID,
                  "bos_token": BYTE_SPECIALS[BOS_ID], "eos_token": BYTE_SPECIALS[EOS_ID],
                  "pad_token": BYTE_SPECIALS[PAD_ID]}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which a ByteLevel tokenizer's vocabulary is written in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_files() -> dict[str, str]:
    """tokenizer.json + tokenizer_config.json of the byte-level tokenizer: byte b is id b, then
    BOS, EOS and PAD (256, 257, 258), exactly the default corpus's ids (a BPE without merges
    over GPT-2's byte alphabet), so transformers reads and writes the default corpus's text."""
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, text in BYTE_SPECIALS.items()]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
                 "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                           "ignore_merges": False, "vocab": {c: b for b, c in _bytes_to_unicode().items()},
                           "merges": []}}
    config = _tokenizer_config(BYTE_SPECIALS[EOS_ID], BYTE_SPECIALS[BOS_ID], BYTE_SPECIALS[PAD_ID])
    return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False), "tokenizer_config.json": config}


def _tokenizer_config(eos: str, bos: Optional[str], pad: Optional[str]) -> str:
    """What transformers' AutoTokenizer needs beside a tokenizer.json: the class and the special tokens."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, "eos_token": eos}
    if bos is not None:
        cfg["bos_token"] = bos
    if pad is not None:
        cfg["pad_token"] = pad
    return json.dumps(cfg, indent=1) + "\n"


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
        raise DataError(f"the data's vocab_size ({index['vocab_size']}) exceeds model.vocab_size ({model_vocab}); "
                        f"set model.vocab_size=auto (the data's vocabulary) or at least {index['vocab_size']}.")
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
        if top >= min(model_vocab, index["vocab_size"]):
            raise DataError(f"token file {f} holds id {top}, outside model.vocab_size ({model_vocab}) or the "
                            f"index's vocab_size ({index['vocab_size']}); remake it with tools/prepare_data.py.")
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


def data_vocab_size(data_path: str) -> int:
    """The vocabulary a token directory was written for (index.json's vocab_size, padded to a
    multiple of 64); the default corpus's without building it."""
    if not data_path:
        return BYTE_VOCAB_PADDED
    index_file = Path(data_path) / "index.json"
    try:
        return int(json.loads(index_file.read_text())["vocab_size"])
    except FileNotFoundError:
        raise DataError(f"data.path {data_path} has no index.json; make token files with "
                        f"tools/prepare_data.py.") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{index_file} is not a valid token index ({e}).") from None


def data_dir(data_path: str) -> Path:
    """The token directory a run reads: data.path, or the default corpus's cache."""
    return Path(data_path) if data_path else default_corpus_dir()


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
    if not Path(path).is_file():
        raise DataError(f"tokenizer file {path} does not exist.")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("--tokenizer needs the tokenizers package (pip install tokenizers).") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises its own Exception type
        raise DataError(f"{path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}).") from None


def _special_from_config(path: Path, key: str) -> Optional[str]:
    """A special token named by the tokenizer_config.json beside a tokenizer.json, if any."""
    cfg_file = path.with_name("tokenizer_config.json")
    try:
        value = json.loads(cfg_file.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_specials(tok, path: str, eos_token: Optional[str] = None) -> dict:
    """The tokenizer's own end-of-text token (the document separator) and its BOS / PAD if any:
    `eos_token` if given, else what a tokenizer_config.json beside it names, else the first of
    EOS_NAMES it holds. One sentence if none is found."""
    def find(explicit, key, names):
        for text in ([explicit] if explicit else [_special_from_config(Path(path), key), *names]):
            if text is not None and tok.token_to_id(text) is not None:
                return text, tok.token_to_id(text)
        return None, None
    eos, eos_id = find(eos_token, "eos_token", EOS_NAMES)
    if eos is None:
        wanted = repr(eos_token) if eos_token else f"any of {', '.join(EOS_NAMES)}"
        raise DataError(f"tokenizer {path} has no end-of-text token ({wanted} not in its vocabulary); name its "
                        f"document separator with --eos-token.")
    bos, bos_id = find(None, "bos_token", BOS_NAMES)
    pad, pad_id = find(None, "pad_token", ())
    return {"eos_token": eos, "eos_id": eos_id, "bos_token": bos, "bos_id": bos_id, "pad_token": pad,
            "pad_id": pad_id}


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
            val_fraction: float = 0.02, eos_token: Optional[str] = None) -> dict:
    """Text/JSONL files -> token directory (byte-level, or a local tokenizer.json, whose own
    end-of-text token separates documents); the tokenizer's files go with the tokens."""
    tok = load_tokenizer(tokenizer_path)
    if tok is None:
        vocab, eos, meta, tok_files = BYTE_VOCAB_PADDED, EOS_ID, BYTE_TOKENIZER, byte_tokenizer_files()
        encode = byte_tokenize
    else:
        specials = tokenizer_specials(tok, tokenizer_path, eos_token)
        vocab, eos = pad_vocab(tok.get_vocab_size(with_added_tokens=True)), specials["eos_id"]
        meta = {"type": "tokenizer.json", "source": str(Path(tokenizer_path).resolve()), **specials}
        tok_files = {"tokenizer.json": Path(tokenizer_path).read_text(encoding="utf-8"),
                     "tokenizer_config.json": _tokenizer_config(specials["eos_token"], specials["bos_token"],
                                                                specials["pad_token"])}
        # add_special_tokens=False: documents are separated by EOS alone, whatever the post-processor adds
        encode = lambda text: np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)  # noqa: E731
    docs = ((name, encode(text)) for name, text in iter_documents(files, jsonl_field))
    return write_token_dir(Path(out_dir), docs, vocab, eos, val_fraction, meta, tok_files)
