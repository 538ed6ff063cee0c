"""Weighted mixtures (data.sources): the schedule's shares, batches that do not depend on the layout,
per-source metrics, and the resume rules of the run directory (mixture changes, data fingerprints,
the derived vocabulary, the implicit default config)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from moe_trainer.config import ConfigError, given_values
from moe_trainer.resolve import load_config
from moe_trainer.data import Mixture, open_mixture, prepare
from moe_trainer.data.formats import MEGATRON_HEADER, MEGATRON_MAGIC
from moe_trainer.data.mixture import MAX_PERIOD, fingerprint
from moe_trainer.run_dir import merge_for_resume, plan_start

from conftest import ROOT, TINY, assert_same_steps, check, env, launch, read_metrics, toy_documents, train_tokenizer

TINY_CONFIG = str(ROOT / "configs" / "moe_tiny.yaml")


def realised_error(weights, n: int) -> float:
    """max over prefixes [0, k), k <= n, and sources of |samples drawn - share * k|, in samples."""
    m = Mixture(weights)
    which, _ = m.locate(np.arange(n))
    share = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[which], axis=0)  # (n, k) counts after each sample
    return float(np.abs(counts - np.arange(1, n + 1)[:, None] * share).max())


@pytest.mark.parametrize("weights", [[0.8, 0.2], [8, 2], [0.5, 0.3, 0.2], [1, 1, 1], [0.01, 0.99],
                                     [0.37, 0.21, 0.13, 0.11, 0.09, 0.05, 0.03, 0.01]])
def test_every_prefix_holds_each_share_within_one_sample(weights):
    assert realised_error(weights, 10_000) < 1  # within 1% of 10,000 samples is 100: this is 100x tighter


def test_shares_past_the_period_cap_are_rounded_and_the_table_stays_bounded():
    weights = [0.123457, 0.3, 0.2111]  # least common denominator past 2^16
    m = Mixture(weights)
    assert m.period == MAX_PERIOD and m.slot_source.nbytes + m.slot_rank.nbytes == 6 * MAX_PERIOD
    assert realised_error(weights, 10_000) < 1 + 10_000 / MAX_PERIOD


def test_sample_numbers_within_a_source_count_up_and_the_counts_agree():
    m = Mixture([0.5, 0.3, 0.2])
    which, number = m.locate(np.arange(1000))
    for j in range(3):
        assert np.array_equal(number[which == j], np.arange((which == j).sum()))  # each source's samples in order
    assert m.counts(1000).tolist() == np.bincount(which, minlength=3).tolist() and m.counts(1000).sum() == 1000


# ----------------------------------------------------------------------------- data

def write_megatron(prefix: Path, docs: list[np.ndarray]) -> str:
    """A Megatron indexed dataset (version 1, uint16, one sequence per document) as its builder lays it out."""
    lengths = np.asarray([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 2]).astype(np.int64)
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(MEGATRON_HEADER.pack(MEGATRON_MAGIC, 1, 8, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())
    np.concatenate(docs).astype(np.uint16).tofile(str(prefix) + ".bin")
    return str(prefix)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One BPE tokenizer; "web", a token directory prepared with it, and "code", a Megatron prefix of the same
    tokenizer's ids (each document ended by its end-of-text id); the 0.8/0.2 mixture's --set lines."""
    from tokenizers import Tokenizer
    d = tmp_path_factory.mktemp("mixture")
    tok_file = train_tokenizer(d / "tokenizer.json")
    (d / "web.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in toy_documents(120, seed=1)))
    prepare([str(d / "web.jsonl")], str(d / "web"), str(tok_file), val_fraction=0.1)
    tok = Tokenizer.from_file(str(tok_file))
    eos = tok.token_to_id("<|endoftext|>")
    docs = [np.asarray(tok.encode(t.upper()).ids + [eos]) for t in toy_documents(80, seed=2)]
    code = write_megatron(d / "code", docs)
    sources = [{"path": str(d / "web"), "weight": 0.8}, {"path": code, "weight": 0.2}]
    sets = [f"data.sources={json.dumps(sources)}", f"data.tokenizer={tok_file}", "data.val_fraction=0.1"]
    return d, sources, sets


def test_a_mixture_batch_is_the_same_whatever_the_data_parallel_split(data):
    d, sources, sets = data
    cfg = load_config(TINY_CONFIG, sets, check_data=True)
    vocab = cfg.model.vocab_size  # the tokenizer's, padded to 64
    assert [e["name"] for e in cfg.data.sources] == ["web", "code"] and vocab > 320
    index, train, val = open_mixture(cfg.data.sources, [], 32, 7, vocab, 0.1, cfg.data.tokenizer)
    assert set(val) == {"web", "code"} and index["sources"]["code"]["weight"] == 0.2
    whole = train.micro_batch(3, 0, 16, 16, 0, 1)  # (16, 33)
    parts = [train.micro_batch(3, micro, 16, 4, rank, 2) for rank in range(2) for micro in range(2)]
    assert whole.shape == (16, 33) and (np.concatenate(parts) == whole.numpy()).all()
    _, again, _ = open_mixture(cfg.data.sources, [], 32, 7, vocab, 0.1, cfg.data.tokenizer)
    assert (again.samples(40, 20) == train.samples(40, 20)).all()  # a pure function of (seed, i)
    # data.val_sources: those sets' val splits instead of each source's own
    _, _, held = open_mixture(cfg.data.sources, [{"path": sources[1]["path"], "name": "held"}], 32, 7, vocab, 0.1,
                              cfg.data.tokenizer)
    assert list(held) == ["held"] and (held["held"].samples(0, 2) == val["code"].samples(0, 2)).all()
    # epochs wrap per source: "code" (the small one) visits each of its windows once per epoch of its own
    code = train.sources[1]
    n = code.n_windows
    windows = code.windows_of(np.arange(3 * n))
    assert all(sorted(windows[e * n:(e + 1) * n]) == list(range(n)) for e in range(3))
    assert not np.array_equal(windows[:n], windows[n:2 * n])  # each epoch its own order


def test_bad_sources_get_one_sentence(data):
    d, sources, sets = data
    for bad, words in (([f"data.path={d / 'web'}"], "data.path and data.sources exclude each other"),
                       ([f"data.sources={json.dumps([sources[0], sources[0]])}"], "names 'web' twice"),
                       ([f"data.sources={json.dumps([{'path': sources[0]['path'], 'weight': 0}])}"],
                        r"data.sources\[0\].weight must be a positive number, got 0"),
                       ([f"data.sources={json.dumps([{'path': 'x', 'weight': 1, 'share': 2}])}"],
                        r"unknown key data.sources\[0\].share; valid keys here are: path, weight, name"),
                       (["data.sources=[]", f"data.val_sources=[{{path: {d / 'web'}}}]"],
                        "data.val_sources needs data.sources")):
        with pytest.raises(ConfigError, match=words):
            load_config(TINY_CONFIG, sets + bad, check_data=True)


# ----------------------------------------------------------------------------- launched runs

MIX_STEPS = ["train.max_steps=4", "train.checkpoint_every=4", "train.eval_every=2"]


@pytest.fixture(scope="module")
def mixed_runs(data, tmp_path_factory):
    """The 0.8/0.2 mixture, 4 steps of the tiny MoE, on one rank and on ep 2 over 2 ranks."""
    d, sources, sets = data
    root = tmp_path_factory.mktemp("mixed_runs")
    one = check(launch(1, root / "one", TINY + MIX_STEPS + sets, launcher="python"))
    two = check(launch(2, root / "two", TINY + MIX_STEPS + sets + ["parallel.ep=2"]))
    return root / "one", root / "two", one, two


def test_a_mixture_trains_the_same_batches_on_ep_2_as_on_one_rank_with_per_source_metrics(data, mixed_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    d, sources, _ = data
    one, two, proc, _ = mixed_runs
    assert "data mixture web 0.8" in proc.stdout and "code 0.2" in proc.stdout
    assert_same_steps(one, two, steps=(1, 2, 3, 4))
    mixture = Mixture([0.8, 0.2])
    for run in (one, two):
        rows = read_metrics(run)
        drawn = {r["step"]: r["source_samples"] for r in rows if "loss" in r}
        assert drawn == {s: dict(zip(["web", "code"], mixture.counts(8 * s).tolist())) for s in (1, 2, 3, 4)}
        assert drawn[4] == {"web": 26, "code": 6}  # 32 samples: 25.6 and 6.4
        vals = {r["step"]: r for r in rows if "val_loss" in r}
        assert sorted(vals) == [2, 4] and all({"val_loss/web", "val_loss/code"} <= set(v) for v in vals.values())
        v = vals[4]
        assert abs(v["val_loss"] - (0.8 * v["val_loss/web"] + 0.2 * v["val_loss/code"])) < 1e-9
        acc = EventAccumulator(str(run / "tensorboard"))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        assert {"val_loss/web", "val_loss/code", "source_samples/web", "source_samples/code"} <= set(tags)
        assert [e.value for e in acc.Scalars("val_loss/code")] == pytest.approx(
            [vals[s]["val_loss/code"] for s in (2, 4)], rel=1e-6)
        fingerprints = json.loads((run / "data_fingerprint.json").read_text())
        assert set(fingerprints) == {"web", "code"} and fingerprints["code"]["tokens"] > 0
    a, b = ({s: r for s, r in ((r["step"], r) for r in read_metrics(run)) if "val_loss" in r} for run in (one, two))
    for s in (2, 4):  # the validation batches too
        for key in ("val_loss/web", "val_loss/code"):
            assert a[s][key] == pytest.approx(b[s][key], rel=1e-4)


def _resume_cfg(run: Path, sets: list, *more: str):
    lines = TINY + MIX_STEPS + sets + [f"run.out_dir={run}", "train.resume=auto", *more]
    return load_config(TINY_CONFIG, lines, check_data=True), given_values(TINY_CONFIG, lines)


def test_a_resume_that_reweights_adds_a_source_or_meets_changed_data_is_refused_unless_allowed(data, mixed_runs,
                                                                                               tmp_path):
    d, sources, sets = data
    run = Path(shutil.copytree(mixed_runs[0], tmp_path / "run"))
    half = [dict(e, weight=0.5) for e in sources]
    reweighted = [f"data.sources={json.dumps(half)}"] + sets[1:]
    with pytest.raises(ConfigError, match=r"data.sources.web.weight would change what the resumed run trains .* "
                                          r"has 0.8, this command gives 0.5.*"
                                          r"train.resume_allow=\[data.sources.web.weight\]"):
        plan_start(*_resume_cfg(run, reweighted))
    start = plan_start(*_resume_cfg(run, reweighted, "train.resume_allow=[data.sources]"))
    assert start.changes["data.sources.web.weight"] == (0.8, 0.5) and start.changes["data.sources.code.weight"]
    assert [e["weight"] for e in start.cfg.data.sources] == [0.5, 0.5]
    tenfold = [f"data.sources={json.dumps([dict(e, weight=10 * e['weight']) for e in sources])}"]
    start = plan_start(*_resume_cfg(run, tenfold + sets[1:]))  # 8/2 is 0.8/0.2: no change, the saved entries stay
    assert set(start.changes) == {"run.out_dir"} and [e["weight"] for e in start.cfg.data.sources] == [0.8, 0.2]
    added = [f"data.sources={json.dumps(sources + [{'path': str(d / 'web'), 'weight': 0.1, 'name': 'more'}])}"]
    with pytest.raises(ConfigError, match=r"this command adds source 'more' \(.*web\) to data.sources.*"
                                          r"train.resume_allow=\[data.sources.more\]"):
        plan_start(*_resume_cfg(run, added + sets[1:]))
    assert "data.sources.more" in plan_start(*_resume_cfg(run, added + sets[1:],
                                                          "train.resume_allow=[data.sources.more]")).changes
    # the recorded fingerprint no longer matches the data (as after re-preparing "web" in place)
    recorded = json.loads((run / "data_fingerprint.json").read_text())
    recorded["web"]["tokens"] += 1
    (run / "data_fingerprint.json").write_text(json.dumps(recorded))
    with pytest.raises(ConfigError, match=r"data source 'web' \(.*web\) changed since the run recorded it in .*"
                                          r"data_fingerprint.json: index hash .*tokens.*train.resume_allow="
                                          r"\[data.fingerprint.web\]"):
        plan_start(*_resume_cfg(run, sets))


def test_a_token_set_fingerprint_follows_its_index(data, tmp_path):
    d, sources, _ = data
    web = Path(shutil.copytree(d / "web", tmp_path / "web"))
    before = fingerprint(str(web))
    index = json.loads((web / "index.json").read_text())
    index["note"] = "re-prepared"
    (web / "index.json").write_text(json.dumps(index))
    assert fingerprint(str(web))["hash"] != before["hash"] and fingerprint(sources[1]["path"])["tokens"] > 0


def test_dropping_data_path_keeps_it_and_a_derived_vocab_is_explained_by_its_data(data, tmp_path):
    """Bug (a): vocab_size auto was resolved against the default corpus before the saved data.path was
    merged, and the refusal named model.vocab_size."""
    d, _, _ = data
    where = tmp_path / "config.yaml"
    saved = load_config(TINY_CONFIG, [f"data.path={d / 'web'}"], check_data=True)
    vocab = saved.model.vocab_size
    assert vocab > 320
    now = load_config(TINY_CONFIG, [], check_data=True)  # moe_tiny.yaml writes vocab_size: auto
    merged, changes = merge_for_resume(saved, now, given_values(TINY_CONFIG, []), where)
    assert changes == {} and merged.data.path == str(d / "web") and merged.model.vocab_size == vocab
    sets = ["data.path="]
    with pytest.raises(ConfigError, match=r"^data.path would change what the resumed run trains"):
        merge_for_resume(saved, load_config(TINY_CONFIG, sets, check_data=True), given_values(TINY_CONFIG, sets),
                         where)
    sets = ["data.path=", "train.resume_allow=[data.path]"]
    with pytest.raises(ConfigError, match=r"^model.vocab_size is auto, so it follows data.path: the data this command "
                                          rf"gives has vocabulary 320, the resumed run's model {vocab}"):
        merge_for_resume(saved, load_config(TINY_CONFIG, sets, check_data=True), given_values(TINY_CONFIG, sets),
                         where)
    sets = ["data.path=", "train.resume_allow=[data.path, model.vocab_size]"]
    merged, changes = merge_for_resume(saved, load_config(TINY_CONFIG, sets, check_data=True),
                                       given_values(TINY_CONFIG, sets), where)
    assert changes["model.vocab_size"] == (vocab, 320) and merged.model.vocab_size == 320


def test_a_resume_with_only_sets_keeps_every_other_saved_key(data, mixed_runs, tmp_path):
    """Bug (b): `--set run.out_dir=... --set train.max_steps=N` without --config took the implicit default
    config's values as changes. One real launch: the mixture run resumes with its TINY model, its
    layout and an allowed reweighting, recorded in config_history.jsonl; the mixture carries on."""
    d, sources, _ = data
    run = Path(shutil.copytree(mixed_runs[0], tmp_path / "run"))
    half = json.dumps([dict(e, weight=0.5) for e in sources])
    cmd = [sys.executable, "-m", "moe_trainer.train", "--set", f"run.out_dir={run}", "--set", "train.max_steps=6",
           "--set", f"data.sources={half}", "--set", "train.resume_allow=[data.sources]"]
    proc = check(subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300))
    assert "resumed from" in proc.stdout and "step_4" in proc.stdout
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    # (train.resume: the command's auto keeps the saved value, as it always has)
    assert set(history[-1]["changes"]) == {"run.out_dir", "train.max_steps", "train.resume_allow",
                                           "data.sources.web.weight", "data.sources.code.weight"}
    assert history[-1]["changes"]["data.sources.code.weight"] == [0.2, 0.5] and set(history[-1]["data"]) == {"web",
                                                                                                              "code"}
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["hidden_size"] == 64 and cfg["train"]["checkpoint_every"] == 4  # TINY's, not moe_tiny.yaml's
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["source_samples"] == dict(zip(["web", "code"], Mixture([0.5, 0.5]).counts(48).tolist()))
