"""Weights and data made with one tokenizer: train.init_from's tokenizer, and the run directory's
copy from an earlier start, held against the data's before anything expensive starts.

Two tokenizers are the same when their tokenizer.json files are byte for byte the same (the
sha256 the token index records; a file's place does not enter). The data's tokenizer is the token
directory's tokenizer.json, data.tokenizer for a Megatron prefix, or the byte-level tokenizer of
the default corpus (data.path empty)."""
from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import Optional

from .errors import DataError
from .formats import megatron_prefix
from .tokenizer import BYTE_TOKENIZER, BYTE_VOCAB_PADDED, byte_tokenizer_files, tokenizer_file


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def data_tokenizer(data_path: str, tokenizer: str = "") -> tuple[str, str]:
    """(sha256 of the data's tokenizer.json, a few words on it) for data.path / data.tokenizer."""
    if not data_path:
        return (_sha(byte_tokenizer_files()["tokenizer.json"]),
                f"the default byte-level corpus's tokenizer (vocab {BYTE_VOCAB_PADDED}, end-of-text id "
                f"{BYTE_TOKENIZER['eos_id']})")
    if megatron_prefix(data_path) is not None:
        if not tokenizer:
            raise DataError(f"data.path {data_path} is a Megatron indexed dataset, which carries no tokenizer; name "
                            f"the one it was made with as data.tokenizer.")
        f = tokenizer_file(tokenizer, "data.tokenizer")
        return _sha(f.read_text(encoding="utf-8")), f"data.tokenizer {tokenizer}{_summary(f.parent)}"
    f = Path(data_path) / "tokenizer.json"
    if not f.is_file():
        raise DataError(f"data.path {data_path} has no tokenizer.json beside its tokens; prepare it again with "
                        f"tools/prepare_data.py.")
    return _sha(f.read_text(encoding="utf-8")), f"the tokenizer of data.path {data_path}{_summary(Path(data_path))}"


def _summary(d: Path) -> str:
    """' (vocab N, end-of-text id E)' from a directory's tokenizer files, or '' where they cannot tell."""
    try:
        vocab = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
        size = vocab_entries(vocab)
        cfg = d / "tokenizer_config.json"
        eos = json.loads(cfg.read_text()).get("eos_token") if cfg.is_file() else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        ids = {t.get("content"): t.get("id") for t in vocab.get("added_tokens", [])}
        eos_id = ids.get(eos, vocab.get("model", {}).get("vocab", {}).get(eos)) if eos else None
        return f" (vocab {size}" + (f", end-of-text {eos!r} = id {eos_id}" if eos_id is not None else "") + ")"
    except (OSError, ValueError, AttributeError, TypeError):
        return ""


def vocab_entries(tokenizer_json: dict) -> int:
    """The ids a tokenizer.json defines: its model's vocabulary and its added tokens, each id once
    (an added special token usually sits in the model's vocabulary too: 8,000 entries, not 8,001)."""
    model_vocab = tokenizer_json.get("model", {}).get("vocab", {})
    # BPE / WordPiece: {token: id}; Unigram: [[piece, score], ...], ids by position
    ids = set(range(len(model_vocab))) if isinstance(model_vocab, list) else set(model_vocab.values())
    return len(ids | {t.get("id") for t in tokenizer_json.get("added_tokens", [])})


def prepare_command(tokenizer: Path) -> str:
    """The tools/prepare_data.py command line that makes token files with `tokenizer`."""
    return f"python tools/prepare_data.py OUT_DIR CORPUS --tokenizer {shlex.quote(str(tokenizer))}"


def check_same_tokenizer(what: str, other: Path, data_path: str, tokenizer: str = "",
                         remedy: Optional[str] = None) -> None:
    """`what` (e.g. "train.init_from X") carries the tokenizer files in directory `other`: they must be
    the data's. Raises DataError with one sentence naming both and what to do."""
    mine = _sha((Path(other) / "tokenizer.json").read_text(encoding="utf-8"))
    theirs, described = data_tokenizer(data_path, tokenizer)
    if mine == theirs:
        return
    remedy = remedy or f"prepare the data with that tokenizer ({prepare_command(other)}, then --set data.path=OUT_DIR)"
    if not data_path:
        raise DataError(f"{what} carries its own tokenizer{_summary(Path(other))}, but no data.path is named, so the "
                        f"run would train it on the default byte-level corpus; {remedy}.")
    raise DataError(f"{what} carries a tokenizer{_summary(Path(other))} that is not {described}; {remedy}.")
