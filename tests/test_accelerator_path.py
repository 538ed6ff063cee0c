"""The accelerator path (what GPUs run), forced on CPU with the kernel selector, against the
reference: the routed experts, whole models (DeepSeek-V3 with MTP, Llama with GQA) in fp32 and
bf16; a count of the operations that make a GPU wait for the host (none with ep = 1, one copy
of the split sizes per MoE layer and micro-batch with ep = 2, plain and deduplicated dispatch);
and the number of GEMM calls, which must not grow with the number of experts."""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_trainer import kernels
from moe_trainer.resolve import load_config
from moe_trainer.kernels.accelerator import group_ends  # also registers torch.ops.moe_trainer
from moe_trainer.models.registry import build_model, moe_layers
from moe_trainer.moe.experts import Experts
from moe_trainer.moe.layer import MoE

from conftest import ROOT, TINY, spawn_ranks

aten = torch.ops.aten

# ops whose result size or value the host must read from the device (a GPU drains its queue first)
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.bincount.default,
            aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten._unique.default}


class SyncCounter(TorchDispatchMode):
    """Counts host syncs: the ops above, repeat_interleave without output_size, indexing with a
    boolean mask, and Tensor.tolist / .cpu / .numpy (which dispatch nothing on a CPU tensor)."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            self.syncs.append(str(func))
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.syncs.append("repeat_interleave without output_size")
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or [])):
            self.syncs.append(f"{func} with a boolean mask")
        return func(*args, **kwargs)

    @contextmanager
    def counting(self):
        names = ("tolist", "cpu", "numpy")
        originals = {n: getattr(torch.Tensor, n) for n in names}

        def wrap(name):
            def counted(t, *a, **k):
                self.syncs.append(f"Tensor.{name}")
                return originals[name](t, *a, **k)
            return counted
        for n in names:
            setattr(torch.Tensor, n, wrap(n))
        try:
            with self:
                yield self
        finally:
            for n, f in originals.items():
                setattr(torch.Tensor, n, f)


class GemmCounter(TorchDispatchMode):
    GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
             aten._grouped_mm.default, aten.matmul.default, aten.linear.default,
             torch.ops.moe_trainer.grouped_mm.default}  # fp32's grouped GEMM (kernels/accelerator.py)

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.GEMMS
        return func(*args, **(kwargs or {}))


def tiny(*extra):
    return load_config(str(ROOT / "configs/moe_tiny.yaml"), TINY + list(extra))


def test_group_ends_are_the_unpadded_running_counts():
    ends = group_ends(torch.tensor([3, 0, 17, 1]))
    assert ends.tolist() == [3, 3, 20, 21] and ends.dtype == torch.int32


def _experts_grads(backend: str, dtype, counts, with_gate: bool):
    g = torch.Generator().manual_seed(0)
    n, d, h = len(counts), 32, 16
    with kernels.using(backend):
        m = Experts(n, d, h)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(n, 2 * h, d, generator=g) / d ** 0.5)
        m.down_proj.copy_(torch.randn(n, d, h, generator=g) / h ** 0.5)
    m.to(dtype)
    x = torch.randn(sum(counts), d, generator=g).to(dtype).requires_grad_()
    gate = torch.rand(sum(counts), generator=g).requires_grad_() if with_gate else None
    y = m(x, torch.tensor(counts), gate)
    y.float().mul(torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    out = [y.float(), x.grad.float(), m.gate_up_proj.grad.float(), m.down_proj.grad.float()]
    return out + ([gate.grad] if with_gate else [])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_gate", [True, False])
@pytest.mark.parametrize("counts", [(5, 0, 17, 1, 33), (0, 0, 40), (1,)], ids=["spread", "empty-first", "one"])
def test_grouped_experts_equal_reference(dtype, tol, with_gate, counts):
    got, want = _experts_grads("accelerator", dtype, counts, with_gate), _experts_grads("reference", dtype, counts,
                                                                                        with_gate)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=tol * max(1.0, b.abs().max().item()), rtol=tol)
    if counts[0] == 0:  # an expert without rows gets exactly zero weight gradients
        assert torch.equal(got[2][0], torch.zeros_like(got[2][0]))


def _model_losses_and_grads(backend: str, cfg, dtype):
    with kernels.using(backend):
        model = build_model(cfg.model, seed=3).to(dtype)
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(1))
    out = model(ids[:, :-1], ids[:, 1:])
    out.loss.backward()
    return out.loss.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "llama3"])
def test_model_on_accelerator_path_equals_reference(arch, dtype, tol):
    extra = ["model.num_nextn_predict_layers=1", "model.n_shared_experts=1"] if arch == "deepseek_v3" else []
    cfg = tiny(*extra) if arch == "deepseek_v3" else load_config(
        str(ROOT / "configs/llama3_tiny.yaml"), ["model.num_key_value_heads=2", "model.num_attention_heads=4"])
    loss, grads = _model_losses_and_grads("accelerator", cfg, dtype)
    ref_loss, ref_grads = _model_losses_and_grads("reference", cfg, dtype)
    assert abs(loss - ref_loss) <= tol * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        ref = ref_grads[name]
        assert (g - ref).norm() <= tol * max(ref.norm(), 1e-6) + 1e-7, name


def test_whole_model_forward_backward_has_no_host_sync_with_ep1():
    cfg = tiny("model.num_nextn_predict_layers=1", "model.n_shared_experts=1", "model.seq_aux_loss_alpha=0.001")
    with kernels.using("accelerator"):
        model = build_model(cfg.model, seed=3)
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1))
    with SyncCounter().counting() as counter:
        out = model(ids[:, :-1], ids[:, 1:])
        out.loss.backward()
    assert counter.syncs == []
    assert len(moe_layers(model)) == 3  # two MoE layers and the MTP block's


@pytest.mark.parametrize("backend, grows", [("accelerator", False), ("reference", True)])
def test_gemm_calls_do_not_grow_with_experts(backend, grows):
    """Forward + backward of one MoE layer with 4 and with 32 experts (every expert gets tokens):
    the accelerator path issues the same number of GEMMs; the loop reference (the control) more."""
    calls = []
    for e in (4, 32):
        torch.manual_seed(0)
        with kernels.using(backend):
            layer = MoE(32, e, 2, 16, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
                        routed_scaling_factor=1.0)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.2)
        x = torch.randn(4, 64, 32, requires_grad=True)
        with GemmCounter() as counter:
            out, _ = layer(x)
            out.sum().backward()
        assert layer.tokens_per_expert.min() > 0
        calls.append(counter.calls)
    assert (calls[1] > calls[0]) == grows, calls


def _ep_sync_worker(rank, world, port, dedup, results):
    import torch.distributed as dist

    from moe_trainer.parallel.expert import AllToAllDispatcher, shard_experts
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = tiny("model.num_nextn_predict_layers=1", "model.n_shared_experts=1")
    ids = torch.randint(0, cfg.model.vocab_size, (2 * world, cfg.train.seq_len + 1),
                        generator=torch.Generator().manual_seed(5))
    with kernels.using("reference"):
        ref = build_model(cfg.model, seed=3)
    ref_out = ref(ids[:, :-1], ids[:, 1:])
    ref_out.loss.backward()
    with kernels.using("accelerator"):
        model = build_model(cfg.model, seed=3)
        layers = [m for _, m in moe_layers(model)]
        for layer in layers:
            shard_experts(layer, rank, world)
            layer.dispatcher = AllToAllDispatcher(layer.n_experts, world, dist.group.WORLD, dedup=dedup)
    mine = ids[2 * rank:2 * rank + 2]
    with SyncCounter().counting() as counter:
        out = model(mine[:, :-1], mine[:, 1:])
        out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    # an expert's gradient sums every rank's per-rank mean loss: world x the whole batch's mean
    n_local = cfg.model.n_routed_experts // world
    grads_ok = all(torch.allclose(getattr(m.experts, w).grad,
                                  world * getattr(r.experts, w).grad[rank * n_local:(rank + 1) * n_local],
                                  rtol=1e-4, atol=1e-6)
                   for (_, r), m in zip(moe_layers(ref), layers) for w in ("gate_up_proj", "down_proj"))
    results[rank] = {"syncs": counter.syncs, "moe_layers": len(layers), "loss": loss.item() / world,
                     "ref_loss": ref_out.loss.item(), "grads_ok": grads_ok}
    dist.barrier()  # both ranks done before either tears gloo down (as test_ep_weights / test_shm_alltoall)
    dist.destroy_process_group()


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_expert_parallel_forward_backward_syncs_once_per_moe_layer(dedup):
    """ep = 2 over gloo (the device-generic collectives): one copy of the split sizes per MoE layer
    (forward; backward reuses them), and the same loss and expert gradients as one rank."""
    res = spawn_ranks(_ep_sync_worker, 2, dedup)
    for r in res.values():
        assert r["syncs"] == ["Tensor.tolist"] * r["moe_layers"], r["syncs"]
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5 * abs(r["ref_loss"])
        assert r["grads_ok"]


def test_kernel_selector():
    assert kernels.resolve("auto", "cpu") == "cpu" and kernels.resolve("auto", "cuda") == "accelerator"
    assert kernels.resolve("reference", "cuda") == "reference"
    with pytest.raises(kernels.KernelConfigError, match="MOE_TRAINER_KERNELS='fast' is not a kernel back end"):
        kernels.resolve("fast", "cpu")
    with kernels.using("accelerator"):
        assert Experts(2, 16, 8).kernels.name == "accelerator"


def _pieces_grads(backend: str, dtype, piece: str):
    """Output and input gradients of one accelerator piece on fixed inputs, by back end."""
    g = torch.Generator().manual_seed(0)
    be = kernels._make(backend)
    if piece.startswith("rope"):
        x = torch.randn(2, 3, 8, 16, generator=g)
        freqs = torch.randn(8, 8, generator=g)
        emb = torch.cat([freqs, freqs], dim=-1)
        ins = [x.to(dtype).requires_grad_()]
        fn = lambda x: be.rope(x, emb.cos().to(dtype), emb.sin().to(dtype), piece == "rope-interleaved")  # noqa: E731
    elif piece == "silu_mul":
        ins = [torch.randn(24, 16, generator=g).to(dtype).requires_grad_() for _ in range(2)]
        fn = be.silu_mul
    elif piece == "rms_norm":
        ins = [torch.randn(24, 16, generator=g).to(dtype).requires_grad_(),
               (1 + 0.1 * torch.randn(16, generator=g)).to(dtype).requires_grad_()]
        fn = lambda x, w: be.rms_norm(x, w, 1e-6)  # noqa: E731
    else:  # MLA's shapes: value head narrower than the query/key head
        ins = [torch.randn(2, 3, 8, d, generator=g).to(dtype).requires_grad_() for d in (24, 24, 16)]
        fn = lambda q, k, v: be.causal_attention(q, k, v, 0.2)  # noqa: E731
    y = fn(*ins)
    y.float().mul(torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.float()] + [t.grad.float() for t in ins]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("piece", ["rope", "rope-interleaved", "silu_mul", "rms_norm", "mla_attention"])
def test_accelerator_pieces_equal_reference(piece, dtype, tol):
    """Rotary, SiluMul, the one-op RMSNorm and SDPA with MLA's unpadded value head, outputs and
    gradients, against the plain ops of the reference (and the CPU back end's, which keeps them)."""
    want = _pieces_grads("reference", dtype, piece)
    for backend in ("accelerator", "cpu"):
        for a, b in zip(_pieces_grads(backend, dtype, piece), want):
            torch.testing.assert_close(a, b, atol=tol * max(1.0, b.abs().max().item()), rtol=tol)


class ShapeTrace(SyncCounter):
    """SyncCounter that also records each op with its output shapes, to compare runs."""

    def __init__(self):
        super().__init__()
        self.trace: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        shapes = [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                  if isinstance(t, torch.Tensor)]
        self.trace.append((str(func), shapes))
        return out


def test_decoder_layer_is_cuda_graph_ready_at_ep1():
    """What CUDA graph capture needs of a MoE decoder layer's forward + backward at ep 1: no op
    that waits for the host, and every shape fixed by the input's: two batches routed very
    differently (all tokens on the same experts vs spread) run the same ops on the same shapes."""
    cfg = tiny("model.n_shared_experts=1")
    with kernels.using("accelerator"):
        model = build_model(cfg.model, seed=3)
    layer = next(m for m in model.layers.values() if m.is_moe)
    t = cfg.train.seq_len
    cos, sin = model.rope(t, torch.device("cpu"), torch.float32)
    traces, loads = [], []
    for skew in (0.0, 50.0):
        with torch.no_grad():  # a large bias on experts 0..3 draws every token there (selection only)
            layer.mlp.gate.e_score_correction_bias.copy_(skew * (torch.arange(cfg.model.n_routed_experts) < 4))
        layer.mlp.reset_counters()
        layer.zero_grad(set_to_none=True)
        h = torch.randn(2, t, cfg.model.hidden_size, generator=torch.Generator().manual_seed(int(skew)),
                        requires_grad=True)
        with ShapeTrace().counting() as rec:
            out, _ = layer(h, cos, sin)
            out.square().mean().backward()
        assert rec.syncs == []
        traces.append(rec.trace)
        loads.append(layer.mlp.tokens_per_expert.clone())
    assert loads[1][4:].sum() == 0 and loads[0][4:].sum() > 0  # the routing did differ
    assert traces[0] == traces[1]
