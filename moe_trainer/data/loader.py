"""What a run opens: data.path (a token directory, a Megatron prefix, or empty for the default
corpus) as the train and validation batch sources."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from .default import default_corpus_dir
from .errors import DataError
from .formats import megatron_prefix, open_token_set, token_set_vocab
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


def unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    """Entropy (nats/token) of the token frequency distribution: the loss of the
    best model that ignores context."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


