"""train.init_from=HF_DIR gives the run its model section: the fields a config leaves out come
from the directory's config.json, the ones it writes must agree with it, and the run directory's
config.yaml records the model resolved so (resolve.resolve_init_from, hf.init_from_model)."""
import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml

from moe_trainer.config import ConfigError, ModelConfig, given_keys
from moe_trainer.resolve import load_config
from moe_trainer.data import open_data
from moe_trainer.hf import hf_config_to_model_config
from moe_trainer.init_from import load_initial_weights
from moe_trainer.models.registry import build_model
from moe_trainer.run_dir import parameter_counts, plan_start

from conftest import ROOT, check, launch, train_losses
from test_hf_interop import ds_config, edit_config, hf_model, ids, llama_config, logits, max_diff

# every key but the model section, small enough for one CPU step
TRAIN = {"seq_len": 32, "micro_batch_size": 2, "global_batch_size": 2, "max_steps": 1, "warmup_steps": 1,
         "log_every": 1, "eval_every": 0, "checkpoint_every": 0, "resume": "none"}


def save_hf(tmp_path, cfg):
    """A transformers model saved as a Hugging Face directory, and the model itself."""
    model = hf_model(cfg)
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model


def run_config(tmp_path, hf_dir, model: dict = None) -> str:
    """A config file starting from `hf_dir`, with the given model section (none by default)."""
    tree = {"train": {**TRAIN, "init_from": str(hf_dir)}, "metrics": {"peak_tflops": 1.0}}
    if model is not None:
        tree["model"] = model
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def directory_model(hf_dir) -> ModelConfig:
    return hf_config_to_model_config(json.loads((hf_dir / "config.json").read_text()))


@pytest.mark.parametrize("make", [ds_config, llama_config], ids=["deepseek_v3", "llama"])
def test_model_section_comes_from_the_directory(make, tmp_path):
    hf_dir, hf = save_hf(tmp_path, make())
    cfg = load_config(run_config(tmp_path, hf_dir), [], read_init_from=True)
    assert cfg.model == directory_model(hf_dir)
    assert (cfg.model.arch, cfg.model.hidden_size, cfg.model.vocab_size) == (
        {"deepseek_v3": "deepseek_v3", "llama": "llama3"}[hf.config.model_type], 32, 96)
    ours = build_model(cfg.model, seed=0)
    load_initial_weights(ours, hf_dir)
    x = ids(96)
    ref = logits(hf, x)
    assert ref.abs().max() > 1.0  # not a comparison of near-zero logits
    assert max_diff(logits(ours.eval(), x), ref) < 1e-4


def test_family_comes_from_architectures_without_model_type(tmp_path):
    hf_dir, _ = save_hf(tmp_path, llama_config())
    edit_config(hf_dir, lambda c: c.pop("model_type"))
    assert load_config(run_config(tmp_path, hf_dir), [], read_init_from=True).model.arch == "llama3"


def test_fields_that_agree_are_accepted_and_training_fields_are_the_commands(tmp_path):
    hf_dir, _ = save_hf(tmp_path, ds_config())
    expected = directory_model(hf_dir)
    whole = load_config(run_config(tmp_path, hf_dir, dataclasses.asdict(expected)), [], read_init_from=True)
    assert whole.model == expected  # a complete model section, as tools/convert_hf.py import writes it
    cfg = load_config(run_config(tmp_path, hf_dir, {"arch": "deepseek_v3", "vocab_size": "auto"}),
                      ["model.hidden_size=32", "model.bias_update_speed=0.05", "model.max_position_embeddings=64"],
                      read_init_from=True)
    assert cfg.model == dataclasses.replace(expected, bias_update_speed=0.05, max_position_embeddings=64)


def test_gqa_defaults_spelled_out_agree(tmp_path):
    hf_dir, _ = save_hf(tmp_path, llama_config(num_key_value_heads=4, head_dim=8))
    assert directory_model(hf_dir).num_key_value_heads is None  # config.json's 4 of 4 heads is the default
    cfg = load_config(run_config(tmp_path, hf_dir), ["model.num_key_value_heads=4", "model.head_dim=8"],
                      read_init_from=True)
    assert (cfg.model.num_key_value_heads, cfg.model.head_dim) == (4, 8)


