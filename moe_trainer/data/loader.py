"""What a run opens: data.path (a token directory, a Megatron prefix, or empty for the default
corpus), or the weighted mixture data.sources, as the train and validation batch sources."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from .default import default_corpus_dir
from .errors import DataError
from .formats import megatron_prefix, open_token_set, token_set_vocab
from .mixture import fingerprint, open_mixture, source_name
from .sampling import BatchSource
from .tokenizer import BYTE_VOCAB_PADDED, tokenizer_file


def data_vocab_size(data_path: str, tokenizer: str = "") -> int:
    """The vocabulary the data was made for (padded to a multiple of 64): index.json's, or
    data.tokenizer's for a Megatron prefix; the default corpus's without building it."""
    if not data_path:
        return BYTE_VOCAB_PADDED
    return token_set_vocab(data_path, tokenizer)


def data_dir(data_path: str, tokenizer: str = "") -> Optional[Path]:
    """Where the run's tokenizer files lie: the token directory (data.path, or the default
    corpus's cache), or data.tokenizer's directory for a Megatron prefix."""
    if not data_path:
        return default_corpus_dir()
    if megatron_prefix(data_path) is not None:
        return tokenizer_file(tokenizer, "data.tokenizer").parent if tokenizer else None
    return Path(data_path)


def open_data(data_path: str, seq_len: int, seed: int, model_vocab: int, val_fraction: float = 0.02,
              tokenizer: str = "") -> tuple[dict, BatchSource, BatchSource]:
    path = data_path or str(default_corpus_dir(val_fraction))
    index, streams = open_token_set(path, model_vocab, tokenizer, val_fraction)
    vocab = min(model_vocab, index["vocab_size"])
    return (index, BatchSource(streams["train"], seq_len, seed, vocab_size=vocab),
            BatchSource(streams["val"], seq_len, seed, shuffle=False, vocab_size=vocab))


def run_paths(data) -> list[str]:
    """The token sets a run's data section names: data.path (empty: the default corpus) or each data.sources path."""
    return [str(e["path"]) for e in data.sources] if data.sources else [data.path]


def run_vocab_size(data) -> int:
    """data_vocab_size of a data section: a mixture's sources must agree (one tokenizer)."""
    sizes = {p: data_vocab_size(p, data.tokenizer) for p in run_paths(data)}
    if len(set(sizes.values())) > 1:
        raise DataError(f"data.sources have different vocabularies ({', '.join(f'{p}: {v}' for p, v in sizes.items())}"
                        f"); prepare every source with one tokenizer.")
    return next(iter(sizes.values()))


def own_tokenizer(token_dir: str) -> str:
    """data.tokenizer naming a token directory's own tokenizer (as a run records it)."""
    return str(Path(token_dir) / "tokenizer.json")


def first_path(data) -> str:
    """data.path, or a mixture's first source's path (its sources share one tokenizer); a config's data
    section or its dict (config.yaml as read)."""
    get = data.get if isinstance(data, dict) else lambda key, default: getattr(data, key)
    sources = get("sources", [])
    return str(sources[0]["path"]) if sources else str(get("path", "") or "")


def resolve_tokenizer(data) -> None:
    """data.tokenizer as a run uses and records it: the one given, else the token directory's own
    (the default corpus's byte-level tokenizer stays '': it has no file outside a cache)."""
    path = first_path(data)
    if not data.tokenizer and path and megatron_prefix(path) is None and Path(own_tokenizer(path)).is_file():
        data.tokenizer = own_tokenizer(path)


def derived_tokenizer(data) -> bool:
    """Does data.tokenizer name the data's own tokenizer (resolve_tokenizer's record, not a choice)? A
    comparison of names only: it holds when the data has moved away, so a resume can still read the
    config.yaml that recorded it, and follow a new data.path with its tokenizer."""
    tokenizer = data.get("tokenizer", "") if isinstance(data, dict) else data.tokenizer
    return bool(tokenizer) and bool(first_path(data)) and tokenizer == own_tokenizer(first_path(data))


def run_data_dir(data) -> Optional[Path]:
    """data_dir of a data section (a mixture's first source: they share one tokenizer)."""
    return data_dir(run_paths(data)[0], data.tokenizer)


def open_run_data(data, seq_len: int, seed: int, model_vocab: int) -> tuple[dict, object, dict]:
    """(index, training batches, {name: validation batches}) of a config's data section: data.path
    as one source named by its basename ("default" for the default corpus), or the mixture."""
    if data.sources:
        return open_mixture(data.sources, data.val_sources, seq_len, seed, model_vocab, data.val_fraction,
                            data.tokenizer)
    index, train, val = open_data(data.path, seq_len, seed, model_vocab, data.val_fraction, data.tokenizer)
    return index, train, {single_name(data.path): val}


def single_name(path: str) -> str:
    return source_name({"path": path}) if path else "default"


def run_fingerprints(data) -> dict[str, dict]:
    """{source name: {path, hash, tokens}} of a data section (mixture.fingerprint of each token set)."""
    if not data.sources:
        path = data.path or str(default_corpus_dir(data.val_fraction))
        return {single_name(data.path): {"path": data.path, **fingerprint(path)}}
    return {source_name(e): {"path": str(e["path"]), **fingerprint(str(e["path"]))} for e in data.sources}


def unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    """Entropy (nats/token) of the token frequency distribution: the loss of the
    best model that ignores context."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


