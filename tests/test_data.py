"""Token files and batches: determinism, DP slicing, resume position, bad files."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from moe_trainer.data import (BYTE_VOCAB_PADDED, EOS_ID, BatchSource, DataError, default_corpus_dir, open_data,
                              open_token_dir, prepare, unigram_entropy)

from conftest import ROOT, env


def split_tokens(token_dir, split: str) -> np.ndarray:
    """A split's ids: its shards (index.json lists them) end to end."""
    index = json.loads((token_dir / "index.json").read_text())
    shards = index["splits"][split]["shards"]
    return np.concatenate([np.fromfile(token_dir / s["file"], dtype=index["dtype"]) for s in shards])


def first_shard(token_dir, split: str):
    return token_dir / json.loads((token_dir / "index.json").read_text())["splits"][split]["shards"][0]["file"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    files = []
    for i in range(60):
        f = d / f"doc{i}.txt"
        f.write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (5 + i % 7))
        files.append(str(f))
    jl = d / "more.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"json line {i} " * 20}) for i in range(40)))
    out = d / "tokens"
    prepare(files + [str(jl)], str(out), val_fraction=0.2)
    return out


def test_prepare_writes_index_and_memmaps(corpus):
    index = json.loads((corpus / "index.json").read_text())
    assert index["vocab_size"] == BYTE_VOCAB_PADDED and index["eos_id"] == EOS_ID
    train = split_tokens(corpus, "train")
    assert len(train) == index["splits"]["train"]["num_tokens"]
    assert index["splits"]["train"]["max_id"] == int(train.max()) == EOS_ID
    assert index["splits"]["val"]["documents"] > 0 and index["splits"]["train"]["documents"] > 0
    assert (train == EOS_ID).sum() == index["splits"]["train"]["documents"]
    assert bytes(train[:9].astype(np.uint8)).startswith(b"document") or bytes(train[:4].astype(np.uint8)) == b"json"


