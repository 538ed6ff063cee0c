"""The fused CPU kernels against the torch-op paths they replace (the references) and float64.

SwiGLU: forward, backward and the gate gradient, fp32 and bf16, odd sizes, with and without a
gate, NaN propagation, and the routed experts end to end with the kernel on and off. Causal
softmax: forward and backward against a masked float64 softmax (offsets, strided blocks), and the
explicit CPU attention with it (blocked GEMMs) against its torch-op path and SDPA. RMSNorm: output
and both gradients against the torch-op path and float64."""
import math
import os
import subprocess
import sys

import pytest
import torch

from moe_trainer.kernels.cpu import extension as cpu_kernels
from moe_trainer.kernels.cpu import experts as ex


@pytest.fixture(scope="module")
def ops():
    ops = cpu_kernels.kernels()
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
    from moe_trainer.kernels.cpu.layers import SiluMul
    from moe_trainer.models.layers import SwiGLU
    gen = torch.Generator().manual_seed(2)
    g0, u0, w = (torch.randn(3, 37, 24, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    g, u = g0.to(dtype).requires_grad_(), u0.to(dtype).requires_grad_()
    out = SwiGLU(1, 1).act(g, u)  # a module built with the CPU back end
    assert out.grad_fn is not None and type(out.grad_fn).__name__.startswith(SiluMul.__name__)
    (out * w.to(dtype)).sum().backward()
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ref = torch.nn.functional.silu(g64) * u64
    (ref * w).sum().backward()
    assert _rel(out, ref) < tol and _rel(g.grad, g64.grad) < tol and _rel(u.grad, u64.grad) < tol


def test_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    """A kernel that does not compile: one warning, kernels() is None, the experts run on torch ops."""
    broken = tmp_path / "cpu_kernels.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    monkeypatch.setattr(cpu_kernels, "_CACHE", {})
    monkeypatch.setenv("MOE_TRAINER_KERNEL_DIR", str(tmp_path / "kernels"))
    with pytest.warns(UserWarning, match="could not be built"):
        assert cpu_kernels.kernels() is None
    assert cpu_kernels.kernels() is None  # cached: no second build, no second warning
    h, da, gate = _inputs(torch.float32, 5, 4)
    a = ex.swiglu_forward(h, gate)
    g64, u64 = h[:, :4].double(), h[:, 4:].double()
    assert _rel(a, torch.nn.functional.silu(g64) * u64 * gate.double()[:, None]) < 1e-6


def test_a_dead_builders_lock_file_does_not_block_the_next_process(tmp_path):
    """A builder killed mid-build (a rank the launcher tore down) leaves torch's lock file behind;
    the next process must still get through (here: to the failed build's fallback), not wait on
    it forever. Run in a subprocess with a timeout, so a regression fails instead of hanging."""
    broken = tmp_path / "cpu_kernels.cpp"
    broken.write_text("this is not C++\n")
    script = (
        "import warnings, pathlib; from moe_trainer.kernels.cpu import extension as c\n"
        f"c.SOURCE = pathlib.Path({str(broken)!r})\n"
        "d = c.build_dir(); d.mkdir(parents=True); (d / 'lock').touch()\n"
        "warnings.simplefilter('ignore')\n"
        "print(c.kernels() is None, (d / 'lock').exists())\n")
    env = dict(os.environ, MOE_TRAINER_KERNEL_DIR=str(tmp_path / "kernels"))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "False"]


# ----------------------------------------------------------------------------- causal softmax

def _masked_softmax64(s, scale, offset):
    """float64 truth: softmax of scale * s over keys j <= i + offset (row i of the block)."""
    t, w = s.shape[-2:]
    hidden = torch.arange(w)[None, :] > torch.arange(t)[:, None] + offset
    return torch.softmax((s.double() * scale).masked_fill(hidden, float("-inf")), dim=-1), hidden


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b, t, w, offset", [(1, 1, 1, 0), (3, 7, 7, 0), (2, 5, 13, 8), (4, 33, 100, 67),
                                             (2, 64, 200, 10)])
def test_causal_softmax_kernel_equals_masked_softmax(ops, dtype, tol, b, t, w, offset):
    """Forward and backward of the fused causal softmax against float64 autograd through a masked
    softmax: the hidden keys get exactly 0, in both directions."""
    gen = torch.Generator().manual_seed(t + w)
    s64 = (torch.randn(b, t, w, generator=gen, dtype=torch.float64) * 4).to(dtype).double().requires_grad_()
    dp = torch.randn(b, t, w, generator=gen, dtype=torch.float64).to(dtype)
    ref, hidden = _masked_softmax64(s64, 0.7, offset)
    (ref_grad,) = torch.autograd.grad(ref, s64, dp.double())
    p = ops.causal_softmax_forward_(s64.detach().to(dtype), 0.7, offset)
    assert p.dtype == dtype and _rel(p, ref) < tol
    assert (p[:, hidden] == 0).all()
    ds = ops.causal_softmax_backward_(dp.clone(), p, 0.7, offset)
    assert _rel(ds, ref_grad) < 2 * tol
    assert (ds[:, hidden] == 0).all()


