"""End to end through the real DeepSpeed launcher on 2 CPU ranks (gloo)."""
import json
import math

import pytest
import yaml
from safetensors.torch import load_file

from moe_trainer.checkpoint import read_full
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import TINY, check, launch, read_metrics, train_losses


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "run"
    proc = check(launch(2, out, TINY + ["train.max_steps=8", "train.eval_every=4", "train.log_every=2",
                                        "train.checkpoint_every=4", "train.keep_checkpoints=1"],
                        launcher="deepspeed-cli"))  # the README's command, runner included
    return out, proc


def test_run_directory_contents(run):
    out, proc = run
    assert "run directory:" in proc.stdout
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["train"]["max_steps"] == 8 and cfg["model"]["hidden_size"] == 64
    recs = read_metrics(out)
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == [2, 4, 6, 8]
    for r in recs:
        if "loss" in r:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_rank", "mfu", "step_time_s",
                        "expert.max_over_mean", "expert.cv", "noise_scale_tokens", "global_batch_tokens"):
                assert math.isfinite(r[key]), key
            assert r["tokens_per_s"] > 0 and r["expert.max_over_mean"] >= 1.0
            split = [r[f"time.{k}_s"] for k in ("data", "forward", "backward", "optimizer", "all_to_all")]
            assert all(v >= 0 for v in split) and r["time.forward_s"] > 0
            assert sum(split[:4]) <= r["step_time_s"] * 1.01
            # the split tools/plan.py --time predicts: compute and the exposed all-to-all make up forward + backward
            assert r["time.compute_s"] + r["time.exposed_all_to_all_s"] == pytest.approx(
                r["time.forward_s"] + r["time.backward_s"], rel=1e-6)
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(vals) == 2 and all(0 < v < 7 for v in vals)
    # checkpoints: only the newest kept, pointed at by latest, weights under global names
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert ckpts == ["step_8"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_8"
    weights = read_full(out / "checkpoints" / "step_8")
    assert "layers.1.mlp.experts.gate_up_proj" in weights and "layers.1.mlp.gate.e_score_correction_bias" in weights
    manifest = json.loads((out / "checkpoints" / "step_8" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"part-r00000.safetensors", "part-r00001.safetensors", "state.json"}
    # expert load: [moe_layers, n_routed_experts] per logged step
    counts = load_file(str(sorted((out / "expert_load").glob("*.safetensors"))[-1]))["counts"]
    assert tuple(counts.shape) == (2, 8)
    tokens_per_step = 8 * 32 * 2  # global batch * seq_len * top-k, per layer
    assert counts.sum(-1).tolist() == [2 * tokens_per_step] * 2  # two steps per logging interval


def test_tensorboard_events_read_back(run):
    out, _ = run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "expert/max_over_mean",
                "noise_scale_tokens", "time/forward_s", "memory_gb"):
        assert tag in tags, sorted(tags)
    losses = [e.value for e in acc.Scalars("loss")]
    assert len(losses) == 4 and all(math.isfinite(v) and 0 < v < 7 for v in losses)
    lrs = [e.value for e in acc.Scalars("lr")]
    assert all(0 < v <= 3e-3 + 1e-9 for v in lrs)
    assert acc.Tags()["histograms"], "expert-load histograms missing"


def test_torchrun_launch_works(tmp_path):
    out = tmp_path / "run"
    check(launch(2, out, TINY + ["train.max_steps=2"], launcher="torchrun"))
    assert sorted(train_losses(out)) == [1, 2]
