"""The gradient-noise-scale estimator on synthetic gradients with known noise,
and the hook helpers against manual computations."""
import math

import pytest
import torch
from torch import nn

from moe_trainer.noise_scale import (MicroGradNorms, NoiseScale, ReducedGradNorm, counted_params,
                                     unbiased_estimates)


def _synthetic_step(gen, G, sigma, b_small, n_small):
    """n_small independent batch-mean gradients over b_small samples each (per-sample
    g_i = G + N(0, diag(sigma^2))), and the big batch = their mean (b_big = n_small * b_small)."""
    d = G.numel()
    noise = torch.randn(n_small, b_small, d, generator=gen, dtype=torch.float64) * sigma
    small = G + noise.mean(1)  # (n_small, d)
    big = small.mean(0)
    return small.square().sum(1).mean().item(), big.square().sum().item()


@pytest.mark.parametrize("b_small,n_small,noise_ratio", [(4, 8, 0.5), (16, 4, 5.0), (2, 2, 10.0)])
def test_noise_scale_converges_to_trace_sigma_over_g2(b_small, n_small, noise_ratio):
    gen = torch.Generator().manual_seed(0)
    d = 256
    G = torch.randn(d, generator=gen, dtype=torch.float64) * 0.1
    g2 = G.square().sum().item()
    # per-coordinate std chosen so that tr(Sigma) / |G|^2 = noise_ratio * b_big
    b_big = b_small * n_small
    trace = noise_ratio * b_big * g2
    sigma = torch.rand(d, generator=gen, dtype=torch.float64) + 0.5
    sigma = sigma * math.sqrt(trace / sigma.square().sum().item())
    ns = NoiseScale(alpha=0.002)
    for _ in range(4000):
        small_sq, big_sq = _synthetic_step(gen, G, sigma, b_small, n_small)
        ns.update(small_sq, big_sq, b_small, b_big)
    expected = trace / g2
    assert ns.value == pytest.approx(expected, rel=0.10)
    assert ns.grad_sq == pytest.approx(g2, rel=0.10)
    assert ns.trace_sigma == pytest.approx(trace, rel=0.10)


def test_unbiased_estimates_exact_in_expectation():
    # E|G_B|^2 = |G|^2 + tr(Sigma)/B: plug exact expectations in, get exact values back
    g2, trace = 3.0, 600.0
    small, big = g2 + trace / 8, g2 + trace / 64
    est_g2, est_s = unbiased_estimates(small, big, 8, 64)
    assert est_g2 == pytest.approx(g2) and est_s == pytest.approx(trace)
    with pytest.raises(ValueError):
        unbiased_estimates(small, big, 64, 64)


def test_noise_scale_ema_and_edge_cases():
    ns = NoiseScale(alpha=0.5)
    assert math.isnan(ns.value)
    # constant measurements: the bias-corrected averages equal them from the first step
    small, big = 3.0 + 600.0 / 8, 3.0 + 600.0 / 64
    for _ in range(3):
        ns.update(small, big, 8, 64)
        assert ns.value == pytest.approx(200.0) and ns.grad_sq == pytest.approx(3.0)
    ns.update(float("nan"), big, 8, 64)  # ignored
    assert ns.steps == 3 and ns.value == pytest.approx(200.0)
    restored = NoiseScale()
    restored.load_state_dict(ns.state_dict())
    assert restored.value == ns.value and restored.alpha == 0.5


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3, bias=False)
        self.expert = nn.Parameter(torch.randn(3, 3))
        self.expert.allreduce = False  # expert-parallel: excluded
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x):
        return (self.b(torch.tanh(self.a(x))) @ self.expert).square().mean()


