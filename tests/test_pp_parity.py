"""Pipeline parallelism (our 1F1B executor around the DeepSpeed ZeRO-1 engine)
against one rank: the same losses and gradient norms before clipping for 5 steps,
and the same final weights."""
import pytest

from conftest import TINY, assert_same_final_weights, assert_same_steps, check, launch

STEPS = ["train.max_steps=5", "train.checkpoint_every=5", "train.global_batch_size=8",
         "train.micro_batch_size=2"]
FOUR_LAYERS = ["model.num_hidden_layers=4", "model.first_k_dense_replace=2"]
MTP = ["model.num_nextn_predict_layers=1", "model.seq_aux_loss_alpha=0.001"]

CASES = {
    "pp2": (2, ["parallel.pp=2"], []),
    "pp2_mtp": (2, ["parallel.pp=2"], MTP),
    "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2"], []),
    # stages 0 and 1 hold only dense layers (no MoE state there)
    "pp4_dense_stages": (4, ["parallel.pp=4", "parallel.pp_partition=[1, 1, 1, 1]"], FOUR_LAYERS),
    # DeepSeek-V3's 3D layout in small: pipeline x data parallel with EP inside each stage's dp ranks
    "pp2_dp4_ep2": (8, ["parallel.pp=2", "parallel.ep=2"], []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_matches_one_rank(tmp_path, case):
    world, layout, model = CASES[case]
    ref = tmp_path / "one"
    check(launch(1, ref, TINY + STEPS + model, launcher="python"))
    out = tmp_path / case
    check(launch(world, out, TINY + STEPS + model + layout))
    assert_same_steps(ref, out)
    assert_same_final_weights(ref, out)
    if "pp4" in case:  # every rank wrote its own part of the checkpoint
        assert len(list((out / "checkpoints" / "step_5").glob("part-r*.safetensors"))) == 4
