#!/usr/bin/env python
"""Turn text, JSONL or Parquet files into moe_trainer token files (shards + index.json).

  python tools/prepare_data.py OUT_DIR corpus/ more/*.jsonl.zst [--tokenizer DIR_OR_JSON] [--workers N]

Inputs: .txt (one document each), .jsonl / .jsonl.gz / .jsonl.zst (one per line, the text in
--field), .parquet (one per row, the text in column --field), and directories (searched
recursively for those suffixes) or globs of them, read as streams.

Byte-level tokens (vocab 320) unless a local Hugging Face tokenizer (a tokenizer.json, or a
directory holding one) is given; then its own end-of-text token separates documents (found in a
tokenizer_config.json beside it, or by its usual names; --eos-token names it), and OUT_DIR gets
a copy of the tokenizer (tokenizer.json, tokenizer_config.json) that the run directory and the
Hugging Face export carry on.

Validation: a document goes to validation by a hash of its text (blake2b), so the same records
split the same way whether they come as .jsonl, .jsonl.gz, .jsonl.zst, Parquet or .txt files, in
any order, and identical documents always fall on one side.

Workers: --workers processes tokenize chunks of ~1 MB of text in batches (the tokenizers library's
batch encode, one core each). Shards of --shard-tokens train tokens are written as they fill,
and the index lists every shard's token count and largest id, so a run's start reads no token
file in full.

Memory is flat in the corpus size: bounded by the workers and the chunks in flight (2 per
worker) and the tokenizer: 389 MB for the whole process tree with 2 workers and a 16k-id BPE on
a 500 MB JSONL, 343 MB on 100 MB (docs/BENCHMARKS_data.md).

Interruption: the work happens in OUT_DIR.partial, renamed to OUT_DIR only when complete.
SIGTERM or Ctrl-C stops it with one line saying where (the workers are shut down first; exit
143 or 130). Rerunning the same command resumes after the last finished shard, and writes
exactly what an uninterrupted run writes; changed inputs or settings start it over.

Point a run at the result with `--set data.path=OUT_DIR`: model.vocab_size=auto (the default)
follows the data's vocabulary.
"""
import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_trainer.data import DataError, prepare  # noqa: E402
from moe_trainer.data.prepare import SHARD_TOKENS, Interrupted  # noqa: E402


def say(line: str) -> None:
    print(f"prepare_data: {line}", file=sys.stderr, flush=True)


RECEIVED: list = []  # the signal that stopped the run


def stop_on(signum, frame) -> None:
    """SIGTERM (a scheduler, kill) as SIGINT is: an exception that unwinds, so the worker pool is
    shut down and its semaphores released, instead of a silent death that leaks them. Repeats are
    ignored while that shutdown runs (it takes milliseconds)."""
    RECEIVED.append(signum)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="directory to write (replaced atomically)")
    ap.add_argument("files", nargs="+", help="files, directories or globs (.txt, .jsonl[.gz|.zst], .parquet)")
    ap.add_argument("--tokenizer", help="local tokenizer.json or Hugging Face tokenizer directory; default: bytes")
    ap.add_argument("--field", default="text", help="JSONL field / Parquet column holding the text (default: text)")
    ap.add_argument("--eos-token", help="the tokenizer's end-of-text token (default: found by its usual names)")
    ap.add_argument("--val-fraction", type=float, default=0.02, help="share of documents for validation")
    ap.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    ap.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                    help=f"train tokens per shard (default {SHARD_TOKENS:,})")
    ap.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                    help="a line that is not JSON or a record without the text field: stop with its file and "
                         "line (fail, the default), or count it in the index and go on (skip)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.workers < 1 or args.shard_tokens < 1:
        ap.error("--workers and --shard-tokens must be at least 1")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop_on)
    try:
        index = prepare(args.files, args.out_dir, args.tokenizer, args.field, args.val_fraction, args.eos_token,
                        workers=args.workers, shard_tokens=args.shard_tokens, on_error=args.on_error, say=say)
    except (DataError, OSError, UnicodeDecodeError) as e:
        say(str(e))
        return 2
    except KeyboardInterrupt as e:  # prepare's Interrupted says where it stopped
        say(str(e) if isinstance(e, Interrupted) else
            f"stopped by {e or 'an interrupt'}; run the same command again to resume from {args.out_dir}.partial.")
        return 128 + (RECEIVED[0] if RECEIVED else signal.SIGINT)
    s = index["splits"]
    tok = index["tokenizer"]
    skipped = f", {index['skipped']} malformed records skipped" if index["skipped"] else ""
    print(f"wrote {args.out_dir}: {s['train']['num_tokens']} train / {s['val']['num_tokens']} val tokens in "
          f"{len(s['train']['shards']) + len(s['val']['shards'])} shards{skipped}, vocab {index['vocab_size']} "
          f"(documents end with {tok['eos_token']!r}, id {tok['eos_id']}); train on it with "
          f"--set data.path={args.out_dir} (model.vocab_size=auto, the default, follows the data)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