def test_micro_grad_norms_match_manual_per_micro_batch_gradients():
    torch.manual_seed(0)
    m = Tiny()
    gas = 4
    hooks = MicroGradNorms(m, unscale=gas)
    assert {id(p) for p in hooks.params} == {id(m.a.weight), id(m.a.bias), id(m.b.weight)}
    xs = [torch.randn(7, 6) for _ in range(gas)]
    # training-loop style: loss / gas, gradients accumulate into .grad
    for x in xs:
        (m(x) / gas).backward()
    got = hooks.take(gas)
    # manual: each micro-batch's own (unscaled) gradient, its squared norm, the mean
    manual = []
    for x in xs:
        grads = torch.autograd.grad(m(x), [m.a.weight, m.a.bias, m.b.weight])
        manual.append(sum(g.square().sum() for g in grads).item())
    assert got.item() == pytest.approx(sum(manual) / gas, rel=1e-5)
    # the accumulated .grad is untouched by the hooks: it is the mean of the micro gradients
    acc = torch.autograd.grad(sum(m(x) for x in xs) / gas, [m.a.weight])[0]
    torch.testing.assert_close(m.a.weight.grad, acc)
    hooks.take(gas)  # the reference autograd.grad calls above fired the hooks too: drop them
    assert hooks.take(gas).item() == 0.0  # take() resets
    hooks.remove()
    m(xs[0]).backward()
    assert hooks.take(1).item() == 0.0


def test_counted_params_tensor_parallel_rule():
    m = Tiny()
    m.b.weight.tensor_model_parallel = True  # a tp shard: every tp rank counts its part
    assert {id(p) for p in counted_params(m, count_replicated=False)} == {id(m.b.weight)}
    assert len(counted_params(m, count_replicated=True)) == 3


@pytest.mark.timeout(300)
def test_reduced_grad_norm_reads_deepspeeds_global_batch_norm(one_rank_env):
    """One rank, ZeRO-1, 2 micro-batches: the recorded norm is the norm of the mean
    gradient over both micro-batches, and the micro norms come out unscaled."""
    deepspeed = pytest.importorskip("deepspeed")
    import torch.distributed as dist
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ref = [p.detach().clone() for p in model.parameters()]
    xs = [torch.randn(4, 8) for _ in range(2)]
    # reference: the per-micro and mean gradients before any step
    per_micro = [torch.autograd.grad(model(x).square().mean(), list(model.parameters())) for x in xs]
    mean_grad = [(a + b) / 2 for a, b in zip(*per_micro)]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8,
           "zero_optimization": {"stage": 1}, "gradient_clipping": 1e9, "steps_per_print": 1 << 30,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
        micro = MicroGradNorms(engine.module, unscale=engine.gradient_accumulation_steps())
        reduced = ReducedGradNorm(engine)
        for x in xs:
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
        small_sq, big_sq = micro.take(2).item(), reduced.take()
        assert big_sq is not None
        expect_big = sum(g.square().sum() for g in mean_grad).item()
        expect_small = sum(sum(g.square().sum() for g in gs).item() for gs in per_micro) / 2
        assert big_sq.item() == pytest.approx(expect_big, rel=1e-4)
        assert small_sq == pytest.approx(expect_small, rel=1e-4)
        assert math.sqrt(big_sq.item()) == pytest.approx(float(engine.get_global_grad_norm()), rel=1e-4)
        assert not torch.equal(ref[0], next(engine.module.parameters()).detach())  # a step happened
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 2e-4), (torch.float32, 1e-5)])
@pytest.mark.parametrize("numel", [1000, 16 * 4096 + 17, 3 * 2 ** 20 + 5, 2 ** 23 + 3])
def test_squared_norm_matches_float64(dtype, rel, numel):
    """The row-wise fast path (and the small-tensor path) against an exact float64 sum of squares."""
    from moe_trainer.noise_scale import squared_norm
    t = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 0.01).to(dtype)
    exact = t.double().square().sum().item()
    got = squared_norm(t)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() - exact) / exact < rel


class _Mesh:
    """The mesh's answers the meter asks for, with stand-in model-parallel and data-parallel groups (so
    that each of its all-reduces is made, and counted)."""
    groups = {"mp": "mp", "dpcp": "dpcp"}

    def group(self, kind):
        return self.groups.get(kind)

    def index(self, kind):
        return 0

    def size(self, kind):
        return 1


