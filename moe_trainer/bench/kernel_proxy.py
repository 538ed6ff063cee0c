"""A GPU-time proxy measured without a GPU: what the accelerator path's forward + backward asks of
the device outside the GEMMs, counted op by op at the dispatcher.

On a GPU a MoE step's time outside the GEMMs is set by how many kernels are launched and how many
bytes they move. This counts, for one forward + backward on the accelerator path in bf16:
- the aten ops outside the GEMMs (views and bare allocations launch nothing and are not counted),
  the bytes they write (their outputs) and read (their tensor inputs), and the top writers by op;
- the GEMMs apart (mm, addmm, bmm, baddbmm, _grouped_mm): calls, FLOPs, and the bytes they must
  move at least (operands read once, result written once);
- attention (SDPA) apart: calls, FLOPs (causal: half the score matrix).

Two ops that decompose into many on a CPU are one kernel each way on CUDA: `F.rms_norm`
(`_fused_rms_norm` and its backward) and `F.scaled_dot_product_attention` (flash / memory-efficient
/ cuDNN). The counter counts each as one op forward and one backward, as CUDA runs them; anything
around them (casts, a padded V) is counted as it comes.

The model runs on the meta device: shapes, dtypes and the op sequence without values, so the
shipped GPU configs' shapes are counted in seconds. That is sound because at ep 1 nothing in the
accelerator path reads a device value on the host (tests/test_accelerator_path.py proves it).

Cases: `model`: a 4-layer DeepSeek-V3 (d 1024, 64 routed experts top-6, MLA; configs/moe_bench.yaml
with hidden_size 1024), 2 x 1,024 tokens, whole model with head and loss; `layer`: one MoE decoder
layer (attention + MoE) of that model; `moe_1b_gpu`: one MoE decoder layer of configs/moe_1b_gpu.yaml
at its micro-batch (2 x 2,048 tokens).

Compiled (`--compiled`): the per-layer cases compiled by inductor (fullgraph, bf16, as
`train.compile` compiles a decoder layer) on real CPU tensors, and inductor's own counts of the
forward and backward graphs: the kernels it generates (each a fusion of the eager ops above), the
aten ops it falls back to (sort, top-k, gathers), the extern GEMM and attention calls, and the bytes
its scheduler nodes read and write (inductor's `count_bytes`, the figure its metrics log reports).
Causal attention is one opaque op each way, as a GPU's fused kernel is (on a CPU, MLA's two head
sizes would send SDPA to its math path, which inductor decomposes over materialised scores).
Inductor's scheduler fuses alike for its C++ and
Triton back ends, so the counts stand for what a GPU would launch, up to the back ends' own rules
(Triton may split a reduction that C++ keeps whole). Compiling takes minutes on a small CPU.

    python -m moe_trainer.bench.kernel_proxy [--cases model,layer,moe_1b_gpu] [--top 10] [--compiled]
        [--out F.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .. import kernels
from ..kernels import accelerator  # noqa: F401  (registers torch.ops.moe_trainer.grouped_mm)
from ..resolve import load_config
from ..models.deepseek_v3 import DecoderLayer
from ..models.registry import meta_model

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]

GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default,
         torch.ops.moe_trainer.grouped_mm.default}  # the last: fp32's (kernels/accelerator.py)
# ops that launch no kernel: allocations without a fill, and views that the flag misses
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
             aten.new_empty_strided.default, aten._unsafe_view.default, aten.lift_fresh.default,
             aten.empty_like.default}

CASES = {
    # name: (config, overrides, micro batch, what runs)
    "model": ("configs/moe_bench.yaml", ["model.hidden_size=1024", "train.seq_len=1024"], 2, "model"),
    "layer": ("configs/moe_bench.yaml", ["model.hidden_size=1024", "train.seq_len=1024"], 2, "layer"),
    "moe_1b_gpu": ("configs/moe_1b_gpu.yaml", [], 2, "layer"),
}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensors_in(tree) -> list[torch.Tensor]:
    flat = tree if isinstance(tree, (list, tuple)) else [tree]
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(tensors_in(x))
    return out


def gemm_flops(func, args) -> int:
    if func is aten.mm.default:
        a, b = args[0], args[1]
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if func is aten.addmm.default:
        a, b = args[1], args[2]
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if func in (aten.bmm.default, aten.baddbmm.default):
        a, b = (args[0], args[1]) if func is aten.bmm.default else (args[1], args[2])
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    a, b = args[0], args[1]  # _grouped_mm: groups along M (2D x 3D) or along K (2D x 2D)
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    rows = a.shape[0] if a.dim() == 2 else a.shape[0] * a.shape[1]
    return 2 * rows * a.shape[-1] * b.shape[-1]


def sdpa_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backward: bool) -> int:
    """Forward: S = QK^T and O = PV. Backward (flash-style, S recomputed): QK^T again, dV, dP, dQ, dK."""
    b, h, t, dqk = q.shape
    s, dv = k.shape[2], v.shape[-1]
    per_score = (3 * dqk + 2 * dv) if backward else (dqk + dv)
    return int(2 * b * h * t * s * per_score * (0.5 if causal else 1.0))


class OpCounter(TorchDispatchMode):
    """Counts what each aten op launches: ops, bytes written and read outside the GEMMs, and the
    GEMMs' and attention's calls, FLOPs and minimal bytes apart."""

    def __init__(self):
        super().__init__()
        self.paused = False
        self.ops = 0
        self.written = 0
        self.read = 0
        self.by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [calls, bytes written]
        self.gemm = {"calls": 0, "flops": 0, "min_bytes": 0}
        self.sdpa = {"calls": 0, "flops": 0, "min_bytes": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or func.is_view or func in NO_KERNEL:
            return out
        ins, outs = tensors_in(list(args) + list(kwargs.values())), tensors_in(out)
        if func in GEMMS:
            self.gemm["calls"] += 1
            self.gemm["flops"] += gemm_flops(func, args)
            self.gemm["min_bytes"] += sum(map(nbytes, ins)) + sum(map(nbytes, outs))
        else:
            self.record(func.__name__ if hasattr(func, "__name__") else str(func), ins, outs)
        return out

    def record(self, name: str, ins, outs) -> None:
        w = sum(nbytes(t) for t in outs if t is not None)
        self.ops += 1
        self.written += w
        self.read += sum(nbytes(t) for t in ins if t is not None)
        self.by_op[name][0] += 1
        self.by_op[name][1] += w

    def record_sdpa(self, ins, outs, flops: int) -> None:
        self.sdpa["calls"] += 1
        self.sdpa["flops"] += flops
        self.sdpa["min_bytes"] += sum(nbytes(t) for t in ins + outs if t is not None)

    @contextlib.contextmanager
    def pause(self):
        was, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = was


class OneKernel(torch.autograd.Function):
    """Runs `fn(*tensors)` with the counter paused and books it as one kernel forward and one
    backward (what CUDA launches for rms_norm and SDPA); its backward is autograd's over the
    same ops, paused likewise."""

    @staticmethod
    def forward(ctx, fn: Callable, book: Callable, counter: OpCounter, *tensors):
        inputs = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
        with torch.enable_grad(), counter.pause():
            out = fn(*inputs)
        book(False, [t for t in inputs if t is not None], [out])
        ctx.inputs, ctx.out, ctx.book, ctx.counter = inputs, out, book, counter
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        wanted = [i for i, t in enumerate(ctx.inputs) if t is not None and t.requires_grad]
        with ctx.counter.pause():
            grads = torch.autograd.grad(ctx.out, [ctx.inputs[i] for i in wanted], grad, allow_unused=True)
        ctx.book(True, [grad, ctx.out] + [t for t in ctx.inputs if t is not None], list(grads))
        full = [None] * len(ctx.inputs)
        for i, g in zip(wanted, grads):
            full[i] = g
        return (None, None, None, *full)


class FusedAsOnCuda(TorchFunctionMode):
    """F.rms_norm and F.scaled_dot_product_attention booked as CUDA's single kernels (see above)."""

    def __init__(self, counter: OpCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        if func is F.rms_norm:
            x, shape = args[0], args[1]
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            eps = args[3] if len(args) > 3 else kwargs.get("eps")

            def book(backward, ins, outs):
                c.record("rms_norm_backward" if backward else "rms_norm", ins, outs)

            return OneKernel.apply(lambda a, w: F.rms_norm(a, shape, w, eps), book, c, x, weight)
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            causal = kwargs.get("is_causal", False)
            rest = {n: kwargs[n] for n in ("scale", "enable_gqa", "is_causal") if n in kwargs}
            mask = kwargs.get("attn_mask")

            def book(backward, ins, outs):
                c.record_sdpa(ins, outs, sdpa_flops(q, k, v, causal, backward))

            return OneKernel.apply(
                lambda a, b, cc, m: F.scaled_dot_product_attention(a, b, cc, attn_mask=m, **rest),
                book, c, q, k, v, mask)
        return func(*args, **kwargs)


def _config(case: str):
    path, overrides, micro_batch, what = CASES[case]
    cfg = load_config(str(ROOT / path), overrides)
    if cfg.model.vocab_size == "auto":
        cfg.model.vocab_size = 320
    return cfg, micro_batch, what


def count(case: str, dtype: torch.dtype = torch.bfloat16, top: int = 10, as_cuda: bool = True) -> dict:
    """One forward + backward of `case` on the accelerator path, on the meta device; `as_cuda`:
    rms_norm and SDPA booked as CUDA's one kernel each way, else as their CPU decompositions."""
    cfg, micro_batch, what = _config(case)
    t = cfg.train.seq_len
    tokens = micro_batch * t
    with kernels.using("accelerator"), torch.device("meta"):
        if what == "model":
            module = meta_model(cfg.model).to("meta", dtype)  # the rope buffer is built on the CPU
            ids = torch.zeros(micro_batch, t + 1, dtype=torch.int64)
            run = lambda: module(ids[:, :-1], ids[:, 1:]).loss  # noqa: E731
            moe_count = cfg.model.num_hidden_layers - cfg.model.first_k_dense_replace
        else:
            module = DecoderLayer(cfg.model, cfg.model.first_k_dense_replace).to(dtype)
            h = torch.empty(micro_batch, t, cfg.model.hidden_size, dtype=dtype, requires_grad=True)
            cos = torch.empty(t, cfg.model.qk_rope_head_dim, dtype=dtype)
            sin = torch.empty_like(cos)
            run = lambda: module(h, cos, sin)[0].float().sum()  # noqa: E731
            moe_count = 1
        counter = OpCounter()
        with (FusedAsOnCuda(counter) if as_cuda else contextlib.nullcontext()), counter:
            run().backward()
    top_ops = sorted(counter.by_op.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "case": case, "as_cuda": as_cuda, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
        "moe_layers": moe_count,
        "ops": counter.ops, "bytes_written": counter.written, "bytes_read": counter.read,
        "bytes_written_per_token": counter.written / tokens, "bytes_read_per_token": counter.read / tokens,
        "gemm": dict(counter.gemm), "sdpa": dict(counter.sdpa),
        "top_writers": [{"op": n, "calls": c, "bytes_written": w} for n, (c, w) in top_ops],
    }


# ----------------------------------------------------------------------------- compiled

_SDPA = torch._C._nn.scaled_dot_product_attention  # F's own function, which attention_as_one_kernel replaces


@torch.library.custom_op("moe_trainer_proxy::causal_attention", mutates_args=())
def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      enable_gqa: bool) -> torch.Tensor:
    """Causal SDPA as one opaque op, so inductor keeps it an extern call, as it keeps a GPU's fused
    attention kernel: on a CPU, with MLA's two head sizes, it would decompose SDPA's math path into
    generated kernels over materialised (B, H, T, T) scores, bytes a GPU never moves."""
    return _SDPA(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa).contiguous()


