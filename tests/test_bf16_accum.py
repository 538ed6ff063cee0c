"""bf16 runs accumulate and reduce gradients in fp32 (DeepSpeed's BF16_Optimizer) by default.

1. One process, the real engine from parallel/zero.py: over 16 micro-batches the fp32-accumulated
   gradient equals the exact (fp64) sum of the micro-batches' bf16 gradients; the bf16-accumulated
   one (train.grad_accum_dtype=bf16, ZeRO-1 summing in param.grad) is far off it.
2. 2 gloo ranks in bf16 (dp 2; ep 2) follow the 1-rank fp32-accumulation run step by step, and an
   ep 2 run stopped at step 3 and resumed ends exactly as the uninterrupted one.
3. The ep 2 bf16 checkpoint loads on one rank, under either optimizer, holding the same state.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import (MOE_STEPS, TINY, assert_same_steps, check, launch, train_grad_norms, train_losses)
from test_checkpoint_reshard import assert_same_state, reshard

BF16 = TINY + MOE_STEPS + ["train.dtype=bf16"]
MICRO_BATCHES = 16


class Regression(nn.Module):
    """A 2-layer MLP whose forward returns its fp32 loss (DeepSpeed casts the weights to bf16)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))

    def forward(self, x, y):
        return (self.net(x).float() - y).square().mean()


def _engine(model: nn.Module, grad_accum_dtype: str):
    from moe_trainer.config import Config, Layout
    from moe_trainer.parallel.zero import build_engine
    cfg = Config()
    cfg.train.dtype, cfg.train.micro_batch_size = "bf16", 8
    if grad_accum_dtype:
        cfg.train.grad_accum_dtype = grad_accum_dtype
    layout = Layout(world=1, pp=1, tp=1, cp=1, dp=1, ep=1, edp=1, grad_accum=MICRO_BATCHES)
    from deepspeed.utils import groups  # an earlier test of this worker process may have left its mpu there,
    groups.mpu, groups._WORLD_GROUP = None, None  # whose groups died with that test's process group
    return build_engine(model, cfg, layout)


def _accumulated(engine, batches) -> tuple[list[torch.Tensor], torch.Tensor, object]:
    """(the summed gradient before the optimizer step, per parameter; the engine's norm after the
    step; the noise scale's reading of it) over one optimizer step of `batches`."""
    from deepspeed.utils import safe_get_full_grad
    from moe_trainer.noise_scale import ReducedGradNorm
    reduced = ReducedGradNorm(engine)
    for i, (x, y) in enumerate(batches):
        engine.backward(engine(x, y))
        if i == len(batches) - 1:  # the boundary backward: reduced, not yet stepped
            grads = [safe_get_full_grad(p).double().clone() for p in engine.module.parameters()]
        engine.step()
    return grads, float(engine.get_global_grad_norm()), reduced.take()


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    err = sum((g - w).square().sum() for g, w in zip(got, want))
    return float((err / sum(w.square().sum() for w in want)).sqrt())


