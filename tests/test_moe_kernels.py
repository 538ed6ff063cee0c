"""The MoE layer's custom autograd Functions: gradcheck in float64 on small shapes and
equality with the plain-PyTorch computation they replace."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from moe_trainer.kernels.cpu import extension as cpu_kernels
from moe_trainer.models.layers import Linear
from moe_trainer.kernels.cpu import experts as ex
from moe_trainer.moe.dispatcher import CombineRows, GatherRows, inverse_permutation, route_order
from moe_trainer.moe.experts import Experts


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of >= 3 rows, so that a few experts span several blocks."""
    monkeypatch.setattr(ex.expert_blocks, "__defaults__", (3,))


def _expert_inputs(dtype, counts=(3, 0, 4, 2, 1, 0), d=4, hid=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, m = len(counts), sum(counts)
    x = torch.randn(m, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w1 = (torch.randn(e, 2 * hid, d, generator=g, dtype=torch.float64) / math.sqrt(d)).to(dtype).requires_grad_()
    w2 = (torch.randn(e, d, hid, generator=g, dtype=torch.float64) / math.sqrt(hid)).to(dtype).requires_grad_()
    gate = torch.rand(m, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return x, w1, w2, gate, list(counts)


@pytest.mark.parametrize("with_gate", [True, False])
def test_grouped_swiglu_experts_gradcheck(with_gate, small_blocks):
    x, w1, w2, gate, counts = _expert_inputs(torch.float64)
    gate = gate if with_gate else None
    def fn(x, w1, w2, *g):
        return ex.GroupedSwiGLUExperts.apply(x, w1, w2, g[0] if g else None, counts, False)
    assert gradcheck(fn, (x, w1, w2) + ((gate,) if with_gate else ()), eps=1e-6, atol=1e-5)


def _plain_experts(x, w1, w2, gate, counts):
    outs, s = [], 0
    for e, n in enumerate(counts):
        h = x[s:s + n] @ w1[e].t()
        g, u = h.chunk(2, -1)
        a = F.silu(g) * u
        if gate is not None:
            a = a * gate[s:s + n, None]
        outs.append(a @ w2[e].t())
        s += n
    return torch.cat(outs)


@pytest.mark.parametrize("grouped", [False, True], ids=["mm-loop", "grouped_mm"])
@pytest.mark.parametrize("block", [3, 2048])
def test_grouped_swiglu_experts_equals_plain(grouped, block, monkeypatch):
    if grouped and not ex.GROUPED_MM:
        pytest.skip("no torch._grouped_mm")
    monkeypatch.setattr(ex.expert_blocks, "__defaults__", (block,))
    x, w1, w2, gate, counts = _expert_inputs(torch.float32, counts=(5, 0, 7, 3, 4, 0), d=8, hid=8)
    grads = []
    for f in (lambda *a: ex.GroupedSwiGLUExperts.apply(*a, counts, grouped), lambda *a: _plain_experts(*a, counts)):
        for t in (x, w1, w2, gate):
            t.grad = None
        y = f(x, w1, w2, gate)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads.append([y.detach()] + [t.grad.clone() for t in (x, w1, w2, gate)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(grads[0][2][1], torch.zeros_like(grads[0][2][1]))  # empty experts: exact zeros
    assert torch.equal(grads[0][3][5], torch.zeros_like(grads[0][3][5]))


def _routing(n=7, k=3, e=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    topk_idx = torch.rand(n, e, generator=g).topk(k, -1).indices
    order, counts, _ = route_order(topk_idx, e, None)
    return topk_idx, order, counts


@pytest.mark.parametrize("with_inverse", [True, False])
def test_gather_rows_gradcheck_and_equals_indexing(with_inverse):
    topk_idx, order, _ = _routing()
    n, k = topk_idx.shape
    token_of = order // k
    inverse = inverse_permutation(order) if with_inverse else None
    x = torch.randn(n, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: GatherRows.apply(t, token_of, inverse, k), (x,))
    w = torch.rand(n * k, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: GatherRows.apply(t, order, inverse, 1), (w,))
    y = GatherRows.apply(x, token_of, inverse, k)
    y_ref = x[token_of]
    gy = torch.randn_like(y)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(torch.autograd.grad(y, x, gy)[0], torch.autograd.grad(y_ref, x, gy)[0])


@pytest.mark.parametrize("with_inverse", [True, False])
def test_combine_rows_gradcheck_and_equals_index_add(with_inverse):
    topk_idx, order, _ = _routing()
    n, k = topk_idx.shape
    token_of = order // k
    inverse = inverse_permutation(order) if with_inverse else None
    y = torch.randn(n * k, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda t: CombineRows.apply(t, token_of, inverse, n, k), (y,))
    out = CombineRows.apply(y, token_of, inverse, n, k)
    ref = y.new_zeros(n, 4).index_add(0, token_of, y)
    go = torch.randn_like(out)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out, y, go)[0], torch.autograd.grad(ref, y, go)[0])


def test_fp32_logits_router_gemm():
    """Router logits: fp32 forward whatever the dtype; the backward in the model's dtype equals
    autograd's F.linear(x.float(), w.float()) exactly in fp32 and to bf16 rounding in bf16."""
    from moe_trainer.moe.router import Fp32Logits
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 0.0), (torch.bfloat16, 2e-2)):
        x0, w0 = torch.randn(64, 32).to(dtype), (torch.randn(16, 32) * 0.1).to(dtype)
        g = torch.randn(64, 16)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        out = Fp32Logits.apply(x, w)
        out.backward(g)
        xr, wr = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        ref = F.linear(xr.float(), wr.float())
        ref.backward(g)
        assert out.dtype == torch.float32 and torch.equal(out, ref)
        assert x.grad.dtype == dtype and w.grad.dtype == dtype
        for a, b in ((x.grad, xr.grad), (w.grad, wr.grad)):
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            assert err <= tol, (dtype, err)


# ---------------------------------------------------------------- expert GEMMs on rows padded to a quantum

def _output_and_grads(run, leaves, dy):
    """(y, *dL/dleaves) for y = run() and the upstream gradient dy."""
    y = run()
    return (y, *torch.autograd.grad(y, leaves, dy))


def _record_mm(monkeypatch) -> list:
    """Records the rows of every torch.mm call (forward and backward) from here on: the output's,
    or for a weight gradient a^T b the rows it sums over."""
    shapes, mm = [], torch.mm

    def recording(a, b, **kw):
        shapes.append(a.shape[0] if a.is_contiguous() else a.shape[1])  # output rows, or a^T b's reduction rows
        return mm(a, b, **kw)

    monkeypatch.setattr(torch, "mm", recording)
    return shapes


@pytest.mark.parametrize("q", [4, 16])
@pytest.mark.parametrize("block", [3, 2048])
@pytest.mark.parametrize("with_gate", [True, False])
def test_padded_experts_equal_grouped(q, block, with_gate, monkeypatch):
    """Every GEMM of PaddedSwiGLUExperts has a multiple of q rows (or reduces over one), and the
    outputs and all gradients equal GroupedSwiGLUExperts' on the same inputs, including experts
    whose padding runs past the end of the caller's tensors and empty experts."""
    monkeypatch.setattr(ex.expert_blocks, "__defaults__", (block,))
    counts = (5, 0, 7, 3, 17, 0, 2)
    x, w1, w2, gate, counts = _expert_inputs(torch.float32, counts=counts, d=8, hid=8)
    gate = gate if with_gate else None
    leaves = [t for t in (x, w1, w2, gate) if t is not None]
    dy = torch.linspace(-1, 1, x.numel()).view_as(x)
    shapes = _record_mm(monkeypatch)
    results = [_output_and_grads(lambda: ex.PaddedSwiGLUExperts.apply(x, w1, w2, gate, counts, q), leaves, dy)]
    assert len(shapes) == 6 * sum(1 for c in counts if c) and all(r % q == 0 for r in shapes), shapes
    results.append(_output_and_grads(lambda: ex.GroupedSwiGLUExperts.apply(x, w1, w2, gate, counts, False),
                                     leaves, dy))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.equal(results[0][2][1], torch.zeros_like(w1[1]))  # an empty expert's gradients: zeros
    assert torch.equal(results[0][3][5], torch.zeros_like(w2[5]))


def test_padded_experts_gradcheck(small_blocks):
    x, w1, w2, gate, counts = _expert_inputs(torch.float64)
    def fn(x, w1, w2, g):
        return ex.PaddedSwiGLUExperts.apply(x, w1, w2, g, counts, 4)
    assert gradcheck(fn, (x, w1, w2, gate), eps=1e-6, atol=1e-5)


def _fast_and_loop_experts(dtype):
    """The same 5 experts as the module's fast path and as the loop reference, and rows for them."""
    counts = [37, 0, 80, 5, 33]
    fast, ref = Experts(5, 32, 24, impl="grouped"), Experts(5, 32, 24, impl="loop")
    for m in (fast, ref):
        torch.manual_seed(0)
        torch.nn.init.normal_(m.gate_up_proj, std=0.2)
        torch.nn.init.normal_(m.down_proj, std=0.2)
        m.to(dtype)
    return fast, ref, counts


def test_experts_pick_padded_rows_for_cpu_bf16(monkeypatch):
    """The module takes the padded path for CPU bf16 (oneDNN's per-shape kernels), with the same
    results as the loop reference; fp32 rows are not padded."""
    assert ex.row_quantum(torch.empty(1, dtype=torch.bfloat16)) == ex.EXPERT_ROW_QUANTUM
    assert ex.row_quantum(torch.empty(1)) == 1
    fast, ref, counts = _fast_and_loop_experts(torch.bfloat16)
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 32).to(torch.bfloat16)
    shapes = _record_mm(monkeypatch)
    y = fast(x, counts, None)
    assert len(shapes) == 8 and all(r % ex.EXPERT_ROW_QUANTUM == 0 for r in shapes)
    y_ref = ref(x, counts, None)
    assert (y.float() - y_ref.float()).norm() / y_ref.float().norm() < 1e-2


# ----------------------------------------------------------------------------- one thread per expert (CPU fp32)

@pytest.fixture
def threaded_ops():
    x = torch.empty(1, 1)
    ops = ex.threaded_cpu_ops(x)
    assert ops is not None, "the fused CPU kernels must build on this machine"
    return ops


@pytest.fixture(params=[True, False], ids=["onednn", "sgemm"])
def onednn(request, monkeypatch):
    """Both GEMM back ends of the fp32 CPU paths (cpu_kernels.onednn_linear_enabled), oneDNN for
    every GEMM size (these tests' GEMMs are far below ONEDNN_MIN_MACS)."""
    if request.param:
        assert cpu_kernels.onednn_linear_enabled(), "torch's oneDNN matmul must be there on this machine"
        monkeypatch.setattr(cpu_kernels, "ONEDNN_MIN_MACS", 0)
    monkeypatch.setattr(cpu_kernels, "onednn_linear_enabled", lambda: request.param)
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_gate", [True, False])
@pytest.mark.parametrize("counts", [(5, 0, 7, 3, 17, 0, 2), (1, 90, 2, 0, 3)], ids=["spread", "one-hot-expert"])
def test_threaded_experts_equal_grouped(threads, with_gate, counts, threaded_ops, onednn):
    """ThreadedCPUExperts' output and every gradient equal GroupedSwiGLUExperts' on the same inputs:
    empty experts (zero weight gradients), and an expert with most of the rows, which runs after the
    queue on all threads. With oneDNN its GEMMs run on rows padded to a multiple of 16: the padding
    reads the next expert's rows, or zeros past the last row (the last expert here)."""
    x, w1, w2, gate, counts = _expert_inputs(torch.float32, counts=counts, d=16, hid=8)
    gate = gate if with_gate else None
    leaves = [t for t in (x, w1, w2, gate) if t is not None]
    dy = torch.linspace(-1, 1, x.numel()).view_as(x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = [_output_and_grads(lambda: ex.ThreadedCPUExperts.apply(x, w1, w2, gate, counts, threaded_ops),
                                     leaves, dy),
                   _output_and_grads(lambda: ex.GroupedSwiGLUExperts.apply(x, w1, w2, gate, counts, False),
                                     leaves, dy)]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    empty = counts.index(0)
    assert torch.equal(results[0][2][empty], torch.zeros_like(w1[empty]))
    assert torch.equal(results[0][3][empty], torch.zeros_like(w2[empty]))


def test_threaded_experts_compute_only_the_gradients_asked_for(threaded_ops, onednn):
    """Frozen weights (or an input without grad): those gradients are None, the others still equal
    the reference's."""
    x, w1, w2, gate, counts = _expert_inputs(torch.float32, counts=(4, 6, 0, 3), d=16, hid=8)
    w1.requires_grad_(False)
    w2.requires_grad_(False)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    y = ex.ThreadedCPUExperts.apply(x, w1, w2, gate, counts, threaded_ops)
    y_ref = ex.GroupedSwiGLUExperts.apply(x, w1, w2, gate, counts, False)
    got, want = torch.autograd.grad(y, (x, gate), dy), torch.autograd.grad(y_ref, (x, gate), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_experts_pick_the_threaded_kernel_for_cpu_fp32(monkeypatch, threaded_ops):
    """The module runs CPU fp32 through ThreadedCPUExperts (and no torch.mm from Python), with the
    loop reference's results."""
    fast, ref, counts = _fast_and_loop_experts(torch.float32)
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 32, requires_grad=True)
    shapes = _record_mm(monkeypatch)
    y = fast(x, counts, None)
    assert shapes == [] and type(y.grad_fn).__name__.startswith("ThreadedCPUExperts")
    y_ref = ref(x, counts, None)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(y)
    g = torch.autograd.grad(y, (x, fast.gate_up_proj, fast.down_proj), dy)
    g_ref = torch.autograd.grad(y_ref, (x, ref.gate_up_proj, ref.down_proj), dy)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- projections (CPU fp32)

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_on_onednn_equals_f_linear(bias, threads, onednn):
    """models.layers.Linear in fp32 on a CPU: oneDNN's matmul for the output and the input gradient
    when it is on (OneDNNLinear), else F.linear; output and every gradient equal F.linear's on a
    (batch, seq, in) input, including a non-contiguous one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 7, generator=g).transpose(1, 2).requires_grad_()  # (3, 7, 40), not contiguous
    lin = Linear(40, 48, bias=bias)
    dy = torch.randn(3, 7, 48, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = lin(x)
        got = torch.autograd.grad(y, [x, *lin.parameters()], dy)
    finally:
        torch.set_num_threads(before)
    assert type(y.grad_fn).__name__.startswith("OneDNNLinear") == onednn
    y_ref = F.linear(x, lin.weight, lin.bias)
    want = torch.autograd.grad(y_ref, [x, *lin.parameters()], dy)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_linear_keeps_f_linear_off_the_fp32_cpu_path(onednn):
    """bf16 (oneDNN already, through torch.mm), a frozen layer's input-only gradient and an empty
    batch go through F.linear's autograd or give its results."""
    x = torch.randn(4, 16)
    y16 = Linear(16, 8, bias=False).to(torch.bfloat16)(x.to(torch.bfloat16))
    assert y16.grad_fn is not None and "OneDNN" not in type(y16.grad_fn).__name__
    lin = Linear(16, 8, bias=False).requires_grad_(False)
    xg = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(lin(xg).sum(), xg)
    torch.testing.assert_close(dx, lin.weight.sum(0).expand(4, 16), atol=1e-6, rtol=1e-5)
    assert lin(torch.empty(0, 16)).shape == (0, 8)


def test_small_gemms_stay_on_sgemm():
    """Below ONEDNN_MIN_MACS multiply-adds Linear is plain F.linear (oneDNN's per-call cost is more
    than it saves there); from it on, OneDNNLinear."""
    assert cpu_kernels.onednn_linear_enabled()
    d = 256
    lin = Linear(d, d, bias=False)
    rows = cpu_kernels.ONEDNN_MIN_MACS // (d * d)
    small, large = lin(torch.randn(rows - 1, d, requires_grad=True)), lin(torch.randn(rows, d, requires_grad=True))
    assert "OneDNN" not in type(small.grad_fn).__name__
    assert type(large.grad_fn).__name__.startswith("OneDNNLinear")


# ----------------------------------------------------------------------------- weight gradients held back

def _accelerator_experts(x, w1, w2, gate, counts):
    from moe_trainer.kernels.accelerator import GroupedExperts
    return GroupedExperts.apply(x, w1, w2, gate, torch.tensor(counts, dtype=torch.int64))


@pytest.mark.parametrize("path", ["threaded", "grouped", "padded", "accelerator"])
def test_held_back_weight_grads_are_the_plain_ones(path, small_blocks):
    """Inside wgrad.held_back() the experts' backward leaves the weights' gradients unset and queues
    them; made later (wgrad.weight_grads), they, the input and the gate gradients equal the plain
    backward's bit for bit, an empty expert's zeros included. Outside it, nothing is queued."""
    from moe_trainer.kernels import wgrad
    dtype = torch.bfloat16 if path == "padded" else torch.float32
    x, w1, w2, gate, counts = _expert_inputs(dtype, counts=(3, 0, 4, 2, 1, 0, 5), d=8, hid=8)
    run = {"threaded": lambda: ex.ThreadedCPUExperts.apply(x, w1, w2, gate, counts, ex.threaded_cpu_ops(x, w1, w2)),
           "grouped": lambda: ex.GroupedSwiGLUExperts.apply(x, w1, w2, gate, counts, False),
           "padded": lambda: ex.PaddedSwiGLUExperts.apply(x, w1, w2, gate, counts, 4),
           "accelerator": lambda: _accelerator_experts(x, w1, w2, gate, counts)}[path]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    run().backward(dy)
    plain = [t.grad.clone() for t in (x, w1, w2, gate)]
    for t in (x, w1, w2, gate):
        t.grad = None
    with wgrad.held_back() as queue:
        run().backward(dy)
    assert w1.grad is None and w2.grad is None and len(queue) == 1
    for got, want in zip((x.grad, gate.grad), (plain[0], plain[3])):
        assert torch.equal(got, want)
    made = wgrad.weight_grads(queue)
    assert [w for w, _ in made] == [w1, w2]
    for (_, got), want in zip(made, plain[1:3]):
        assert torch.equal(got, want)
    assert torch.equal(plain[1][1], torch.zeros_like(plain[1][1]))  # the empty expert
    with wgrad.held_back(False) as none:
        run().backward(dy)
    assert none is None and w1.grad is not None
