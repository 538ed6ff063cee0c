"""Continuing a Hugging Face checkpoint: train.init_from loads transformers'
weights, and the first training loss is transformers' own loss on that batch."""
import json

import torch
import torch.nn.functional as F
import yaml
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from moe_trainer.data import open_data
from moe_trainer.hf import hf_config_to_model_config

from conftest import TINY, check, launch, train_losses


def _hf_model(tmp_path):
    cfg = DeepseekV3Config(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                           n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                           q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                           max_position_embeddings=256, tie_word_embeddings=False, routed_scaling_factor=1.0)
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "hf")
    return model


def test_first_loss_equals_transformers_loss(tmp_path):
    hf = _hf_model(tmp_path)
    ours = hf_config_to_model_config(hf.config.to_dict())
    model_section = {k: v for k, v in ours.__dict__.items()}
    config = tmp_path / "continue.yaml"
    config.write_text(yaml.safe_dump({"model": model_section, "train": {
        "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "log_every": 1,
        "eval_every": 0, "checkpoint_every": 0, "resume": "none", "init_from": str(tmp_path / "hf")}}))
    check(launch(2, tmp_path / "run", [], config=str(config)))
    _, train, _ = open_data("", 32, 1234, 320)
    batch = torch.cat([train.micro_batch(0, m, 4, 2, 0, 1) for m in range(2)])
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    expected = float(torch.stack([F.cross_entropy(logits[i:i + 2].reshape(-1, 320), batch[i:i + 2, 1:].reshape(-1))
                                  for i in (0, 2)]).mean())
    got = train_losses(tmp_path / "run")[1]
    assert abs(got - expected) < 1e-4 * expected, (got, expected)


def test_init_from_contradicting_the_config_is_one_sentence(tmp_path):
    """configs/moe_tiny.yaml writes hidden_size 256; the directory's config.json says 64: one sentence
    before anything is built or written."""
    _hf_model(tmp_path)
    proc = launch(1, tmp_path / "run", ["train.max_steps=1", f"train.init_from={tmp_path / 'hf'}"],
                  launcher="python")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"config error: model.hidden_size is 256, but the config.json of train.init_from {tmp_path / 'hf'} gives 64; "
        f"leave model.hidden_size unset to take the directory's value.")
    assert not (tmp_path / "run").exists()


def _weights_file(tmp_path):
    """A safetensors file of our names for the tiny model of TINY, initialised from another seed."""
    from safetensors.torch import save_file

    from moe_trainer.checkpoint import BIAS
    from moe_trainer.resolve import load_config
    from moe_trainer.models.registry import build_model

    model = build_model(load_config("configs/moe_tiny.yaml", TINY).model, seed=7)
    tensors = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if n.endswith(BIAS)}
    path = tmp_path / "weights.safetensors"
    save_file({n: t.detach().contiguous() for n, t in tensors.items()}, str(path))
    return path


def test_a_resume_does_not_read_init_from_again(tmp_path):
    """train.init_from is read by the start that resumes nothing (train.resume=auto in an empty
    directory), never by a resume: the same command, re-run after the weights file is deleted,
    resumes its checkpoint and continues the loss curve of an uninterrupted run."""
    weights = _weights_file(tmp_path)
    command = TINY + ["train.max_steps=4", "train.checkpoint_every=2", "train.resume=auto",
                      f"train.init_from={weights}"]
    straight = check(launch(1, tmp_path / "straight", command, launcher="python"))
    assert f"start: weights from {weights}" in straight.stdout
    check(launch(1, tmp_path / "run", command + ["train.stop_at_step=2"], launcher="python"))
    weights.unlink()
    resumed = check(launch(1, tmp_path / "run", command, launcher="python"))
    assert "resumed from" in resumed.stdout and "step_2" in resumed.stdout
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "run")
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6 * abs(a[step]), (step, a[step], b[step])


def test_auto_resume_past_every_damaged_checkpoint_loads_init_from(tmp_path):
    """The run's only checkpoint fails its checksum (found by the ranks, after plan_start picked it
    by its manifest and sizes): train.resume=auto falls back to train.init_from, and the first loss
    is again that of the weights file."""
    weights = _weights_file(tmp_path)
    command = TINY + ["train.max_steps=1", "train.resume=auto", f"train.init_from={weights}"]
    check(launch(1, tmp_path / "run", command, launcher="python"))
    first = train_losses(tmp_path / "run")[1]
    part = tmp_path / "run" / "checkpoints" / "step_1" / "part-r00000.safetensors"
    data = bytearray(part.read_bytes())
    data[-10] ^= 0xFF
    part.write_bytes(bytes(data))
    again = check(launch(1, tmp_path / "run", command, launcher="python"))
    assert "skipping checkpoint" in again.stderr and f"start: weights from {weights}" in again.stdout
    assert "resumed from" not in again.stdout
    assert abs(train_losses(tmp_path / "run")[1] - first) <= 1e-6 * abs(first)
    history = [json.loads(line) for line in (tmp_path / "run" / "config_history.jsonl").read_text().splitlines()]
    assert [h["resumed_from"] for h in history] == [None, None]  # the refused pick is not recorded as resumed
