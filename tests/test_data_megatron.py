"""Megatron indexed datasets (PREFIX.bin + PREFIX.idx) written by megatron-core's own
IndexedDatasetBuilder, read in place as data.path and trained on."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from moe_trainer.data import DataError, open_data, open_megatron
from moe_trainer.data.formats import read_megatron_index

from conftest import TINY, check, launch, toy_documents, train_tokenizer

# megatron-core's builder, in its own process: its import (~7-15 s here, with optimizer fallbacks and
# warnings) stays out of the test process, and runs once for every dataset of this module
BUILD = """
import json, sys, warnings
warnings.simplefilter("ignore")
import numpy as np, torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
out = {}
for prefix, dtype, docs in json.load(open(sys.argv[1])):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=getattr(np, dtype))
    for sequences in docs:  # a document: its sequences (sentences, as --split-sentences writes them)
        for seq in sequences:
            builder.add_item(torch.tensor(seq))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    read = IndexedDataset(prefix)  # kept while its arrays are read: they view its memory map
    out[prefix] = read.document_indices.tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A BPE tokenizer, 150 documents tokenized with it and ended by EOS (preprocess_data's
    --append-eod; every fifth document in two sequences), written by megatron-core as uint16,
    int32, and 4 times over for training: (dir, tokenizer, documents, {name: prefix}, {prefix:
    the builder's document index})."""
    pytest.importorskip("megatron.core")
    from tokenizers import Tokenizer
    d = tmp_path_factory.mktemp("megatron")
    tok_file = train_tokenizer(d / "tokenizer.json")
    tok = Tokenizer.from_file(str(tok_file))
    eos = tok.token_to_id("<|endoftext|>")
    docs = []
    for i, text in enumerate(toy_documents(150, seed=2)):
        ids = tok.encode(text, add_special_tokens=False).ids + [eos]
        docs.append([ids[:5], ids[5:]] if i % 5 == 0 else [ids])
    prefixes = {"uint16": str(d / "c16"), "int32": str(d / "c32"), "train": str(d / "big")}
    jobs = [(prefixes["uint16"], "uint16", docs), (prefixes["int32"], "int32", docs),
            (prefixes["train"], "uint16", docs * 4)]
    (d / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, "-c", BUILD, str(d / "jobs.json")], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d, tok_file, docs, prefixes, json.loads(proc.stdout.splitlines()[-1])


def copy_prefix(prefix: str, to) -> str:
    for ext in (".bin", ".idx"):
        shutil.copyfile(prefix + ext, str(to) + ext)
    return str(to)


def test_a_megatron_prefix_is_read_in_place_with_its_documents_and_dtype(corpus):
    d, tok, docs, prefixes, theirs = corpus
    for dtype in ("uint16", "int32"):
        prefix = prefixes[dtype]
        m = read_megatron_index(prefix)
        assert m.dtype == np.dtype(dtype) and m.documents.tolist() == theirs[prefix]
        index, streams = open_megatron(prefix, 512, str(tok), val_fraction=0.1)
        flat = [np.concatenate([np.asarray(s) for s in doc]) for doc in docs]
        n_val = round(150 * 0.1)  # the last documents, as Megatron's own contiguous split
        assert np.array_equal(streams["train"].read(0, streams["train"].num_tokens), np.concatenate(flat[:-n_val]))
        assert np.array_equal(streams["val"].read(0, streams["val"].num_tokens), np.concatenate(flat[-n_val:]))
        assert index["splits"]["val"]["documents"] == n_val and index["dtype"] == dtype
        # in place: the streams are views of PREFIX.bin, nothing copied or converted
        assert isinstance(streams["train"].parts[0], np.memmap)
        assert str(streams["train"].parts[0].filename) == prefix + ".bin"


def test_a_megatron_prefix_needs_its_tokenizer_and_an_intact_index(corpus, tmp_path):
    d, tok, docs, prefixes, _ = corpus
    prefix = copy_prefix(prefixes["uint16"], tmp_path / "c")
    with pytest.raises(DataError, match="carries no tokenizer; name the one it was made with as data.tokenizer"):
        open_data(prefix, 16, 0, 512)
    for name in (prefix, prefix + ".bin", prefix + ".idx"):  # the prefix, or either file
        index, train, val = open_data(name, 16, 0, 512, 0.1, str(tok))
        assert index["format"] == "megatron.indexed" and train.n_windows > 10
    raw = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(raw[:-2])
    with pytest.raises(DataError, match="c.bin is .* bytes, its index says"):
        open_data(prefix, 16, 0, 512, 0.1, str(tok))
    (tmp_path / "c.bin").write_bytes(raw)
    (tmp_path / "c.idx").write_bytes(b"not an index at all, sorry")
    with pytest.raises(DataError, match="no MMIDIDX header"):
        open_data(prefix, 16, 0, 512, 0.1, str(tok))


def test_a_megatron_dataset_trains_as_data_path(corpus, tmp_path):
    """model.vocab_size=auto follows data.tokenizer; the run directory gets the tokenizer."""
    d, tok, docs, prefixes, _ = corpus
    prefix = prefixes["train"]
    run = tmp_path / "run"
    proc = check(launch(1, run, TINY + ["train.max_steps=2", f"data.path={prefix}", f"data.tokenizer={tok}",
                                        "data.val_fraction=0.05"], launcher="python"))
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    from tokenizers import Tokenizer
    n = Tokenizer.from_file(str(tok)).get_vocab_size()
    assert cfg["model"]["vocab_size"] == (n + 63) // 64 * 64 and cfg["data"]["tokenizer"] == str(tok)
    assert f"data {prefix}:" in proc.stdout and "documents end with '<|endoftext|>'" in proc.stdout
    assert (run / "tokenizer.json").read_text() == tok.read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows
                                                                       if "loss" in r)
