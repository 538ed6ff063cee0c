"""The fused CPU SwiGLU kernel against the torch-op path it replaces (the reference): forward,
backward and the gate gradient, fp32 and bf16, odd sizes, with and without a gate, NaN
propagation, and the routed experts end to end with the kernel on and off."""
import math

import pytest
import torch

from moe_trainer import cpu_kernels
from moe_trainer.moe import experts as ex


@pytest.fixture(scope="module")
def ops():
    ops = cpu_kernels.swiglu_ops()
    assert ops is not None, "the fused kernel must build on this machine (g++ and ninja are test requirements)"
    return ops


def _reference(monkeypatch):
    """Run experts.swiglu_* (and every other kernel user) through torch ops only."""
    monkeypatch.setattr(cpu_kernels, "ops_for", lambda *tensors: None)


def _inputs(dtype, rows, hid, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, 2 * hid, generator=g, dtype=torch.float64) * 3).to(dtype)
    da = torch.randn(rows, hid, generator=g, dtype=torch.float64).to(dtype)
    gate = torch.rand(rows, generator=g, dtype=torch.float64).float()
    return h, da, gate


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, hid", [(1, 1), (7, 13), (300, 256), (129, 72)])
@pytest.mark.parametrize("with_gate", [True, False])
def test_fused_swiglu_equals_torch_ops(ops, monkeypatch, dtype, tol, rows, hid, with_gate):
    h, da, gate = _inputs(dtype, rows, hid)
    gate = gate if with_gate else None
    a = ex.swiglu_forward(h, gate)
    dh, dgate = ex.swiglu_backward(da.clone(), h, gate, True)
    # float64 truth for the fused kernel's fp32 arithmetic
    g64, u64, d64 = h[:, :hid].double(), h[:, hid:].double(), da.double()
    s64 = torch.sigmoid(g64)
    gt = gate.double()[:, None] if gate is not None else 1.0
    assert _rel(a, g64 * s64 * u64 * gt) < tol
    assert _rel(dh[:, hid:], d64 * gt * g64 * s64) < tol
    assert _rel(dh[:, :hid], d64 * gt * u64 * s64 * (1 + g64 * (1 - s64))) < tol
    if gate is not None:
        assert dgate.dtype == gate.dtype
        assert _rel(dgate, (d64 * g64 * s64 * u64).sum(1)) < (tol if dtype == torch.float32 else 1e-5)
    else:
        assert dgate is None
    # and the torch-op path agrees to its own rounding
    _reference(monkeypatch)
    a_ref = ex.swiglu_forward(h, gate)
    dh_ref, dgate_ref = ex.swiglu_backward(da.clone(), h, gate, True)
    assert _rel(a, a_ref) < 2 * tol and _rel(dh, dh_ref) < 2 * tol
    if gate is not None:
        assert _rel(dgate, dgate_ref) < 2 * tol


def test_fused_swiglu_extremes_and_nan(ops):
    """Large |g| saturates like torch's silu; a NaN in h gives NaN where it lands, finite elsewhere."""
    h = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    a = ops.swiglu_forward(h, None)
    torch.testing.assert_close(a, torch.nn.functional.silu(h[:, :5]), rtol=1e-6, atol=1e-30)
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(4, 16).to(dtype)
        h[1, 3] = float("nan")
        a = ops.swiglu_forward(h.contiguous(), None)
        dh = ops.swiglu_backward(torch.ones(4, 8, dtype=dtype), h.contiguous(), None, False)[0]
        assert torch.isnan(a[1, 3]) and torch.isfinite(a[0]).all() and torch.isfinite(a[2:]).all()
        assert torch.isnan(dh[1, 3]) and torch.isfinite(dh[0]).all()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_grouped_experts_with_fused_kernel_equal_torch_ops(ops, monkeypatch, dtype, tol):
    counts = [40, 0, 17, 64, 3]
    g = torch.Generator().manual_seed(1)
    m, d, hid = sum(counts), 32, 24
    base = [torch.randn(m, d, generator=g), torch.randn(5, 2 * hid, d, generator=g) / math.sqrt(d),
            torch.randn(5, d, hid, generator=g) / math.sqrt(hid), torch.rand(m, generator=g)]
    results = []
    for fused in (True, False):
        if not fused:
            _reference(monkeypatch)
        x, w1, w2, gate = [t.to(dtype if i < 3 else torch.float32).requires_grad_() for i, t in enumerate(base)]
        y = ex.GroupedSwiGLUExperts.apply(x, w1, w2, gate, counts, False)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append([y, x.grad, w1.grad, w2.grad, gate.grad])
    for a, b in zip(*results):
        assert _rel(a, b) < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_dense_silu_mul_equals_autograd(ops, dtype, tol):
    """SwiGLU.act on CPU (the fused SiluMul) against autograd's F.silu(g) * u in float64."""
    from moe_trainer.models.layers import SiluMul, SwiGLU
    gen = torch.Generator().manual_seed(2)
    g0, u0, w = (torch.randn(3, 37, 24, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    g, u = g0.to(dtype).requires_grad_(), u0.to(dtype).requires_grad_()
    out = SwiGLU.act(g, u)
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith(SiluMul.__name__)
    (out * w.to(dtype)).sum().backward()
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ref = torch.nn.functional.silu(g64) * u64
    (ref * w).sum().backward()
    assert _rel(out, ref) < tol and _rel(g.grad, g64.grad) < tol and _rel(u.grad, u64.grad) < tol


def test_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    """A kernel that does not compile: one warning, swiglu_ops() is None, the experts run on torch ops."""
    broken = tmp_path / "swiglu_cpu.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    monkeypatch.setattr(cpu_kernels, "_CACHE", {})
    monkeypatch.setenv("MOE_TRAINER_KERNEL_DIR", str(tmp_path / "kernels"))
    with pytest.warns(UserWarning, match="could not be built"):
        assert cpu_kernels.swiglu_ops() is None
    assert cpu_kernels.swiglu_ops() is None  # cached: no second build, no second warning
    h, da, gate = _inputs(torch.float32, 5, 4)
    a = ex.swiglu_forward(h, gate)
    g64, u64 = h[:, :4].double(), h[:, 4:].double()
    assert _rel(a, torch.nn.functional.silu(g64) * u64 * gate.double()[:, None]) < 1e-6