@pytest.mark.timeout(300)
def test_fp32_accumulation_is_exact_where_bf16_accumulation_rounds(one_rank_env):
    import torch.distributed as dist
    from moe_trainer.parallel.zero import uses_bf16_optimizer
    torch.manual_seed(0)
    model = Regression()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g))
               for _ in range(MICRO_BATCHES)]
    # the reference: each micro-batch's gradient computed in bf16 as the engine does (of loss / 16:
    # a power of two, so exactly the engine's), summed in fp64
    lp = copy.deepcopy(model).bfloat16()
    per_micro = [torch.autograd.grad(lp(x, y) / MICRO_BATCHES, list(lp.parameters())) for x, y in batches]
    exact = [sum(gs[i].double() for gs in per_micro) for i in range(len(per_micro[0]))]
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        default = _engine(copy.deepcopy(model), None)
        assert uses_bf16_optimizer(default)  # the default path is fp32 accumulation
        fp32, fp32_norm, fp32_sq = _accumulated(default, batches)
        bf16_engine = _engine(copy.deepcopy(model), "bf16")
        assert not uses_bf16_optimizer(bf16_engine)
        bf16, _, _ = _accumulated(bf16_engine, batches)
    finally:
        dist.destroy_process_group()
    err32, err16 = _relative_error(fp32, exact), _relative_error(bf16, exact)
    assert err32 < 1e-6, err32  # fp32 sums of 16 bf16 values: rounding at 2**-24
    assert err16 > 1e-4 and err16 > 100 * err32, (err16, err32)  # bf16 rounds every partial sum at 2**-9
    exact_norm = float(sum(w.square().sum() for w in exact).sqrt())
    assert fp32_norm == pytest.approx(exact_norm, rel=1e-5)
    # the noise scale's global-batch norm on this path: the optimizer's norm (no MoE groups)
    assert fp32_sq is not None and float(fp32_sq) == pytest.approx(exact_norm ** 2, rel=1e-5)


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    """BF16 on one rank, fp32 accumulation (the default)."""
    out = tmp_path_factory.mktemp("bf16_reference") / "one"
    check(launch(1, out, BF16, launcher="python"))
    return out


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16_ep2") / "ep2"
    check(launch(2, out, BF16 + ["parallel.ep=2"]))
    return out


def assert_close_to_reference(ref, out) -> None:
    """bf16 layouts compute the same micro-batches in a different order (expert GEMMs over other
    groupings): the first step's gradient norm, from the same weights, agrees to 1e-3 (an expert
    gradient reduced over the wrong group moves it far more); later steps drift to ~5e-3 as
    the bf16 weights take different roundings."""
    assert_same_steps(ref, out, rel=2e-2)
    one, two = train_grad_norms(ref), train_grad_norms(out)
    assert abs(one[1] - two[1]) <= 1e-3 * one[1], (one[1], two[1])
    a, b = train_losses(ref), train_losses(out)
    assert all(abs(a[s] - b[s]) <= 1e-3 * a[s] for s in a), (a, b)


def test_two_data_parallel_ranks_in_bf16_follow_one_rank(tmp_path, bf16_reference):
    out = tmp_path / "dp2"
    check(launch(2, out, BF16))
    assert_close_to_reference(bf16_reference, out)


def test_expert_parallel_in_bf16_follows_one_rank_and_resumes_exactly(tmp_path, bf16_reference, ep2_run):
    assert_close_to_reference(bf16_reference, ep2_run)
    resumed = tmp_path / "resumed"
    check(launch(2, resumed, BF16 + ["parallel.ep=2", "train.stop_at_step=3"]))
    proc = check(launch(2, resumed, BF16 + ["parallel.ep=2", "train.resume=auto"]))
    assert "resumed from" in proc.stdout
    for read in (train_losses, train_grad_norms):
        a, b = read(ep2_run), read(resumed)
        assert sorted(b) == [1, 2, 3, 4, 5]
        assert all(a[s] == b[s] for s in a), (read.__name__, a, b)  # bit for bit: the whole state came back
    assert_same_state(ep2_run / "checkpoints" / "step_5", resumed / "checkpoints" / "step_5")


@pytest.mark.parametrize("accum", ["fp32", "bf16"])
def test_bf16_checkpoint_loads_on_one_rank_under_either_optimizer(tmp_path, ep2_run, accum):
    """ep 2 / world 2 (BF16_Optimizer) -> world 1 under BF16_Optimizer (fp32) or ZeRO-1 (bf16)."""
    src = ep2_run / "checkpoints" / "step_5"
    one = reshard(1, src, tmp_path / accum, TINY + ["train.dtype=bf16", f"train.grad_accum_dtype={accum}"])
    assert len(list(one.glob("part-r*.safetensors"))) == 1
    assert_same_state(src, one)
