"""Data: token sets on disk, their preparation, and deterministic global batches.

  tokenizer.py  the byte-level default and local Hugging Face tokenizers (files that travel with the tokens)
  formats.py    our token directory (shards + index.json) and Megatron's indexed dataset, read in place
  inputs.py     prepare's inputs (text, JSON lines plain/.gz/.zst, Parquet) as chunks; the split by a text's hash
  prepare.py    text -> token directory: streaming, parallel workers, bounded shards, resumable
  sampling.py   sample i -> window by a keyed bijection (O(1) memory), and the batches
  mixture.py    data.sources: sample i -> source by a fixed within-one-sample schedule, then its window
  default.py    the default corpus (the standard library's .py files as bytes)
  loader.py     what a run opens from data.path or data.sources

The names other modules import are re-exported here.
"""
from .default import default_corpus_dir, stdlib_files
from .errors import DataError
from .formats import (FORMAT, FORMAT_V1, MEGATRON_FORMAT, TokenStream, megatron_prefix, open_megatron,
                      open_token_dir, open_token_set)
from .loader import (data_dir, data_vocab_size, open_data, open_run_data, run_data_dir, run_fingerprints,
                     run_vocab_size, unigram_entropy)
from .mixture import Mixture, MixtureSource, open_mixture, source_name
from .prepare import prepare, write_token_dir
from .sampling import BatchSource, WindowOrder
from .tokenizer import (BOS_ID, BYTE_SPECIALS, BYTE_TOKENIZER, BYTE_VOCAB, BYTE_VOCAB_PADDED, EOS_ID, PAD_ID,
                        TOKENIZER_FILES, byte_tokenize, byte_tokenizer_files, load_tokenizer, pad_vocab,
                        tokenizer_specials)

__all__ = ["BOS_ID", "BYTE_SPECIALS", "BYTE_TOKENIZER", "BYTE_VOCAB", "BYTE_VOCAB_PADDED", "BatchSource",
           "DataError", "EOS_ID", "FORMAT", "FORMAT_V1", "MEGATRON_FORMAT", "Mixture", "MixtureSource", "PAD_ID",
           "TOKENIZER_FILES", "TokenStream", "WindowOrder", "byte_tokenize", "byte_tokenizer_files", "data_dir",
           "data_vocab_size", "default_corpus_dir", "load_tokenizer", "megatron_prefix", "open_data",
           "open_megatron", "open_mixture", "open_run_data", "open_token_dir", "open_token_set", "pad_vocab",
           "prepare", "run_data_dir", "run_fingerprints", "run_vocab_size", "source_name", "stdlib_files",
           "tokenizer_specials", "unigram_entropy", "write_token_dir"]
