"""Inputs every rank reads later are checked before the process group, the model and the engine
(train.check_inputs): train.init_from's headers, key set and shapes (a truncated file is one
sentence in seconds, not after a minute of set-up), and its tokenizer against the data's (weights
trained with one tokenizer never go on training on another's tokens)."""
import json
import shutil
import subprocess
import sys
import time

import pytest
from safetensors.torch import save_file

from moe_trainer import train
from moe_trainer.resolve import load_config
from moe_trainer.data import DataError, prepare
from moe_trainer.data.tokenizer import byte_tokenizer_files
from moe_trainer.hf import HFFormatError
from moe_trainer.init_from import local_tensors
from moe_trainer.models.registry import build_model

from conftest import ROOT, TINY, toy_documents, train_tokenizer

CONFIG = str(ROOT / "configs" / "moe_tiny.yaml")


def start_of(out, overrides):
    args = train.parse_args(["--config", CONFIG] + [a for o in TINY + overrides + [f"run.out_dir={out}"]
                                                    for a in ("--set", o)])
    return train.plan_run(args, 0)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The tiny MoE's weights as a safetensors file of our names (what convert_hf.py import writes)."""
    d = tmp_path_factory.mktemp("weights")
    cfg = load_config(CONFIG, TINY)
    tensors = {n: t.detach().contiguous() for n, t in local_tensors(build_model(cfg.model, seed=0)).items()}
    save_file(tensors, str(d / "model.safetensors"))
    return d / "model.safetensors"


def one_sentence(e) -> str:
    text = str(e.value)
    assert "\n" not in text and text.endswith("."), text
    return text


def test_good_weights_pass_and_a_truncated_file_is_one_sentence(weights, tmp_path):
    train.check_inputs(start_of(tmp_path / "a", [f"train.init_from={weights}"]))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(HFFormatError) as e:
        train.check_inputs(start_of(tmp_path / "b", [f"train.init_from={cut}"]))
    assert str(cut) in one_sentence(e) and "not a readable safetensors file" in str(e.value)


def test_wrong_shapes_are_named_from_the_headers(weights, tmp_path):
    with pytest.raises(HFFormatError) as e:
        train.check_inputs(start_of(tmp_path / "a", [f"train.init_from={weights}", "model.moe_intermediate_size=48"]))
    assert "shape" in one_sentence(e)