def test_causal_softmax_kernel_on_a_strided_block(ops):
    """A query block of a larger buffer (strided rows): only the block's own elements change."""
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(3, 8, 20, generator=gen)
    before = full.clone()
    block = full[:, 2:6, :9]  # rows 2..5 of each batch, their first 9 keys
    ops.causal_softmax_forward_(block, 1.3, 2)
    ref, _ = _masked_softmax64(before[:, 2:6, :9], 1.3, 2)
    assert _rel(full[:, 2:6, :9], ref) < 2e-6
    outside = torch.ones_like(full, dtype=torch.bool)
    outside[:, 2:6, :9] = False
    assert torch.equal(full[outside], before[outside])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 37, 300, 600])
def test_fused_causal_attention_equals_torch_ops(ops, monkeypatch, dtype, t):
    """ExplicitCausalAttention with the fused kernels against its torch-op path and float64 SDPA:
    outputs and the three gradients. fp32 runs the whole-attention kernel (one task per batch x
    head, on 1 and on 2 threads); then, as bf16 does, the fused softmax with blocked GEMMs that
    skip the hidden tiles (from 129 rows in fp32 / 257 in bf16)."""
    from moe_trainer.kernels.cpu import layers
    calls, whole_calls = [], []
    real = ops.causal_softmax_forward_
    monkeypatch.setattr(ops, "causal_softmax_forward_", lambda *a: calls.append(a[0].shape) or real(*a))
    gen = torch.Generator().manual_seed(t)
    q64, k64 = (torch.randn(2, 3, t, 24, generator=gen, dtype=torch.float64) for _ in range(2))
    v64, w64 = (torch.randn(2, 3, t, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    qkv = [x.requires_grad_() for x in (q64.clone(), k64.clone(), v64.clone())]
    truth = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True, scale=0.25)
    truth = [truth, *torch.autograd.grad(truth, qkv, w64)]

    def run():
        qkv = [x.to(dtype).requires_grad_() for x in (q64, k64, v64)]
        out = layers.ExplicitCausalAttention.apply(*qkv, 0.25)
        return [out, *torch.autograd.grad(out, qkv, w64.to(dtype))]

    results = []
    if dtype == torch.float32:
        real_whole = ops.causal_attention_forward
        monkeypatch.setattr(ops, "causal_attention_forward",
                            lambda *a: whole_calls.append(a[0].shape) or real_whole(*a))
        before = torch.get_num_threads()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                results.append(run())
            finally:
                torch.set_num_threads(before)
        assert whole_calls == [(6, t, 24)] * 2 and calls == []
        monkeypatch.setattr(layers, "fused_attention_ops", lambda q: None)  # the blocked path next
    fused = run()
    blocks = layers.causal_blocks(t, layers.CAUSAL_BLOCK_ROWS[dtype])
    assert calls == [(6, r1 - r0, r1) for r0, r1 in blocks]  # the fused softmax ran, block by block
    _reference(monkeypatch)
    torch_ops = run()
    for path in results + [fused]:
        for a, b, ref in zip(path, torch_ops, truth):
            if dtype == torch.float32:
                assert _rel(a, ref) < 1e-5
            else:  # within bf16 rounding, and about as close to the truth as the torch ops
                assert _rel(a, ref) < 2e-2 and _rel(a, ref) < 1.5 * _rel(b, ref) + 2e-3


def test_causal_softmax_kernel_nan_stays_in_its_row(ops):
    for dtype in (torch.float32, torch.bfloat16):
        s = torch.randn(2, 6, 6).to(dtype)
        s[1, 3, 2] = float("nan")
        p = ops.causal_softmax_forward_(s, 1.0, 0)
        assert torch.isnan(p[1, 3, :4]).all() and torch.isfinite(p[1, [0, 1, 2, 4, 5]]).all()
        assert torch.isfinite(p[0]).all()


# ----------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 5), (3, 7), (2, 33, 96), (4, 64, 512)])
def test_fused_rms_norm_equals_torch_ops(ops, monkeypatch, dtype, shape):
    """RMSNorm on CPU (the fused kernel) against its torch-op path and float64 autograd: output, dx, dw."""
    from moe_trainer.models.layers import RMSNorm
    gen = torch.Generator().manual_seed(shape[-1])
    x64 = torch.randn(*shape, generator=gen, dtype=torch.float64) * 3
    w64 = torch.randn(shape[-1], generator=gen, dtype=torch.float64) * 0.5 + 1
    g64 = torch.randn(*shape, generator=gen, dtype=torch.float64)

    def run():
        norm = RMSNorm(shape[-1], eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(w64)
        x = x64.to(dtype).requires_grad_()
        y = norm(x)
        y.backward(g64.to(dtype))
        return y, [y.detach(), x.grad, norm.weight.grad]

    y, fused = run()
    assert type(y.grad_fn).__name__.startswith("FusedRMSNorm")
    _reference(monkeypatch)
    y_ref, torch_ops = run()
    assert not type(y_ref.grad_fn).__name__.startswith("FusedRMSNorm")
    x, w = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    truth = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    truth.backward(g64)
    for a, b, ref in zip(fused, torch_ops, [truth.detach(), x.grad, w.grad]):
        assert a.dtype == dtype
        if dtype == torch.float32:
            assert _rel(a, ref) < 2e-6
        else:  # the same two roundings as the torch ops (normalised row, then the gain)
            assert _rel(a, b) < 1e-2 and _rel(a, ref) < 1.5 * _rel(b, ref) + 2e-3


def test_rms_norm_other_weight_dtype_uses_torch_ops(ops):
    from moe_trainer.models.layers import RMSNorm
    norm = RMSNorm(8)  # fp32 weight
    y = norm(torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True))
    assert y.dtype == torch.float32 and not type(y.grad_fn).__name__.startswith("FusedRMSNorm")


def test_fused_rms_norm_nan_stays_in_its_row(ops):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 16).to(dtype)
        x[2, 5] = float("nan")
        y, rstd = ops.rms_norm_forward(x, torch.ones(16, dtype=dtype), 1e-6)
        assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3]]).all()


