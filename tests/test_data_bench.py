"""The data benchmarks' inputs: bench_start's sparse token sets open as real token directories
without reading their tokens, and bench's GPT-2 files hold the BPE that Megatron-LM's
GPT2BPETokenizer reads (the same vocabulary, end-of-text token included, and merges)."""
import json

from moe_trainer.data import open_data
from moe_trainer.data.bench import gpt2_files
from moe_trainer.data.bench_start import sparse_token_set

from conftest import train_tokenizer


def test_a_sparse_token_set_opens_like_a_prepared_one(tmp_path):
    index = sparse_token_set(tmp_path / "tokens", 0.05)  # 25M tokens, nearly all of them a hole
    shard = tmp_path / "tokens" / index["splits"]["train"]["shards"][-1]["file"]
    assert shard.stat().st_size == index["splits"]["train"]["shards"][-1]["num_tokens"] * 2
    assert shard.stat().st_blocks * 512 < shard.stat().st_size / 10  # sparse: the hole takes no disk
    meta, train, val = open_data(str(tmp_path / "tokens"), 32, 1234, 320)
    assert meta["splits"]["train"]["num_tokens"] == index["splits"]["train"]["num_tokens"] >= 25_000_000
    batch = train.micro_batch(0, 0, 4, 4, 0, 1)
    assert batch.shape == (4, 33) and int(batch.max()) < 320

def test_gpt2_files_hold_the_tokenizers_bpe(tmp_path):
    tok = train_tokenizer(tmp_path / "tokenizer.json")
    vocab, merges = gpt2_files(tok, tmp_path)
    model = json.loads(tok.read_text())
    words = json.loads(vocab.read_text())
    assert words["<|endoftext|>"] == next(t["id"] for t in model["added_tokens"] if t["content"] == "<|endoftext|>")
    assert len(words) == len(set(model["model"]["vocab"]) | {t["content"] for t in model["added_tokens"]})
    assert all(words[w] == i for w, i in model["model"]["vocab"].items())
    lines = merges.read_text().splitlines()
    assert lines[0].startswith("#version") and len(lines) - 1 == len(model["model"]["merges"])
    assert all(len(line.split(" ")) == 2 for line in lines[1:])