@pytest.mark.parametrize("where", ["file", "set"])
def test_a_contradiction_is_one_sentence_naming_the_field(where, tmp_path):
    hf_dir, _ = save_hf(tmp_path, ds_config())
    in_file = {"hidden_size": 256} if where == "file" else None
    overrides = ["model.hidden_size=256"] if where == "set" else []
    with pytest.raises(ConfigError) as e:
        load_config(run_config(tmp_path, hf_dir, in_file), overrides, read_init_from=True)
    assert str(e.value) == (f"model.hidden_size is 256, but the config.json of train.init_from {hf_dir} gives 32; "
                            f"leave model.hidden_size unset to take the directory's value.")


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def test_rope_scaling_is_compared_in_its_standard_form(tmp_path):
    """A config may spell the directory's YaRN its own way (the legacy `type`, an integer factor, the
    default pre-scaling context left out); a different factor is a contradiction."""
    hf_dir, _ = save_hf(tmp_path, ds_config(rope_scaling=dict(YARN, original_max_position_embeddings=128)))
    spelled = {"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1}
    cfg = load_config(run_config(tmp_path, hf_dir, {"rope_scaling": spelled}), [], read_init_from=True)
    assert cfg.model.rope_scaling == spelled
    with pytest.raises(ConfigError, match=r"^model\.rope_scaling is .*'factor': 8.*, but the config\.json of "):
        load_config(run_config(tmp_path, hf_dir, {"rope_scaling": dict(spelled, factor=8)}), [], read_init_from=True)


def test_the_family_is_checked_first(tmp_path):
    hf_dir, _ = save_hf(tmp_path, llama_config())
    with pytest.raises(ConfigError, match=r"^model\.arch is 'deepseek_v3', but the config\.json of train\.init_from "):
        load_config(str(ROOT / "configs" / "moe_tiny.yaml"), [f"train.init_from={hf_dir}"], read_init_from=True)


BAD = {
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{not json"),
                             "{d}/config.json is not valid JSON"),
    "unsupported model_type": (lambda d: edit_config(d, lambda c: c.update(model_type="gpt2")),
                               "config.json field model_type is 'gpt2'; supported model types are deepseek_v3, llama"),
    "no config.json": (lambda d: (d / "config.json").unlink(),
                       "train.init_from {d} is a directory with neither config.json (a Hugging Face checkpoint) "
                       "nor manifest.json (a run checkpoint)."),
    "no directory": (lambda d: shutil.rmtree(d), "train.init_from {d} does not exist."),
    # badly typed values: one sentence naming the field, not a TypeError or ValueError
    "max_position_embeddings a string": (lambda d: edit_config(d, lambda c: c.update(max_position_embeddings="128")),
                                         "model.max_position_embeddings must be of type int, got '128'"),
    "num_nextn_predict_layers a string": (lambda d: edit_config(d, lambda c: c.update(num_nextn_predict_layers="1")),
                                          "model.num_nextn_predict_layers must be of type int, got '1'"),
    "rope_theta a string": (lambda d: edit_config(d, lambda c: c.update(rope_theta="x", rope_parameters=None)),
                            "config.json field rope_theta must be a number, got 'x'"),
    "yarn factor a string": (lambda d: edit_config(d, lambda c: c.update(rope_scaling=dict(YARN, factor="4"))),
                             "config.json field rope_scaling.factor must be a number, got '4'"),
}


def test_plan_tool_plans_the_directorys_model(tmp_path):
    hf_dir, _ = save_hf(tmp_path, ds_config())
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), "--config", run_config(tmp_path, hf_dir),
                          "--gpus", "1", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["params"]["total"]["total"] == parameter_counts(directory_model(hf_dir))[0]


@pytest.mark.parametrize("case", list(BAD))
def test_bad_directory_is_one_sentence(case, tmp_path):
    hf_dir, _ = save_hf(tmp_path, ds_config())
    spoil, sentence = BAD[case]
    spoil(hf_dir)
    with pytest.raises(ConfigError) as e:
        load_config(run_config(tmp_path, hf_dir), [], read_init_from=True)
    message = str(e.value)
    assert sentence.format(d=hf_dir) in message and message.startswith("train.init_from")
    assert message.count(". ") == 0 and message.endswith(".") and "\n" not in message


def test_cli_trains_the_directorys_model_and_saves_it_for_resume(tmp_path):
    """The real entry point, one process: no model section, one step. The first loss is transformers'
    on that batch, config.yaml holds the resolved model, and a resume plans with it without the directory."""
    hf_dir, hf = save_hf(tmp_path, ds_config(vocab_size=320))
    out = tmp_path / "run"
    check(launch(1, out, [], config=run_config(tmp_path, hf_dir), launcher="python"))
    expected = directory_model(hf_dir)
    saved = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert saved == dataclasses.asdict(expected)
    _, train, _ = open_data("", 32, 1234, 320)
    batch = train.micro_batch(0, 0, 2, 2, 0, 1)
    with torch.no_grad():
        want = F.cross_entropy(hf(batch[:, :-1]).logits.reshape(-1, 320), batch[:, 1:].reshape(-1)).item()
    assert abs(train_losses(out)[1] - want) < 1e-4 * want, (train_losses(out), want)

    shutil.rmtree(hf_dir)  # the resume needs only the run directory
    overrides = [f"run.out_dir={out}", "train.init_from=", "train.max_steps=2"]
    cfg = load_config(None, overrides, check_data=True, read_init_from=True)
    start = plan_start(cfg, given_keys(None, overrides), warn=False)
    assert start.checkpoint is not None and start.from_saved
    assert start.cfg.model == expected


def test_plan_run_reads_the_config_twice_only_to_resolve_init_from(tmp_path, monkeypatch):
    """A fresh start reads (and checks the data of) its config once; a start from a Hugging Face
    directory reads it again with the directory's model section."""
    from moe_trainer import train
    calls = []
    real = train.load_config
    monkeypatch.setattr(train, "load_config", lambda *a, **k: calls.append(k.get("read_init_from")) or real(*a, **k))
    plain = train.parse_args(["--config", str(ROOT / "configs" / "moe_tiny.yaml"), "--set", f"run.out_dir={tmp_path}/a"])
    assert train.plan_run(plain, 0).checkpoint is None and calls == [None]
    hf_dir, _ = save_hf(tmp_path, ds_config(vocab_size=320))  # the default corpus's byte vocabulary
    calls.clear()
    start = train.plan_run(train.parse_args(["--config", run_config(tmp_path, hf_dir),
                                             "--set", f"run.out_dir={tmp_path}/b"]), 0)
    assert start.cfg.model == directory_model(hf_dir) and calls == [None, True]