@_causal_attention.register_fake
def _(q, k, v, scale, enable_gqa):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("moe_trainer_proxy::causal_attention_backward", mutates_args=())
def _causal_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               scale: float, enable_gqa: bool) -> list[torch.Tensor]:
    # the math path's gradients, in fp32 (autograd does not run inside a custom op's kernel)
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf, gf = (t.float() for t in (q, k, v, grad))
    kf, vf = kf.repeat_interleave(groups, dim=1), vf.repeat_interleave(groups, dim=1)
    t, s = q.shape[-2], k.shape[-2]
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(s - t + 1), float("-inf"))
    p = scores.softmax(-1)
    dv = p.transpose(-1, -2) @ gf
    dp = gf @ vf.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk = (ds @ kf) * scale, (ds.transpose(-1, -2) @ qf) * scale
    if groups > 1:  # each key/value head's gradient sums over the query heads that share it
        dk, dv = (x.unflatten(1, (k.shape[1], groups)).sum(2) for x in (dk, dv))
    return [dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()]


@_causal_attention_backward.register_fake
def _(grad, q, k, v, scale, enable_gqa):
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]  # contiguous, as the kernel's


def _attention_setup(ctx, inputs, output):
    q, k, v, ctx.scale, ctx.enable_gqa = inputs
    ctx.save_for_backward(q, k, v)


