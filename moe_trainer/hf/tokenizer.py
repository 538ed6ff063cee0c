"""The tokenizer of an export: tokenizer.json + tokenizer_config.json copied in, their special-token
ids written into config.json and generation_config.json."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import HFFormatError, PathLike

def special_token_ids(tokenizer_dir: PathLike) -> dict[str, int]:
    """{"bos_token_id": .., "eos_token_id": .., "pad_token_id": ..} (those it names) of a directory
    holding tokenizer.json + tokenizer_config.json (a token directory, a run directory, an export)."""
    d = Path(tokenizer_dir)
    tok, cfg = _read_tokenizer(d)
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab = tok.get("model", {}).get("vocab")
    out = {}
    for kind in ("bos", "eos", "pad"):
        text = cfg.get(f"{kind}_token")
        text = text.get("content") if isinstance(text, dict) else text
        if text is None:
            continue
        found = ids.get(text, vocab.get(text) if isinstance(vocab, dict) else None)
        if found is None:
            raise HFFormatError(f"{d / 'tokenizer_config.json'} names {kind}_token {text!r}, which its "
                                f"tokenizer.json does not hold.")
        out[f"{kind}_token_id"] = found
    return out


def _read_tokenizer(d: Path) -> tuple[dict, dict]:
    try:
        return (json.loads((d / "tokenizer.json").read_text(encoding="utf-8")),
                json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        raise HFFormatError(f"{d} has no readable tokenizer.json and tokenizer_config.json ({e}).") from None


def tokenizer_size(tokenizer_dir: PathLike) -> int:
    """1 + the largest id a tokenizer.json can produce (its vocabulary and added tokens)."""
    tok, _ = _read_tokenizer(Path(tokenizer_dir))
    vocab = tok.get("model", {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: a list of pieces
    return 1 + max(ids + [t["id"] for t in tok.get("added_tokens", [])])


def export_tokenizer(export_dir: PathLike, tokenizer_dir: PathLike) -> dict[str, int]:
    """Give a Hugging Face export its tokenizer: tokenizer.json + tokenizer_config.json copied from
    `tokenizer_dir`, their BOS / EOS ids written into config.json and generation_config.json
    (there with a pad id: the tokenizer's, else EOS), each file replaced atomically; then
    AutoTokenizer.from_pretrained and generate work on the export. Returns the ids. A tokenizer
    with ids beyond the model's vocab_size (not the one it was trained with) is refused."""
    export_dir, src = Path(export_dir), Path(tokenizer_dir)
    ids = special_token_ids(src)
    config = json.loads((export_dir / "config.json").read_text())
    if tokenizer_size(src) > config["vocab_size"]:
        raise HFFormatError(f"the tokenizer in {src} has {tokenizer_size(src)} ids, more than the model's vocab_size "
                            f"({config['vocab_size']}); it is not the tokenizer this model was trained with.")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        _atomic_write(export_dir / name, (src / name).read_bytes())
    # no pad_token_id in config.json: transformers makes it the embedding's padding_idx
    config.update({k: v for k, v in ids.items() if k != "pad_token_id"})
    _atomic_write(export_dir / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    generation = {**ids, "pad_token_id": ids.get("pad_token_id", ids.get("eos_token_id"))}
    _atomic_write(export_dir / "generation_config.json", (json.dumps(generation, indent=2) + "\n").encode())
    return ids


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
