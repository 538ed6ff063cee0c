"""The dense Llama 3 layout (tensor + sequence, context, pipeline and data
parallel) through the real trainer against one rank: the same losses and gradient
norms before clipping for 5 steps and the same final weights (gathered into
layout-independent names)."""
import pytest
import torch

from moe_trainer.checkpoint import read_full

from conftest import (assert_same_final_weights, assert_same_steps, check, launch, train_grad_norms,
                      train_losses)

DENSE = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.intermediate_size=128", "train.seq_len=32",
         "train.micro_batch_size=2", "train.global_batch_size=8", "train.warmup_steps=2", "train.log_every=1",
         "train.eval_every=0", "train.max_steps=5", "train.checkpoint_every=5", "train.resume=none",
         "metrics.peak_tflops=1.0"]
CONFIG = "configs/llama3_tiny.yaml"

CASES = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_no_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=false"]),
    "cp2": (2, ["parallel.cp=2"]),
    "tp2_cp2": (4, ["parallel.tp=2", "parallel.cp=2"]),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "cp2_dp2": (4, ["parallel.cp=2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("dense") / "one"
    check(launch(1, out, DENSE, config=CONFIG, launcher="python"))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_layout_matches_one_rank(tmp_path, reference, case):
    world, layout = CASES[case]
    out = tmp_path / case
    check(launch(world, out, DENSE + layout, config=CONFIG))
    assert_same_steps(reference, out)
    assert_same_final_weights(reference, out)


def test_dense_exact_resume_with_tensor_parallel(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    steps = [o for o in DENSE if not o.startswith(("train.max_steps", "train.checkpoint_every"))]
    steps += ["train.max_steps=10", "train.checkpoint_every=5", "parallel.tp=2"]
    check(launch(2, straight, steps, config=CONFIG))
    check(launch(2, resumed, steps + ["train.stop_at_step=5"], config=CONFIG))
    check(launch(2, resumed, steps + ["train.resume=auto"], config=CONFIG))
    for read in (train_losses, train_grad_norms):
        a, b = read(straight), read(resumed)
        assert sorted(b) == list(range(1, 11))
        for s in a:
            assert abs(a[s] - b[s]) <= 1e-6 * abs(a[s]), (read.__name__, s, a[s], b[s])
    a = train_losses(straight)
    wa = read_full(straight / "checkpoints" / "step_10")
    wb = read_full(resumed / "checkpoints" / "step_10")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-7, msg=k)
    # resharding: the tp 2 checkpoint continues on one rank and on cp 2
    for world, layout in ((1, []), (2, ["parallel.cp=2"])):
        other = tmp_path / f"reshard{world}"
        base = [o for o in steps if o != "parallel.tp=2"]
        check(launch(world, other, base + layout + [f"train.resume={straight / 'checkpoints' / 'step_5'}"],
                     config=CONFIG, launcher="python" if world == 1 else "deepspeed"))
        c = train_losses(other)
        assert sorted(c) == list(range(6, 11))
        for s in c:
            assert abs(a[s] - c[s]) <= 1e-5 * abs(a[s]), (world, s, a[s], c[s])
