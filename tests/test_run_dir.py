"""The run directory keeps its word: a resume continues the saved config (layout changes
recorded, data changes refused), own data with a tokenizer trains without a vocab setting
and exports to transformers with its tokenizer, the start banner, errors printed once, and
the cached MFU peak."""
import json
import shutil

import pytest
import torch
import yaml

from moe_trainer import metrics
from moe_trainer.config import ConfigError, Config, given_keys
from moe_trainer.resolve import load_config
from moe_trainer.run_dir import merge_for_resume, resumable

from conftest import ROOT, TINY, check, launch, read_metrics, toy_documents, train_tokenizer

STEPS = ["train.max_steps=2", "train.checkpoint_every=2", "train.resume=auto"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tokenizer trained here, JSONL prepared with it, and 2 steps of the tiny MoE on it with no
    vocab setting (model.vocab_size=auto), one rank."""
    from moe_trainer.data import prepare
    d = tmp_path_factory.mktemp("own_data")
    tok = train_tokenizer(d / "tokenizer.json")
    docs = d / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in toy_documents(120)))
    index = prepare([str(docs)], str(d / "tokens"), str(tok), val_fraction=0.1)
    run = d / "run"
    proc = check(launch(1, run, TINY + STEPS + [f"data.path={d / 'tokens'}"], launcher="python"))
    return d, run, index, proc


def test_vocab_follows_the_data_and_the_banner_says_what_the_start_decided(trained):
    d, run, index, proc = trained
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["vocab_size"] == index["vocab_size"] > 320  # auto, resolved and recorded
    out = proc.stdout
    assert out.count("==== moe_trainer ====") == 1 and out.index("==== moe_trainer") < out.index("step 1/2")
    for words in ("world 1: dp 1, ep 1 (expert-dp 1), pp 1", "tp 1, cp 1", "parameters,", "activated per token",
                  "on this rank", "tokens per step 256 (8 sequences x 32)", f"data {d / 'tokens'}",
                  f"vocab {index['vocab_size']}, documents end with '<|endoftext|>'",
                  "start: fresh initialisation from run.seed 1234, step 0", "MFU peak 1 TFLOP/s per rank (config",
                  f"run directory {run}", f"tensorboard --logdir {run / 'tensorboard'}"):
        assert words in out, words
    assert (run / "tokenizer.json").read_text() == (d / "tokenizer.json").read_text()
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["resumed_from"] is None and history[0]["peak_tflops"] == 1.0
    assert json.loads((run / "peak_tflops.json").read_text())["peak_tflops"] == 1.0
    assert all("wall_time" in r for r in read_metrics(run))


def test_a_resume_that_would_change_the_data_is_refused_and_changes_nothing(trained, tmp_path):
    d, run, _, _ = trained
    run = shutil.copytree(run, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    proc = launch(1, run, TINY + ["train.max_steps=3", "train.resume=auto", "data.path="], launcher="python")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, proc.stderr
    for words in ("data.path", str(d / "tokens"), "''", "train.resume_allow=[data.path]", "another run.out_dir"):
        assert words in lines[0], words
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # config.yaml included


def test_a_resume_on_another_layout_is_accepted_and_recorded(trained, tmp_path):
    d, run, _, _ = trained
    run = shutil.copytree(run, tmp_path / "run")
    proc = check(launch(2, run, TINY + [f"data.path={d / 'tokens'}", "parallel.ep=2", "train.max_steps=3",
                                        "train.resume=auto"]))
    assert "resumed from" in proc.stdout and "step_2" in proc.stdout
    assert "parallel.ep: 1 -> 2" in proc.stdout and "train.max_steps: 2 -> 3" in proc.stdout
    assert "start: resumed from" in proc.stdout and "world 2: dp 2, ep 2" in proc.stdout
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["parallel"]["ep"] == 2 and cfg["train"]["max_steps"] == 3
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert len(history) == 2 and history[0]["config"]["parallel"]["ep"] == 1
    changes = history[1]["changes"]  # the copied directory's run.out_dir and TINY's checkpoint_every=0 too
    assert changes["parallel.ep"] == [1, 2] and changes["train.max_steps"] == [2, 3]
    assert set(changes) == {"parallel.ep", "train.max_steps", "run.out_dir", "train.checkpoint_every"}
    assert history[1]["resumed_from"].endswith("step_2") and history[1]["world"] == 2
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3]
    # the ZeRO gradient reductions and parameter gathers are counted like the all-to-alls
    last = [r for r in read_metrics(run) if "loss" in r][-1]
    zero = {k: v for k, v in last.items() if k.startswith("comm.zero_dp_") and k.endswith("_sent_bytes")}
    assert zero and sum(zero.values()) > 0, sorted(last)


def test_the_export_loads_in_transformers_with_its_tokenizer_and_generates(trained, tmp_path):
    import importlib.util
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    convert = tool.main
    d, run, index, _ = trained
    out = tmp_path / "hf"
    assert convert(["export", "--weights", str(run / "checkpoints" / "step_2"), str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    eos = index["eos_id"]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == eos == model.config.eos_token_id
    assert model.generation_config.eos_token_id == eos and model.generation_config.pad_token_id == eos
    assert model.config.vocab_size == index["vocab_size"]
    prompt = tok("the quick brown fox", return_tensors="pt")
    torch.manual_seed(0)
    ids = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert ids.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tok.decode(ids[0], skip_special_tokens=True), str)


def test_a_config_error_of_every_rank_is_printed_once(tmp_path):
    proc = launch(2, tmp_path / "run", TINY + ["parallel.ep=3"])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "config error" in line]
    assert len(errors) == 1 and "parallel.ep (3)" in errors[0], proc.stderr


# ----------------------------------------------------------------------------- units

def _cfg(*sets) -> Config:
    return load_config(str(ROOT / "configs" / "moe_tiny.yaml"), list(sets), check_data=True)  # as the trainer loads it


def test_merge_keeps_the_saved_values_the_command_does_not_give(tmp_path):
    where = tmp_path / "config.yaml"
    saved = _cfg("train.weight_decay=0.2", "train.stop_at_step=5")  # keys moe_tiny.yaml does not set
    now = _cfg("parallel.ep=2", "train.max_steps=500")
    given = given_keys(str(ROOT / "configs" / "moe_tiny.yaml"), ["parallel.ep=2", "train.max_steps=500"])
    merged, changes = merge_for_resume(saved, now, given, where)
    # stop_at_step belongs to the job that set it: never carried over
    assert changes == {"parallel.ep": (1, 2), "train.max_steps": (300, 500), "train.stop_at_step": (5, None)}
    assert merged.train.weight_decay == 0.2 and merged.parallel.ep == 2 and merged.train.stop_at_step is None
    # train.lr is in moe_tiny.yaml, so the command gives it: it must match ...
    with pytest.raises(ConfigError, match=r"train.lr would change .* has 0.01, this command gives 0.003"):
        merge_for_resume(_cfg("train.lr=0.01"), now, given, where)
    # ... unless asked for
    now = _cfg("train.resume_allow=[train.global_batch_size]", "train.global_batch_size=64")
    given = given_keys(None, ["train.global_batch_size=64", "train.resume_allow=[train.global_batch_size]"])
    merged, changes = merge_for_resume(saved, now, given, where)
    assert merged.train.global_batch_size == 64 and merged.train.weight_decay == 0.2
    assert set(changes) == {"train.global_batch_size", "train.resume_allow", "train.stop_at_step"}
    assert resumable("parallel.pp", []) and resumable("metrics.peak_tflops", [])
    assert not resumable("model.hidden_size", []) and resumable("model.hidden_size", ["model"])
    assert not resumable("run.seed", []) and not resumable("train.dtype", [])


def test_vocab_auto_and_an_explicit_vocab_below_the_data(tmp_path):
    assert _cfg().model.vocab_size == 320  # the default corpus
    with pytest.raises(ConfigError, match="model.vocab_size is auto, but data.path .* has no index.json"):
        _cfg(f"data.path={tmp_path}")
    from moe_trainer.data import DataError, open_token_dir, prepare
    files = [tmp_path / f"doc{i}.txt" for i in range(20)]
    for i, f in enumerate(files):  # distinct documents: identical ones fall on one side of the split
        f.write_text(f"some text {i} " * 50)
    prepare([str(f) for f in files], str(tmp_path / "tok"), val_fraction=0.3)
    with pytest.raises(DataError, match=r"exceeds model.vocab_size \(256\); set model.vocab_size=auto"):
        open_token_dir(tmp_path / "tok", 256)
    with pytest.raises(ConfigError, match=r"model.vocab_size \(256\) is below the data's vocab_size \(320\); set "
                                          r"model.vocab_size=auto"):
        _cfg(f"data.path={tmp_path / 'tok'}", "model.vocab_size=256")
    assert _cfg(f"data.path={tmp_path / 'tok'}").model.vocab_size == 320


def test_the_measured_peak_is_cached_per_machine_and_dtype(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv("MOE_TRAINER_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(metrics, "measure_matmul_tflops", lambda dtype, device: calls.append(dtype) or 0.5)
    cpu = torch.device("cpu")
    first = metrics.device_peak_tflops(torch.float32, cpu)
    assert first[0] == 0.5 and "cached in" in first[1]
    assert metrics.device_peak_tflops(torch.float32, cpu) == first and calls == [torch.float32]
    metrics.device_peak_tflops(torch.bfloat16, cpu)
    assert calls == [torch.float32, torch.bfloat16]
    assert metrics.peak_tflops(2.0, torch.float32, cpu) == (2.0, "config metrics.peak_tflops")
    assert metrics.datasheet_tflops("NVIDIA H100 80GB HBM3", torch.bfloat16) == (989.0, "datasheet H100 bf16")
    assert metrics.datasheet_tflops("NVIDIA H200", torch.bfloat16)[0] == 989.0
    assert metrics.datasheet_tflops("NVIDIA H100 PCIe", torch.bfloat16)[0] == 756.0
    assert metrics.datasheet_tflops("NVIDIA A100-SXM4-80GB", torch.bfloat16)[0] == 312.0
    assert metrics.datasheet_tflops("NVIDIA A100-SXM4-80GB", torch.float32)[0] == 19.5
    assert metrics.datasheet_tflops("Some New GPU", torch.bfloat16) is None
