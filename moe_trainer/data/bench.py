"""prepare_data against the limit (the tokenizer's own batch encode on the same texts) and against
Hugging Face datasets' map(num_proc=N): tokens/s and the peak memory of each whole process tree.

  python -m moe_trainer.data.bench --mb 500 --workers 2 --dir /tmp/bench_data [--hf-path DIR]
      [--megatron-path MEGATRON_LM_CHECKOUT [--megatron-pythonpath DIRS]]

The corpus is JSONL generated from the running Python's standard library (each .py file a document,
repeated with a pass header to the size asked); the tokenizer a byte-level BPE trained on its first
10 MB. Nothing is downloaded. Each contender runs as its own process tree, sampled every 0.1 s
(RSS summed over the tree, and PSS, which counts shared pages once).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_corpus(path: Path, mb: float) -> None:
    from .default import stdlib_files
    if path.is_file() and path.stat().st_size >= mb * 1e6:
        return
    files = [(f, f.read_text(errors="replace")) for f in stdlib_files()]
    written, k = 0, 0
    with open(path, "w") as out:
        while written < mb * 1e6:
            for f, text in files:
                line = json.dumps({"text": f"# pass {k}: {f.name}\n{text}"}) + "\n"
                out.write(line)
                written += len(line)
                if written >= mb * 1e6:
                    break
            k += 1


def make_tokenizer(path: Path, corpus: Path, vocab: int = 16384) -> None:
    if path.is_file():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts(limit=10e6):
        seen = 0
        with open(corpus) as f:
            for line in f:
                seen += len(line)
                yield json.loads(line)["text"]
                if seen > limit:
                    return
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def gpt2_files(tokenizer: Path, out: Path) -> tuple[Path, Path]:
    """The byte-level BPE as GPT-2's vocab.json + merges.txt, what Megatron-LM's GPT2BPETokenizer
    reads: the same vocabulary (the end-of-text token included) and merges, so both tools make the
    same ids from the same texts (the run checks the token counts agree)."""
    model = json.loads(tokenizer.read_text())
    vocab = dict(model["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in model.get("added_tokens", [])})
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["model"]["merges"]]
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return out / "vocab.json", out / "merges.txt"


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return out


def _memory(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) bytes summed over the processes."""
    rss = pss = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Wall seconds, peak tree RSS and PSS, and the last stdout line (JSON where the command prints it)."""
    import tempfile
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:  # no pipe to fill
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True, env=env)
        peak_rss = peak_pss = 0
        while proc.poll() is None:
            rss, pss = _memory(_tree(proc.pid))
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed: {err[-2000:]}")
    return {"wall_s": wall, "peak_rss_mb": peak_rss / 1e6, "peak_pss_mb": peak_pss / 1e6,
            "last": (out.strip().splitlines() or [""])[-1]}


def baseline(corpus: str, tokenizer: str, chunk_bytes: int = 1 << 20) -> None:
    """The limit: encode_batch_fast (all cores, the library's own threads) on the same texts in
    ~1 MB batches; only the encode calls are timed. Prints JSON."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    tokens = docs = 0
    spent = 0.0
    batch, size = [], 0
    with open(corpus) as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            size += len(line)
            if size >= chunk_bytes:
                t0 = time.perf_counter()
                tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
                spent += time.perf_counter() - t0
                docs += len(batch)
                batch, size = [], 0
    if batch:
        t0 = time.perf_counter()
        tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
        spent += time.perf_counter() - t0
        docs += len(batch)
    print(json.dumps({"tokens": tokens + docs, "encode_s": spent}))


HF = """
import json, sys, time
from datasets import load_dataset
from tokenizers import Tokenizer
corpus, tokenizer, workers, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tok = Tokenizer.from_file(tokenizer)
eos = tok.token_to_id("<|endoftext|>")
def encode(batch):
    return {"ids": [e.ids + [eos] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}
ds = load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
out = ds.map(encode, batched=True, batch_size=1000, num_proc=workers, remove_columns=["text"])
import pyarrow.compute as pc
print(json.dumps({"tokens": pc.sum(pc.list_value_length(out.data.column("ids"))).as_py()}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/moe_trainer_bench_data")
    ap.add_argument("--hf-path", help="a directory holding the datasets package (PYTHONPATH for its run)")
    ap.add_argument("--megatron-path", help="a Megatron-LM checkout: its tools/preprocess_data.py runs on the same "
                    "corpus with --tokenizer-type GPT2BPETokenizer (the same BPE as vocab.json + merges.txt)")
    ap.add_argument("--megatron-pythonpath", default="", help="more PYTHONPATH entries its imports need")
    ap.add_argument("--baseline", nargs=2, metavar=("CORPUS", "TOKENIZER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.baseline:
        baseline(*args.baseline)
        return 0
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    corpus, tok = d / f"corpus_{args.mb:g}mb.jsonl", d / "tokenizer.json"
    make_corpus(corpus, args.mb)
    make_tokenizer(tok, corpus)
    size = corpus.stat().st_size
    py = sys.executable
    rows = {}
    limit = measure([py, "-m", "moe_trainer.data.bench", "--baseline", str(corpus), str(tok)])
    lim = json.loads(limit["last"])
    rows["tokenizer's own encode_batch (the limit; encode time only)"] = (lim["tokens"], lim["encode_s"], limit)
    out = d / "tokens"
    ours = measure([py, str(ROOT / "tools" / "prepare_data.py"), str(out), str(corpus), "--tokenizer", str(tok),
                    "--workers", str(args.workers)])
    index = json.loads((out / "index.json").read_text())
    n = index["splits"]["train"]["num_tokens"] + index["splits"]["val"]["num_tokens"]
    rows[f"prepare_data --workers {args.workers} (whole command)"] = (n, ours["wall_s"], ours)
    if args.hf_path:
        env = dict(os.environ, PYTHONPATH=args.hf_path + os.pathsep + os.environ.get("PYTHONPATH", ""))
        hf = measure([py, "-c", HF, str(corpus), str(tok), str(args.workers), str(d / "hf_cache")], env)
        rows[f"datasets map(num_proc={args.workers}) (whole command)"] = (json.loads(hf["last"])["tokens"],
                                                                         hf["wall_s"], hf)
    if args.megatron_path:
        vocab, merges = gpt2_files(tok, d)
        path = os.pathsep.join(p for p in (args.megatron_path, args.megatron_pythonpath) if p)
        env = dict(os.environ, PYTHONPATH=path)
        prefix = d / "megatron"
        mlm = measure([py, str(Path(args.megatron_path) / "tools" / "preprocess_data.py"), "--input", str(corpus),
                       "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                       str(vocab), "--merge-file", str(merges), "--append-eod", "--workers", str(args.workers)],
                      env)
        from .formats import read_megatron_index
        (bin_file,) = d.glob("megatron_text_document.bin")
        index = read_megatron_index(str(bin_file)[:-4])
        rows[f"Megatron-LM preprocess_data.py --workers {args.workers} (whole command)"] = (
            int(index.lengths.sum()), mlm["wall_s"], mlm)
    print(f"corpus {corpus} ({size / 1e6:,.0f} MB, BPE vocab 16384), {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| what | tokens | seconds | MB/s | M tokens/s | vs limit | peak RSS (tree) | peak PSS (tree) |")
    print("|---|---|---|---|---|---|---|---|")
    base = lim["tokens"] / lim["encode_s"]
    for name, (tokens, seconds, m) in rows.items():
        print(f"| {name} | {tokens:,} | {seconds:.1f} | {size / seconds / 1e6:.1f} | {tokens / seconds / 1e6:.2f} | "
              f"{tokens / seconds / base:.2f}x | {m['peak_rss_mb']:,.0f} MB | {m['peak_pss_mb']:,.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
