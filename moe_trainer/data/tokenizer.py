"""Tokenizers for data: the byte-level default, and a local Hugging Face tokenizer.json with its
end-of-text token (the document separator), as files that travel with the tokens."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np

from .errors import DataError

BYTE_VOCAB = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258  # specials after the 256 byte values
BYTE_VOCAB_PADDED = 320  # 259 rounded up to a multiple of 64
BYTE_SPECIALS = {BOS_ID: "<|bos|>", EOS_ID: "<|endoftext|>", PAD_ID: "<|pad|>"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# end-of-text tokens of common tokenizers (GPT-2 / Qwen, Llama 3 base, Llama 2 / Mistral, Gemma), in the
# order tried when no tokenizer_config.json beside the tokenizer.json names one
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>")
BYTE_TOKENIZER = {"type": "bytes", "bos_id": BOS_ID, "eos_id": EOS_ID, "pad_id": PAD_ID,
                  "bos_token": BYTE_SPECIALS[BOS_ID], "eos_token": BYTE_SPECIALS[EOS_ID],
                  "pad_token": BYTE_SPECIALS[PAD_ID]}


def pad_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def byte_tokenize(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


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
    config = tokenizer_config(BYTE_SPECIALS[EOS_ID], BYTE_SPECIALS[BOS_ID], BYTE_SPECIALS[PAD_ID])
    return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False), "tokenizer_config.json": config}


def tokenizer_config(eos: str, bos: Optional[str], pad: Optional[str]) -> str:
    """What transformers' AutoTokenizer needs beside a tokenizer.json: the class and the special tokens."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, "eos_token": eos}
    if bos is not None:
        cfg["bos_token"] = bos
    if pad is not None:
        cfg["pad_token"] = pad
    return json.dumps(cfg, indent=1) + "\n"


def tokenizer_file(path: str | Path, what: str = "tokenizer") -> Path:
    """The tokenizer.json a path names: the file itself, or the one inside a Hugging Face tokenizer
    directory (as tools/convert_hf.py --tokenizer takes it)."""
    p = Path(path)
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise DataError(f"{what} {path} is a directory without a tokenizer.json.")
        return p / "tokenizer.json"
    if not p.is_file():
        raise DataError(f"{what} {path} does not exist.")
    return p


def load_tokenizer(path: Optional[str]):
    """A local Hugging Face tokenizer (a tokenizer.json or a directory holding one; no download),
    or None for bytes."""
    if path is None:
        return None
    f = tokenizer_file(path)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("--tokenizer needs the tokenizers package (pip install -e '.[data]').") from None
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # the Rust side raises its own Exception type
        raise DataError(f"{f} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}).") from None


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
    f = tokenizer_file(path)

    def find(explicit, key, names):
        for text in ([explicit] if explicit else [_special_from_config(f, key), *names]):
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


def describe_tokenizer(path: Optional[str], eos_token: Optional[str] = None) -> tuple[int, dict, dict[str, str]]:
    """(vocab_size padded to 64, the index's "tokenizer" entry, the files that travel with the tokens) for
    a local tokenizer, or the byte-level one when `path` is None. The entry carries the
    tokenizer.json's sha256, which does not depend on where the file lies."""
    if path is None:
        return BYTE_VOCAB_PADDED, dict(BYTE_TOKENIZER), byte_tokenizer_files()
    tok = load_tokenizer(path)
    specials = tokenizer_specials(tok, path, eos_token)
    f = tokenizer_file(path)
    text = f.read_text(encoding="utf-8")
    meta = {"type": "tokenizer.json", "source": str(f.resolve()), "sha256": hashlib.sha256(text.encode()).hexdigest(),
            **specials}
    files = {"tokenizer.json": text,
             "tokenizer_config.json": tokenizer_config(specials["eos_token"], specials["bos_token"],
                                                       specials["pad_token"])}
    return pad_vocab(tok.get_vocab_size(with_added_tokens=True)), meta, files
