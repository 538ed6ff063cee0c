"""Expert parallelism through the real trainer and DeepSpeed engine: the same
losses for 5 steps as one rank, and experts synchronised only within their
expert-data-parallel group."""
import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY, check, launch, train_losses

STEPS = ["train.max_steps=5", "train.checkpoint_every=5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "one"
    check(launch(1, out, TINY + STEPS, launcher="python"))
    return out


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_matches_one_rank(tmp_path, reference, world, ep):
    out = tmp_path / f"w{world}ep{ep}"
    proc = check(launch(world, out, TINY + STEPS + [f"parallel.ep={ep}"]))
    one, many = train_losses(reference), train_losses(out)
    assert sorted(many) == [1, 2, 3, 4, 5]
    for s in one:
        assert abs(one[s] - many[s]) / abs(one[s]) < 1e-4, (s, one[s], many[s])
    # final weights (gathered from every EP rank under global expert ids) equal the 1-rank run's
    a = load_file(str(reference / "checkpoints" / "step_5" / "model-pp0.safetensors"))
    b = load_file(str(out / "checkpoints" / "step_5" / "model-pp0.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    assert "Traceback" not in proc.stderr