def _hooks(params) -> int:
    return sum(len(p._backward_hooks or {}) for p in params)


@pytest.mark.timeout(300)
def test_noise_scale_meter_measures_the_logged_steps_alone_and_nothing_when_off(one_rank_env, monkeypatch):
    """metrics.noise_scale: measuring on steps 2 and 3 of 3 (every 2 and the last) gives the estimate the
    always-hooked reference gives from those steps; the other steps have no hooks and no collective; off,
    the meter registers no hook, wraps no optimizer method and makes no collective."""
    deepspeed = pytest.importorskip("deepspeed")
    import torch.distributed as dist
    from moe_trainer.noise_scale import NoiseScaleMeter
    from moe_trainer.parallel import comm
    from deepspeed.utils import groups as ds_groups
    calls = []
    monkeypatch.setattr(comm, "all_reduce_small", lambda t, group=None, op="sum": calls.append(group) or t)
    # DeepSpeed keeps its clone of the world group across process groups: an earlier test's, destroyed
    monkeypatch.setattr(ds_groups, "_WORLD_GROUP", None)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8,
           "zero_optimization": {"stage": 1}, "gradient_clipping": 1e9, "steps_per_print": 1 << 30,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        engines = {}
        for mode in ("meter", "reference", "off"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            engines[mode], *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                                     config=cfg)
        on = NoiseScaleMeter(engines["meter"], _Mesh(), 2, 4.0, 8.0, alpha=0.5, every=2, last=3)
        off = NoiseScaleMeter(engines["off"], _Mesh(), 2, 4.0, 8.0, alpha=0.5, enabled=False, every=2, last=3)
        assert on.micro is not None and off.micro is None and off.reduced is None
        assert not {"get_grad_norm_direct", "get_grads_for_norm"} & set(engines["off"].optimizer.__dict__)
        ref_micro = MicroGradNorms(engines["reference"].module, unscale=2)
        ref_reduced, ref_noise = ReducedGradNorm(engines["reference"]), NoiseScale(alpha=0.5)
        params = {mode: list(e.module.parameters()) for mode, e in engines.items()}
        hooked, collectives = [], []
        for step in (1, 2, 3):
            on.begin(step)
            off.begin(step)
            hooked.append((_hooks(params["meter"]), _hooks(params["off"])))
            for e in engines.values():
                for x in xs[2 * step - 2:2 * step]:
                    e.backward(e(x).square().mean())
                    e.step()
            before = len(calls)
            on.end(False, torch.device("cpu"))
            off.end(False, torch.device("cpu"))
            collectives.append(len(calls) - before)
            small, big = ref_micro.take(2), ref_reduced.take()
            if step in (2, 3):
                ref_noise.update(float(small), float(big), 4.0, 8.0)
        assert hooked == [(0, 0), (4, 0), (4, 0)]  # 4 parameters, hooked on the measured steps only
        assert collectives == [0, 2, 2]  # the model-parallel and data-parallel sums, on those steps
        assert _hooks(params["meter"]) == 0 and on.noise.steps == 2 and off.noise.steps == 0
        assert on.noise.value == pytest.approx(ref_noise.value, rel=1e-6)
        assert on.noise.grad_sq == pytest.approx(ref_noise.grad_sq, rel=1e-6)
    finally:
        dist.destroy_process_group()


def test_the_trainer_logs_the_noise_scale_on_its_log_steps_and_none_when_off(tmp_path):
    """metrics.noise_scale (on by default) measures the logged steps: each log record has the estimate;
    off, none has it."""
    from conftest import TINY, check, launch, read_metrics
    base = TINY + ["train.max_steps=4", "train.log_every=2"]
    for on in (True, False):
        out = tmp_path / str(on)
        check(launch(1, out, base + [f"metrics.noise_scale={str(on).lower()}"], launcher="python"))
        logged = [r for r in read_metrics(out) if "loss" in r]
        assert [r["step"] for r in logged] == [2, 4]
        assert all(("noise_scale_tokens" in r) == on for r in logged), logged
