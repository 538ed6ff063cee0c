"""prepare_data at scale: streamed inputs of every kind, parallel workers against the tokenizer
itself, bounded shards, resume, malformed input, and its messages."""
import gzip
import importlib
import json
import subprocess
import sys

import numpy as np
import pytest

from moe_trainer.data import DataError, open_token_dir, prepare

from conftest import ROOT, env, toy_documents, train_tokenizer

prep = importlib.import_module("moe_trainer.data.prepare")
DOCS = toy_documents(300, seed=1)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)))
    return path


def split_tokens(token_dir, split):
    index = json.loads((token_dir / "index.json").read_text())
    return np.concatenate([np.fromfile(token_dir / s["file"], dtype=index["dtype"])
                           for s in index["splits"][split]["shards"]])


def expected(tok_file, files: dict[str, list[str]], val_fraction: float) -> dict[str, np.ndarray]:
    """The reference: each document alone through the tokenizer, then EOS, split by a hash of its
    text, in input order."""
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(str(tok_file))
    eos = t.token_to_id("<|endoftext|>")
    out = {"train": [], "val": []}
    for docs in files.values():
        for text in docs:
            split = "val" if prep.text_in_val(text, val_fraction) else "train"
            out[split] += t.encode(text, add_special_tokens=False).ids + [eos]
    return {s: np.array(v) for s, v in out.items()}