# ----------------------------------------------------------------------------- routing bookkeeping

@pytest.mark.parametrize("n, e, k", [(1, 1, 1), (5, 8, 8), (300, 64, 6), (1000, 256, 8), (37, 16, 4)])
def test_topk_rows_equals_torch_topk(ops, n, e, k):
    """The same index set as torch.topk per row (random scores have no ties), largest first."""
    gen = torch.Generator().manual_seed(n + e)
    x = torch.randn(n, e, generator=gen)
    x[:, ::3] = x[:, ::3].masked_fill(torch.rand(n, (e + 2) // 3, generator=gen) < 0.3, float("-inf"))
    idx = ops.topk_rows(x, k)
    ref = x.topk(k, dim=-1).indices
    assert idx.dtype == torch.int64 and idx.shape == (n, k)
    assert torch.equal(idx.sort(1).values, ref.sort(1).values)
    vals = x.gather(1, idx)
    assert (vals[:, :-1] >= vals[:, 1:]).all()


def test_topk_rows_ties_and_nan(ops):
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, float("nan"), 5.0, float("-inf"), 5.0]])
    assert ops.topk_rows(x, 2).tolist() == [[1, 2], [1, 2]]  # ties to the lower index; NaN ranks first
    assert ops.topk_rows(x, 5)[1].tolist() == [1, 2, 4, 0, 3]


def test_router_uses_the_kernel_and_matches_torch_topk(ops, monkeypatch):
    from moe_trainer.moe import router as rt
    r = rt.Router(32, 16, 4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                  scoring_func="sigmoid")
    torch.nn.init.normal_(r.weight, 0, 0.3)
    r.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 16))
    x = torch.randn(200, 32)
    fused = r(x)
    monkeypatch.setattr(cpu_kernels, "ops_on_cpu", lambda *t: None)
    ref = r(x)
    order_f, order_r = fused.topk_idx.argsort(1), ref.topk_idx.argsort(1)
    assert torch.equal(fused.topk_idx.gather(1, order_f), ref.topk_idx.gather(1, order_r))
    torch.testing.assert_close(fused.topk_weight.gather(1, order_f), ref.topk_weight.gather(1, order_r))


@pytest.mark.parametrize("m, n_keys", [(0, 4), (1, 1), (24576, 64), (1000, 3), (500, 1000)])
def test_counting_sort_equals_stable_argsort(ops, monkeypatch, m, n_keys):
    from moe_trainer.moe.dispatcher import sort_by_key
    keys = torch.randint(0, n_keys, (m,), generator=torch.Generator().manual_seed(m))
    order, counts = sort_by_key(keys, n_keys)
    assert torch.equal(order, torch.argsort(keys, stable=True))
    assert torch.equal(counts, torch.bincount(keys, minlength=n_keys))
    with pytest.raises(RuntimeError, match="outside"):
        ops.counting_sort(torch.tensor([0, n_keys]), n_keys)
