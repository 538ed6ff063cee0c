#!/usr/bin/env python
"""Turn text or JSONL files into moe_trainer token files (flat memmap + index.json).

  python tools/prepare_data.py OUT_DIR a.txt b.jsonl [--tokenizer tokenizer.json] [--field text]

Byte-level tokens (vocab 320) unless a local Hugging Face tokenizer.json is
given; then its own end-of-text token separates documents (found in a
tokenizer_config.json beside it, or by its usual names; --eos-token names it),
and OUT_DIR gets a copy of the tokenizer (tokenizer.json, tokenizer_config.json)
that the run directory and the Hugging Face export carry on. Point a run at the
result with `--set data.path=OUT_DIR`: model.vocab_size=auto (the default)
follows the data's vocabulary.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_trainer.data import DataError, prepare  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="directory to write (replaced atomically)")
    ap.add_argument("files", nargs="+", help=".txt (one document each) or .jsonl (one per line) files")
    ap.add_argument("--tokenizer", help="local tokenizer.json (Hugging Face tokenizers); default: bytes")
    ap.add_argument("--field", default="text", help="JSONL field holding the text (default: text)")
    ap.add_argument("--eos-token", help="the tokenizer's end-of-text token (default: found by its usual names)")
    ap.add_argument("--val-fraction", type=float, default=0.02, help="share of documents for validation")
    args = ap.parse_args(argv)
    try:
        index = prepare(args.files, args.out_dir, args.tokenizer, args.field, args.val_fraction, args.eos_token)
    except (DataError, OSError, UnicodeDecodeError) as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    s = index["splits"]
    tok = index["tokenizer"]
    print(f"wrote {args.out_dir}: {s['train']['num_tokens']} train / {s['val']['num_tokens']} val tokens, "
          f"vocab {index['vocab_size']} (documents end with {tok['eos_token']!r}, id {tok['eos_id']}); train on "
          f"it with --set data.path={args.out_dir} (model.vocab_size=auto, the default, follows the data)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