def test_two_workers_write_what_the_tokenizer_writes_alone_in_bounded_shards(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    kw = dict(chunk_bytes=2000, shard_tokens=1500)
    one = prepare([str(src)], str(tmp_path / "one"), str(tok), val_fraction=0.1, workers=1, **kw)
    two = prepare([str(src)], str(tmp_path / "two"), str(tok), val_fraction=0.1, workers=2, **kw)
    ref = expected(tok, {"a.jsonl": DOCS}, 0.1)
    for split in ("train", "val"):
        assert np.array_equal(split_tokens(tmp_path / "two", split), ref[split])
        assert np.array_equal(split_tokens(tmp_path / "one", split), ref[split])
        shards = two["splits"][split]["shards"]
        for s in shards:  # each shard's own count and largest id, as read back
            ids = np.fromfile(tmp_path / "two" / s["file"], dtype=np.uint16)
            assert len(ids) == s["num_tokens"] and int(ids.max()) == s["max_id"]
    train = two["splits"]["train"]["shards"]
    assert len(train) > 3 and max(s["num_tokens"] for s in train) < 1500 + 2000  # a shard + one chunk at most
    assert two == one and not (tmp_path / "two.partial").exists()


def test_every_input_kind_reads_the_same_documents(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    docs = DOCS[:60]
    body = "".join(json.dumps({"text": t}) + "\n" for t in docs).encode()
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl.gz").write_bytes(gzip.compress(body))
    (d / "sub" / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    pq.write_table(pa.table({"text": docs}), d / "c.parquet", row_group_size=7)
    (d / "d.txt").write_text(docs[0])
    index = prepare([str(d)], str(tmp_path / "out"), str(tok), val_fraction=0.2, chunk_bytes=500)
    # the reference, file by file in the order of their paths inside the directory; a .txt file is one
    # document
    parts = {"train": [], "val": []}
    for name in ("a.jsonl.gz", "c.parquet", "d.txt", "sub/b.jsonl.zst"):
        if name == "d.txt":
            side = "val" if prep.text_in_val(docs[0], 0.2) else "train"
            ref = {"train": [], "val": []}
            ref[side] = np.concatenate([*expected(tok, {"d.txt": [docs[0]]}, 0.2).values()])
        else:
            ref = expected(tok, {name: docs}, 0.2)
        for s in parts:
            parts[s].append(np.asarray(ref[s], dtype=np.int64))
    for s in parts:
        assert np.array_equal(split_tokens(tmp_path / "out", s), np.concatenate(parts[s])), s
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 3 * 60 + 1
    # a glob of the same files
    again = prepare([str(d / "*.gz")], str(tmp_path / "g"), str(tok), val_fraction=0.2)
    assert np.array_equal(split_tokens(tmp_path / "g", "val"), expected(tok, {"a.jsonl.gz": docs}, 0.2)["val"])
    assert again["splits"]["val"]["documents"] > 0


def test_the_split_does_not_depend_on_how_the_path_is_typed(tmp_path, tok, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", DOCS[:100])
    absolute = prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "abs"), str(tok), val_fraction=0.2)
    monkeypatch.chdir(tmp_path)
    relative = prepare(["a.jsonl"], "rel", str(tok), val_fraction=0.2)
    assert relative["splits"] == absolute["splits"]


def test_the_split_follows_the_text_not_its_file_or_encoding(tmp_path, tok):
    """The same 300 records as .jsonl, .jsonl.gz, .jsonl.zst and Parquet rows: the same validation
    tokens each time (a split by file name and line gave 25,532 / 17,321 / 12,678 validation tokens
    for the first three); and as .txt files, one document each, the same documents go to validation."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    body = "".join(json.dumps({"text": t}) + "\n" for t in DOCS).encode()
    (tmp_path / "a.jsonl").write_bytes(body)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(body))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "d.parquet", row_group_size=50)
    val = {}
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"):
        index = prepare([str(tmp_path / name)], str(tmp_path / f"out-{name}"), str(tok), val_fraction=0.1,
                        chunk_bytes=3000)
        val[name] = split_tokens(tmp_path / f"out-{name}", "val")
        assert index["splits"]["val"]["num_tokens"] == len(val[name]) and index["split"] == prep.SPLIT
    reference = val["a.jsonl"]
    assert 0 < len(reference) < 0.3 * len(split_tokens(tmp_path / "out-a.jsonl", "train"))
    for name, ids in val.items():
        assert np.array_equal(ids, reference), name
    # reversed order, one .txt file per document: the same documents on the validation side
    (tmp_path / "txt").mkdir()
    for i, text in enumerate(reversed(DOCS)):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(text)
    index = prepare([str(tmp_path / "txt")], str(tmp_path / "out-txt"), str(tok), val_fraction=0.1)
    assert index["splits"]["val"]["num_tokens"] == len(reference)
    assert index["splits"]["val"]["documents"] == sum(prep.text_in_val(t, 0.1) for t in DOCS)


def test_identical_documents_are_never_split(tmp_path):
    """2,000 copies of one document among others, in two files: every copy on one side, whatever
    the line or the file it is in."""
    same = DOCS[7]
    lines = [same if i % 3 == 0 else f"{DOCS[i % len(DOCS)]} ({i})" for i in range(6000)]
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", lines[:3000])
    write_jsonl(tmp_path / "in" / "b.jsonl", lines[3000:])
    for fraction in (0.02, 0.5):  # at 0.5 the copies would land on both sides 2,000 times over by chance
        out = tmp_path / f"o{fraction}"
        index = prepare([str(tmp_path / "in")], str(out), val_fraction=fraction, chunk_bytes=5000)
        doc = np.frombuffer(same.encode(), dtype=np.uint8).astype(np.int64)
        found = {s: _count_documents(split_tokens(out, s), doc) for s in ("train", "val")}
        side = "val" if prep.text_in_val(same, fraction) else "train"
        assert found[side] == 2000 and found["val" if side == "train" else "train"] == 0, found
        assert index["splits"]["val"]["documents"] > 0 and index["splits"]["train"]["documents"] > 0


def _count_documents(ids: np.ndarray, doc: np.ndarray) -> int:
    """How many of the split's EOS-ended byte documents equal `doc`."""
    ends = np.flatnonzero(ids == 257)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return sum(1 for s, e in zip(starts, ends) if e - s == len(doc) and np.array_equal(ids[s:e], doc))


def test_a_partial_directory_of_the_name_split_starts_over(tmp_path, tok):
    """A partial directory begun by a version that split by name (no "split" in its settings) is
    not resumed: its finished shards were cut by the other rule."""
    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    kw = dict(val_fraction=0.1, chunk_bytes=2000, shard_tokens=1500)
    whole = prepare([str(src)], str(tmp_path / "whole"), str(tok), **kw)
    partial = tmp_path / "out.partial"
    partial.mkdir()
    settings = prep._settings(prep.expand_inputs([str(src)]), whole["tokenizer"], "text", 0.1, 1500, "fail")
    del settings["split"]
    (partial / "progress.json").write_text(json.dumps({"settings": settings, "position": [0, 4000, 20],
                                                       "shards": {"train": [], "val": []}, "stats": {}}))
    said = []
    assert prepare([str(src)], str(tmp_path / "out"), str(tok), say=said.append, **kw) == whole
    assert any("starting" in s and "over" in s for s in said)


def test_an_interrupted_preparation_resumes_without_redoing_finished_shards(tmp_path, tok, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    kw = dict(val_fraction=0.1, chunk_bytes=2000, shard_tokens=1500)
    whole = prepare([str(src)], str(tmp_path / "whole"), str(tok), **kw)
    out = tmp_path / "out"
    checkpoint, calls = prep._checkpoint, []

    def interrupted(*args):
        checkpoint(*args)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
    monkeypatch.setattr(prep, "_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(src)], str(out), str(tok), **kw)
    assert not out.exists()  # never a directory that looks complete
    progress = json.loads((out.with_name("out.partial") / "progress.json").read_text())
    kept = len(progress["shards"]["train"])
    assert kept == 3
    monkeypatch.setattr(prep, "_checkpoint", checkpoint)
    encoded, encode = [], prep.Encoder.__call__
    monkeypatch.setattr(prep.Encoder, "__call__", lambda self, c: encoded.append(c.first) or encode(self, c))
    said = []
    resumed = prepare([str(src)], str(out), str(tok), say=said.append, **kw)
    assert resumed == whole and any("resuming" in s and "3 train and" in s for s in said)
    for split in ("train", "val"):
        assert np.array_equal(split_tokens(out, split), split_tokens(tmp_path / "whole", split))
    assert min(encoded) > 0  # the finished shards' records were not encoded again
    # changed inputs start over, with a sentence
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(prep, "_checkpoint", interrupted)
        calls.clear()
        prepare([str(src)], str(tmp_path / "o2"), str(tok), **kw)
    monkeypatch.setattr(prep, "_checkpoint", checkpoint)
    write_jsonl(src, DOCS[:200])
    said.clear()
    prepare([str(src)], str(tmp_path / "o2"), str(tok), say=said.append, **kw)
    assert any("starting" in s and "over" in s for s in said)


def test_malformed_records_fail_with_file_and_line_or_are_counted(tmp_path):
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine too"}\nnot json\n{"body": "no text"}\n' +
                   "".join(json.dumps({"text": t}) + "\n" for t in DOCS[:50]))
    with pytest.raises(DataError, match=r"b.jsonl line 3 is not a JSON object with a 'text' string.*--on-error skip"):
        prepare([str(bad)], str(tmp_path / "o"))
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
    said = []
    index = prepare([str(bad)], str(tmp_path / "o"), on_error="skip", val_fraction=0.1, say=said.append)
    assert index["skipped"] == 2 and any("line 4" in s for s in said)
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 52


def test_prepare_data_cli_messages(tmp_path, tok):
    tool = [sys.executable, str(ROOT / "tools" / "prepare_data.py")]
    run = lambda *a: subprocess.run(tool + [str(x) for x in a], capture_output=True, text=True, env=env(),  # noqa
                                    timeout=120)
    helptext = run("--help").stdout
    assert "Memory is flat in the corpus size" in helptext and "--workers" in helptext and "--on-error" in helptext
    src = write_jsonl(tmp_path / "a.jsonl", DOCS[:2])
    proc = run(tmp_path / "o", src, "--val-fraction", "0.01")
    assert proc.returncode == 2 and "--val-fraction (now 0.01)" in proc.stderr and "Traceback" not in proc.stderr
    # a Hugging Face tokenizer directory, as convert_hf takes it
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text(tok.read_text())
    src = write_jsonl(tmp_path / "b.jsonl", DOCS)
    proc = run(tmp_path / "o", src, "--tokenizer", tmp_path / "hf", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    from tokenizers import Tokenizer
    n = Tokenizer.from_file(str(tok)).get_vocab_size()
    index, streams = open_token_dir(tmp_path / "o", 512)
    assert index["vocab_size"] == (n + 63) // 64 * 64 and streams["train"].max_id < n
    proc = run(tmp_path / "o2", src, "--tokenizer", tmp_path)  # a directory without one
    assert proc.returncode == 2 and "without a tokenizer.json" in proc.stderr


def test_progress_says_throughput_and_eta(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "PROGRESS_EVERY_S", 0.0)
    src = write_jsonl(tmp_path / "a.jsonl", DOCS)
    said = []
    prepare([str(src)], str(tmp_path / "o"), val_fraction=0.1, chunk_bytes=4000, say=said.append)
    lines = [s for s in said if "ETA" in s]
    assert lines and "MB/s" in lines[-1] and "M tokens/s" in lines[-1] and "%" in lines[-1]


def test_after_a_resume_the_rate_counts_only_this_sessions_bytes(monkeypatch):
    """A resume whose first chunk ends at 900 of 1,000 MB, then 10 MB/s: it says 10 MB/s and 5 s
    left at 950 MB (counting the 900 MB done before gave '207.4 MB/s ... ETA 2 s' with 146 s left)."""
    monkeypatch.setattr(prep, "PROGRESS_EVERY_S", 5.0)  # a line 5 s and 10 s after the baseline
    said, now = [], [0.0]
    progress = prep.Progress(1000 * 10**6, said.append, clock=lambda: now[0])
    for consumed in range(900, 1001, 10):
        progress.update(consumed * 10**6, 10**6)
        now[0] += 1.0
    assert said == ["95.0% of 1,000 MB, 10.0 MB/s, 1.00M tokens/s, ETA 5 s",
                    "100.0% of 1,000 MB, 10.0 MB/s, 1.00M tokens/s, ETA 0 s"]


def test_sigterm_stops_cleanly_and_the_rerun_resumes_to_the_same_bytes(tmp_path, tok):
    """A real SIGTERM to a running prepare_data with 2 workers, after its first checkpoint: exit
    143, one line naming where it stopped and how to resume, no traceback and no leaked semaphore
    (a silent death left the pool's); the rerun resumes and writes exactly what an uninterrupted
    run writes."""
    import os
    import signal
    import time
    docs = toy_documents(2000, seed=3)
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for i in range(8):  # ~5 MB: about 5 chunks of the tool's 1 MB, each ending in a checkpoint
            f.writelines(json.dumps({"text": f"{t} {i}"}) + "\n" for t in docs)
    tool = [sys.executable, str(ROOT / "tools" / "prepare_data.py")]
    args = [str(src), "--tokenizer", str(tok), "--workers", "2", "--shard-tokens", "50000"]
    out = tmp_path / "out"
    proc = subprocess.Popen(tool + [str(out)] + args, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    progress, deadline = out.with_name("out.partial") / "progress.json", time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:  # wait for the first checkpoint
        try:
            if json.loads(progress.read_text())["shards"]["train"]:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "prepare_data finished before it could be stopped"
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and "leaked" not in stderr and "semaphore" not in stderr, stderr
    assert lines[-1].startswith("prepare_data: stopped by SIGTERM at ") and "% of the input" in lines[-1]
    assert f"run the same command again to resume from {out}.partial, which keeps" in lines[-1], lines[-1]
    assert not out.exists()
    resumed = subprocess.run(tool + [str(out)] + args, env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr, resumed.stderr
    whole = subprocess.run(tool + [str(tmp_path / "whole")] + args, env=env(), capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert sorted(p.name for p in out.iterdir()) == names and len(names) > 6
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_a_text_file_larger_than_a_chunk_is_one_document_cut_between_characters(tmp_path):
    text = "héllo wörld ✓ naïve " * 300 + "\n" + "x" * 500  # multi-byte characters, a long last line
    (tmp_path / "big.txt").write_text(text)
    # a small document on the other side of the split than the big one
    side = prep.text_in_val(text, 0.5)
    small = next(t for t in (f"tiny {i}" for i in range(100)) if prep.text_in_val(t, 0.5) != side)
    (tmp_path / "small.txt").write_text(small)
    index = prepare([str(tmp_path)], str(tmp_path / "o"), val_fraction=0.5, chunk_bytes=97)
    docs = []
    for split in ("train", "val"):
        ids = split_tokens(tmp_path / "o", split)
        ends = np.flatnonzero(ids == 257)  # EOS ends each document
        docs += [bytes(d[:-1].astype(np.uint8)).decode() for d in np.split(ids, ends + 1)[:-1]]
    assert sorted(docs) == sorted([text, small])
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 2