def test_the_cli_refuses_a_truncated_file_before_its_set_up(weights, tmp_path):
    """The real entry point: exit 2 with the sentence, before the 'setting up' line (process group,
    model, engine), in the seconds a config check takes."""
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(weights.read_bytes()[:100])
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "moe_trainer.train", "--config", CONFIG]
                          + [a for o in TINY + [f"train.init_from={cut}", f"run.out_dir={tmp_path / 'run'}"]
                             for a in ("--set", o)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: train.init_from {cut}" in proc.stderr or f"{cut} is not a readable" in proc.stderr, proc.stderr
    assert "setting up" not in proc.stdout and time.monotonic() - t0 < 60


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A directory carrying a BPE tokenizer (as an export does), and a token directory prepared with it."""
    d = tmp_path_factory.mktemp("bpe")
    (d / "export").mkdir()
    tok = train_tokenizer(d / "export" / "tokenizer.json")
    docs = d / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in toy_documents(60)))
    prepare([str(docs)], str(d / "tokens"), str(tok), val_fraction=0.1)
    return d


def export_dir(bpe, weights, tmp_path, tokenizer_text=None):
    """A weights file in a directory with the export's tokenizer (or the given tokenizer.json text)."""
    d = tmp_path / "init"
    d.mkdir()
    shutil.copy(weights, d / "model.safetensors")
    if tokenizer_text is None:
        shutil.copy(bpe / "export" / "tokenizer.json", d / "tokenizer.json")
    else:
        (d / "tokenizer.json").write_text(tokenizer_text)
    return d


def test_init_from_with_its_tokenizer_and_no_data_says_how_to_prepare_data(bpe, weights, tmp_path):
    """The export's tokenizer and the default byte corpus: refused, and the sentence says how to make
    data with that tokenizer."""
    from moe_trainer.init_from import tokenizer_dir
    d = export_dir(bpe, weights, tmp_path)
    start = start_of(tmp_path / "run", [f"train.init_from={d / 'model.safetensors'}"])
    assert tokenizer_dir(d / "model.safetensors") is None  # a file carries no tokenizer; its directory does
    from moe_trainer.data.agreement import check_same_tokenizer
    with pytest.raises(DataError) as e:
        check_same_tokenizer(f"train.init_from {d}", d, start.cfg.data.path)
    text = one_sentence(e)
    assert "no data.path is named" in text and f"prepare_data.py OUT_DIR CORPUS --tokenizer {d}" in text
    from tokenizers import Tokenizer
    entries = Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert f"carries its own tokenizer (vocab {entries})" in text  # its EOS: in the model's vocabulary and added
    # the command it suggests runs: its arguments parse, and with a corpus and a directory filled in it
    # makes token files with that tokenizer, which the refused start then accepts
    import re
    import shlex
    suggested = re.search(r"\((python tools/prepare_data\.py [^,]+), then --set data\.path=OUT_DIR\)", text)
    argv = shlex.split(suggested[1])
    assert argv[:2] == ["python", "tools/prepare_data.py"]
    args = _prepare_data_tool().parser().parse_args(argv[2:])
    assert (args.out_dir, args.files, args.tokenizer) == ("OUT_DIR", ["CORPUS"], str(d))
    filled = [{"OUT_DIR": str(tmp_path / "tokens"), "CORPUS": str(bpe / "docs.jsonl")}.get(a, a) for a in argv[2:]]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_data.py"), *filled], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    check_same_tokenizer(f"train.init_from {d}", d, str(tmp_path / "tokens"))


def _prepare_data_tool():
    import importlib.util
    spec = importlib.util.spec_from_file_location("prepare_data_tool", ROOT / "tools" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_hugging_face_directory_is_held_to_the_datas_tokenizer(bpe, tmp_path):
    """A transformers-saved DeepSeek-V3 directory with a tokenizer.json beside it: the export's BPE
    tokenizer with no data is refused with the sentence, the same BPE data passes the tokenizer check,
    and the default corpus's own byte tokenizer passes with no data."""
    from test_init_from_config import save_hf, run_config
    from test_hf_interop import ds_config
    hf_dir, _ = save_hf(tmp_path, ds_config(vocab_size=320))
    shutil.copy(bpe / "export" / "tokenizer.json", hf_dir / "tokenizer.json")
    config = run_config(tmp_path, hf_dir)

    def start(out, overrides=()):
        return train.plan_run(train.parse_args(["--config", config, "--set", f"run.out_dir={tmp_path / out}"]
                                               + [a for o in overrides for a in ("--set", o)]), 0)

    with pytest.raises(DataError) as e:
        train.check_inputs(start("a"))
    assert "no data.path is named" in one_sentence(e) and f"--tokenizer {hf_dir}" in str(e.value)
    from moe_trainer.data.agreement import check_same_tokenizer
    check_same_tokenizer(f"train.init_from {hf_dir}", hf_dir, str(bpe / "tokens"))  # its own data
    (hf_dir / "tokenizer.json").write_text(byte_tokenizer_files()["tokenizer.json"])
    train.check_inputs(start("b"))
    with pytest.raises(DataError) as e:
        check_same_tokenizer(f"train.init_from {hf_dir}", hf_dir, str(bpe / "tokens"))
    assert f"is not the tokenizer of data.path {bpe / 'tokens'}" in one_sentence(e)


def test_a_resume_on_data_of_another_tokenizer_is_refused(bpe, tmp_path):
    """The run directory's tokenizer (copied at its first start) against the data it resumes on."""
    from moe_trainer.run_dir import Start
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(bpe / "export" / "tokenizer.json", out / "tokenizer.json")
    cfg = load_config(CONFIG, TINY + [f"run.out_dir={out}"])
    with pytest.raises(DataError) as e:
        train.check_inputs(Start(cfg, checkpoint=out / "checkpoints" / "step_2"))
    assert f"the run directory {out}" in one_sentence(e) and "resume on the data it trained on" in str(e.value)
    train.check_inputs(Start(cfg))  # a fresh start copies the data's tokenizer over it


def test_a_refused_start_leaves_no_run_directory_behind(bpe, tmp_path):
    """Under the launch wrapper (scripts/train.sh), a start the ranks refuse (a Hugging Face
    directory's own tokenizer and no data) made a run directory holding only the wrapper's
    deepspeed.log. Now the directories it made go again; one that existed keeps what it held."""
    from test_hf_interop import ds_config
    from test_init_from_config import run_config, save_hf

    from conftest import launch
    hf_dir, _ = save_hf(tmp_path, ds_config(vocab_size=320))
    shutil.copy(bpe / "export" / "tokenizer.json", hf_dir / "tokenizer.json")
    config = run_config(tmp_path, hf_dir)
    out = tmp_path / "runs" / "first"
    proc = launch(1, out, [], config=config, launcher="python", max_restarts=0, timeout=180)
    assert proc.returncode == 2 and "no data.path is named" in proc.stderr, proc.stderr[-2000:]
    assert "DeepSpeed INFO lines go to" in proc.stdout  # the wrapper planned the start and opened its log
    assert not (tmp_path / "runs").exists()
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    proc = launch(1, out, [], config=config, launcher="python", max_restarts=0, timeout=180)
    assert proc.returncode == 2 and [p.name for p in out.iterdir()] == ["notes.txt"]


def test_the_deepspeed_op_is_found_where_torch_builds_it(tmp_path, monkeypatch):
    """TORCH_EXTENSIONS_DIR/NAME/NAME.so (the check looked one directory deeper, so every start said
    it was building an op that was cached), else the per-user cache's py<version>_cpu/NAME."""
    name = "deepspeed_shm_comm"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "env"))
    assert not train.deepspeed_op_built()
    (tmp_path / "env" / "other" / name).mkdir(parents=True)
    (tmp_path / "env" / "other" / name / f"{name}.so").write_bytes(b"")
    assert not train.deepspeed_op_built()  # another build folder's copy is not this one's
    (tmp_path / "env" / name).mkdir()
    (tmp_path / "env" / name / f"{name}.so").write_bytes(b"")
    assert train.deepspeed_op_built()
    import torch.utils.cpp_extension as cpp
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(cpp, "get_default_build_root", lambda: str(tmp_path / "user"))
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert train.extension_dir(name) == tmp_path / "user" / f"{python}_cpu" / name
    # torch's own answer, where it makes the directory (in the temporary root)
    assert str(train.extension_dir(name)) == cpp._get_build_directory(name, verbose=False)