def _attention_backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = torch.ops.moe_trainer_proxy.causal_attention_backward(grad, q, k, v, ctx.scale, ctx.enable_gqa)
    return dq, dk, dv, None, None


_causal_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


@contextlib.contextmanager
def attention_as_one_kernel():
    """F.scaled_dot_product_attention's causal calls without a mask as the opaque op above."""
    base = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or not is_causal or dropout_p:
            return base(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return torch.ops.moe_trainer_proxy.causal_attention(q, k, v, scale, enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = base


@contextlib.contextmanager
def inductor_counts():
    """Inductor's metrics for what compiles inside, filled on exit into the yielded dict: `kernels`
    (generated, each a fusion), `fallbacks` (aten ops inductor calls as they are: sort, top-k,
    cumsum, scatter, gathers), `kernel_bytes` (what both read and write: the glue outside the GEMMs),
    `extern_calls` and `extern_bytes` (the GEMMs and attention), all from inductor's own per-node
    byte count (`count_bytes`, what its metrics log reports)."""
    import logging
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config, metrics
    log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")  # its count_bytes runs at INFO
    saved = log.level, log.propagate, list(log.handlers)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.handlers = [logging.NullHandler()]
    metrics.reset()
    out: dict = {}
    # a graph served from inductor's caches skips the scheduler, which is what counts: compile afresh
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        try:
            yield out
            compute, fallbacks = [], []
            for node, _ in metrics.nodes_num_elem:
                if not node.is_extern():
                    continue
                name = getattr(node.node, "python_kernel_name", None) or type(node.node).__name__
                if name.rsplit(".", 1)[-1] in ("mm", "bmm", "addmm", "_grouped_mm") or "grouped_mm" in name \
                        or "causal_attention" in name:
                    compute.append(node)
                elif type(node.node).__name__ != "MultiOutput":  # a tuple's unpacking, no work
                    fallbacks.append(node)
            extern_bytes = sum(n.get_read_write_buffers_sizes() for n in compute)
            out.update(kernels=metrics.generated_kernel_count, fallbacks=len(fallbacks),
                       kernel_bytes=metrics.num_bytes_accessed - extern_bytes, extern_calls=len(compute),
                       extern_bytes=extern_bytes)
        finally:
            log.level, log.propagate, log.handlers = saved[0], saved[1], saved[2]


def count_compiled(case: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """One forward + backward of the per-layer `case` compiled by inductor (fullgraph) on CPU
    tensors: inductor's kernels, extern calls and bytes per layer and per token, the compile's
    seconds."""
    cfg, micro_batch, what = _config(case)
    if what != "layer":
        raise ValueError(f"the compiled counts are per layer: {case!r} is a whole model")
    t = cfg.train.seq_len
    tokens = micro_batch * t
    torch._dynamo.reset()
    with kernels.using("accelerator"):
        module = DecoderLayer(cfg.model, cfg.model.first_k_dense_replace)
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
        module = module.to(dtype)
        h = torch.randn(micro_batch, t, cfg.model.hidden_size, generator=torch.Generator().manual_seed(0))
        h = h.to(dtype).requires_grad_()
        cos = torch.ones(t, cfg.model.qk_rope_head_dim, dtype=dtype)
        sin = torch.zeros_like(cos)
        module.compile(backend="inductor", fullgraph=True)
        start = time.perf_counter()
        with attention_as_one_kernel(), inductor_counts() as c:
            module(h, cos, sin)[0].float().sum().backward()
        seconds = time.perf_counter() - start
    torch._dynamo.reset()
    return {"case": case, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "moe_layers": 1,
            **c, "kernel_bytes_per_token": c["kernel_bytes"] / tokens, "first_call_s": seconds}


def describe_compiled(r: dict) -> str:
    return (f"{r['case']} compiled by inductor ({r['dtype']}, {r['tokens']:,} tokens, 1 MoE layer): "
            f"{r['kernels']} generated kernels, {r['kernel_bytes'] / 1e9:.3f} GB read and written by them "
            f"and {r['fallbacks']} fallback aten calls ({r['kernel_bytes_per_token'] / 1e6:.3f} MB/token); "
            f"{r['extern_calls']} GEMM and attention calls "
            f"moving {r['extern_bytes'] / 1e9:.3f} GB; first forward + backward (the compile) {r['first_call_s']:.0f} s")


def describe(r: dict) -> str:
    g, s, tok = r["gemm"], r["sdpa"], r["tokens"]
    how = "" if r["as_cuda"] else ", CPU decompositions"
    lines = [f"{r['case']} ({r['dtype']}{how}, {tok:,} tokens, {r['moe_layers']} MoE layer(s)): outside the GEMMs "
             f"{r['ops']:,} ops, {r['bytes_written'] / 1e9:.3f} GB written ({r['bytes_written_per_token'] / 1e6:.3f} "
             f"MB/token), {r['bytes_read'] / 1e9:.3f} GB read ({r['bytes_read_per_token'] / 1e6:.3f} MB/token)",
             f"  GEMMs: {g['calls']} calls, {g['flops'] / tok / 1e6:.1f} MFLOP/token, at least "
             f"{g['min_bytes'] / tok / 1e6:.3f} MB/token; SDPA: {s['calls']} calls, {s['flops'] / tok / 1e6:.1f} "
             f"MFLOP/token, at least {s['min_bytes'] / tok / 1e6:.3f} MB/token",
             "  top writers: " + ", ".join(f"{w['op']} {w['bytes_written'] / 1e9:.3f} GB ({w['calls']})"
                                           for w in r["top_writers"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--out", default="")
    ap.add_argument("--as-cpu", action="store_true", help="count rms_norm and SDPA as a CPU decomposes them")
    ap.add_argument("--compiled", action="store_true",
                    help="also compile the per-layer cases with inductor and report its own counts (minutes)")
    a = ap.parse_args(argv)
    names = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        print(f"bench.kernel_proxy: --cases takes {', '.join(CASES)}, got {a.cases!r}.", file=sys.stderr)
        return 2
    results, compiled = [], []
    for name in names:
        results.append(count(name, top=a.top, as_cuda=not a.as_cpu))
        print(describe(results[-1]), flush=True)
    for name in names if a.compiled else []:
        if CASES[name][3] == "layer":
            compiled.append(count_compiled(name))
            print(describe_compiled(compiled[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"command": "python -m moe_trainer.bench.kernel_proxy " + " ".join(
            argv if argv is not None else sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "torch": torch.__version__, "results": results, "compiled": compiled}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
