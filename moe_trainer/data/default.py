"""The default corpus: the running Python's standard-library .py files as bytes, built once and cached."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from .formats import FORMAT
from .prepare import write_token_dir
from .tokenizer import BYTE_TOKENIZER, BYTE_VOCAB_PADDED, EOS_ID, TOKENIZER_FILES, byte_tokenizer_files


def stdlib_files() -> list[Path]:
    """The running Python's standard-library .py files in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def default_corpus_dir(val_fraction: float = 0.02) -> Path:
    """Build (once, cached) the default corpus. The cache is keyed by the standard library's place,
    the interpreter's exact version and build (an installed stdlib does not change under one
    build) and the format, so a start-up finds it without walking the tree."""
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
            docs = ((str(p.relative_to(root)), np.frombuffer(p.read_bytes(), dtype=np.uint8)) for p in stdlib_files())
            write_token_dir(out, docs, BYTE_VOCAB_PADDED, EOS_ID, val_fraction, BYTE_TOKENIZER, byte_tokenizer_files())
        elif not all((out / name).is_file() for name in TOKENIZER_FILES):  # a cache from before they were
            for name, text in byte_tokenizer_files().items():
                tmp = out / f".{name}.tmp{os.getpid()}"
                tmp.write_text(text)
                os.replace(tmp, out / name)
    return out