def test_batches_are_deterministic_and_dp_slices_partition_the_global_batch(corpus):
    _, splits = open_token_dir(corpus, 320)
    a, b = BatchSource(splits["train"], 16, seed=7), BatchSource(splits["train"], 16, seed=7)
    step, gbs, mb = 3, 8, 2
    whole = torch.cat([a.micro_batch(step, m, gbs, mb, 0, 1) for m in range(gbs // mb)])
    assert torch.equal(whole, torch.cat([b.micro_batch(step, m, gbs, mb, 0, 1) for m in range(4)]))
    # 2 and 4 data-parallel ranks: disjoint parts that together are exactly the 1-rank global batch
    for dp in (2, 4):
        parts = torch.cat([b.micro_batch(step, m, gbs, mb, r, dp) for r in range(dp) for m in range(gbs // mb // dp)])
        assert torch.equal(parts, whole)
    windows = [a.window(step * gbs + i) for i in range(gbs)]
    assert len(set(windows)) == gbs  # no window twice in a batch
    c = BatchSource(splits["train"], 16, seed=8)
    assert not torch.equal(whole, torch.cat([c.micro_batch(step, m, gbs, mb, 0, 1) for m in range(4)]))
    # labels are inputs shifted by one inside the (seq_len + 1)-token window
    assert whole.shape == (gbs, 17)


def test_epochs_visit_every_window_once(corpus):
    _, splits = open_token_dir(corpus, 320)
    src = BatchSource(splits["train"], 16, seed=1)
    n = src.n_windows
    assert sorted(src.window(i) for i in range(n)) == list(range(n))
    assert sorted(src.window(n + i) for i in range(n)) == list(range(n))
    assert [src.window(i) for i in range(n)] != [src.window(n + i) for i in range(n)]


def test_resume_position_is_the_step(corpus):
    """Batch k depends only on (seed, k): a fresh source at step 5 sees what a source that ran 0..4 sees."""
    _, splits = open_token_dir(corpus, 320)
    ran = BatchSource(splits["train"], 16, seed=3)
    for s in range(5):
        ran.micro_batch(s, 0, 8, 8, 0, 1)
    fresh = BatchSource(splits["train"], 16, seed=3)
    assert torch.equal(ran.micro_batch(5, 0, 8, 8, 0, 1), fresh.micro_batch(5, 0, 8, 8, 0, 1))


def test_truncated_file_is_rejected(corpus, tmp_path):
    bad = tmp_path / "t"
    bad.mkdir()
    for f in corpus.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    data = first_shard(bad, "train").read_bytes()
    first_shard(bad, "train").write_bytes(data[:-10])
    with pytest.raises(DataError, match="truncated"):
        open_token_dir(bad, 320)


def test_out_of_range_ids_are_rejected(corpus, tmp_path):
    bad = tmp_path / "t"
    bad.mkdir()
    for f in corpus.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    arr = np.fromfile(first_shard(bad, "val"), dtype=np.uint16)
    arr[3] = 5000
    arr.tofile(first_shard(bad, "val"))
    with pytest.raises(DataError, match="id 5000, outside model.vocab_size"):
        open_token_dir(bad, 320)
    with pytest.raises(DataError, match="exceeds model.vocab_size"):
        open_token_dir(corpus, 256)


def test_empty_corpus_and_missing_index(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty or too small"):
        prepare([str(empty)], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert not list(tmp_path.glob("out.tmp*"))
    with pytest.raises(DataError, match="no index.json"):
        open_token_dir(tmp_path, 320)


def test_prepare_data_cli(tmp_path):
    tool = [sys.executable, str(ROOT / "tools" / "prepare_data.py")]
    proc = subprocess.run(tool + [str(tmp_path / "o"), str(tmp_path / "missing.txt")], capture_output=True,
                          text=True, env=env(), timeout=60)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    proc = subprocess.run(tool + [str(tmp_path / "o"), str(bad)], capture_output=True, text=True, env=env(),
                          timeout=60)
    assert proc.returncode == 2 and "line 1" in proc.stderr and "'text'" in proc.stderr


def test_default_corpus_is_the_stdlib():
    path = default_corpus_dir()
    index, train, val = open_data("", 64, 0, 320)
    assert index["tokenizer"]["type"] == "bytes"
    assert index["splits"]["train"]["num_tokens"] > 5_000_000  # the stdlib is tens of MB
    assert 0.005 < index["splits"]["val"]["num_tokens"] / index["splits"]["train"]["num_tokens"] < 0.06
    assert default_corpus_dir() == path  # cached, same place
    h = unigram_entropy(train.stream.read(0, 2_000_000), 320)
    assert 2.5 < h < 4.0  # Python source as bytes


def _build_and_open(barrier, results, i):
    from moe_trainer import data
    barrier.wait()  # all at once, as the ranks of a job start
    try:
        data.open_token_dir(data.default_corpus_dir(), 320)
        results[i] = "ok"
    except Exception as e:  # noqa: BLE001 (reported to the test)
        results[i] = f"{type(e).__name__}: {e}"


def test_ranks_starting_together_build_the_default_corpus_once(tmp_path, monkeypatch):
    """Ranks of a fresh machine's first job build the cache at once: one builds, the others wait and
    read its directory (two builders replaced each other's directory under a reader: 'token file ...
    truncated or missing: 0 bytes')."""
    import importlib
    import multiprocessing as mp
    from moe_trainer import data
    default = importlib.import_module("moe_trainer.data.default")
    files = data.stdlib_files()[:300]
    log = tmp_path / "builds"
    build = default.write_token_dir

    def counted(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return build(*args, **kwargs)
    monkeypatch.setenv("MOE_TRAINER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default, "stdlib_files", lambda: files)
    monkeypatch.setattr(default, "write_token_dir", counted)
    ctx = mp.get_context("fork")
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Manager().dict()
    procs = [ctx.Process(target=_build_and_open, args=(barrier, results, i)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert dict(results) == {i: "ok" for i in range(n)}
    assert len(log.read_text().split()) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == \
        [data.default_corpus_dir().name]  # no temporary or moved-aside directory left


def test_a_tokenizer_s_own_end_of_text_separates_documents_and_travels(tmp_path):
    from tokenizers import Tokenizer
    from conftest import toy_documents, train_tokenizer
    tok_file = train_tokenizer(tmp_path / "tokenizer.json")
    tok = Tokenizer.from_file(str(tok_file))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in toy_documents(40)))
    index = prepare([str(docs)], str(tmp_path / "tokens"), str(tok_file), val_fraction=0.2)
    eos = tok.token_to_id("<|endoftext|>")
    assert index["eos_id"] == eos and index["tokenizer"]["eos_token"] == "<|endoftext|>"
    n = tok.get_vocab_size()
    assert index["vocab_size"] == (n + 63) // 64 * 64 > 320  # padded to a multiple of 64, no extra id
    train = split_tokens(tmp_path / "tokens", "train")
    assert (train == eos).sum() == index["splits"]["train"]["documents"] and train.max() < n
    assert (tmp_path / "tokens" / "tokenizer.json").read_text() == tok_file.read_text()
    cfg = json.loads((tmp_path / "tokens" / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    # a tokenizer without an end-of-text token: one sentence pointing at --eos-token
    bare = train_tokenizer(tmp_path / "bare.json", eos="")
    with pytest.raises(DataError, match="no end-of-text token.*--eos-token"):
        prepare([str(docs)], str(tmp_path / "t2"), str(bare))
    assert not (tmp_path / "t2").exists()


def test_the_byte_tokenizer_reads_and_writes_the_default_corpus_ids():
    from tokenizers import Tokenizer
    from moe_trainer.data import byte_tokenizer_files
    path = default_corpus_dir()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "def f(x):\n\treturn x  # héllo ✓\n"
    assert tok.encode(text).ids == list(text.encode())
    assert tok.decode(list(text.encode())) == text
    assert tok.token_to_id("<|endoftext|>") == EOS_ID and tok.get_vocab_size() == 259
    assert (path / "tokenizer.json").read_text() == byte_tokenizer_files()["tokenizer.json"]