def test_deepspeeds_per_rank_line_reaches_the_console_once_per_node(capsys):
    """init_distributed's 'built successfully' (printed by every rank, cached or not) from a node's first
    rank only; every other line, whole, from every rank."""
    for first in (True, False):
        with train.printed_once_per_node(train.DEEPSPEED_OP_LINE, first):
            print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
            print("a line", "in parts")
            print("tail without newline", end="")
        print()
    assert capsys.readouterr().out.splitlines() == [
        "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", "a line in parts",
        "tail without newline", "a line in parts", "tail without newline"]


def test_the_banner_names_the_tokenizer_and_config_yaml_records_it(bpe, tmp_path):
    """A run on a token directory: the banner names its tokenizer and config.yaml records it (it said
    data.tokenizer: ''). The record is derived from data.path, not a choice: after the data moved (the
    recorded tokenizer is gone), a resume with the new data.path allowed reads that config.yaml and
    records the new directory's tokenizer; the run's config.yaml as a --config is the same command."""
    import os

    import yaml

    from conftest import check, launch
    data = shutil.copytree(bpe / "tokens", tmp_path / "data")
    out = tmp_path / "run"
    sets = TINY + [f"data.path={data}", "train.max_steps=1", "train.checkpoint_every=1", "train.resume=auto"]
    proc = check(launch(1, out, sets, launcher="python", timeout=240))
    assert f"tokenizer {data / 'tokenizer.json'}, vocab " in proc.stdout, proc.stdout
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["tokenizer"] == str(data / "tokenizer.json")
    moved = tmp_path / "moved"
    os.rename(data, moved)
    again = [f"data.path={moved}", "train.resume_allow=[data.path]", "train.max_steps=2", *sets[-2:]]
    proc = check(launch(1, out, TINY + again, launcher="python", timeout=240))
    assert "resumed from" in proc.stdout and f"tokenizer {moved / 'tokenizer.json'}, vocab " in proc.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())["data"]
    assert (saved["path"], saved["tokenizer"]) == (str(moved), str(moved / "tokenizer.json"))
    proc = check(launch(1, out, ["train.max_steps=3"], config=str(out / "config.yaml"), launcher="python",
                        timeout=240))
    assert "resumed from" in proc.stdout and "changed: train.max_steps: 2 -> 3" in proc.stdout, proc.stdout
