"""The routed experts on CPU ranks: the same SwiGLU expert maths as the accelerator path
(kernels/accelerator.py), shaped for a CPU's caches and GEMM libraries.

Weights in Hugging Face's layout: gate_up_proj (E, 2H, d) and down_proj (E, d, H). Inputs arrive
sorted by expert with per-expert row counts as host ints (on a CPU reading them costs nothing).

- `GroupedSwiGLUExperts` walks the experts in blocks of ~2048 rows: torch._grouped_mm (or one mm
  per expert) for the gate/up projection, the SwiGLU in place on the cache-resident block, mm into
  preallocated outputs for the down projection; backward writes the weight gradients straight
  into the weights' layout and allocates no (M, H) or (M, 2H) temporary.
- `PaddedSwiGLUExperts` (bf16/fp16): every GEMM on rows rounded up to a multiple of 16, so
  oneDNN's per-shape JIT kernels are reused instead of rebuilt for each new row count.
- `ThreadedCPUExperts` (fp32): each expert one task on one thread in the C++ extension.
The SwiGLU and its backward are one fused C++ pass each (extension.py); the torch ops here are
the fallback. All equal the loop reference up to float rounding (tests/test_moe_kernels.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import wgrad
from . import extension


def _grouped_available() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # rows of 8 fp32 = 32 bytes: _grouped_mm rejects strides that are not multiples of 16 bytes
        a, b = torch.ones(4, 8), torch.ones(2, 8, 8)
        torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


GROUPED_MM = _grouped_available()
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor) -> bool:
    """_grouped_mm needs a 16-byte aligned data pointer and row strides that are multiples of 16 bytes."""
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


# ----------------------------------------------------------------------------- SwiGLU pieces (no autograd)

# Rows per block of the elementwise SwiGLU passes: a block's operands (~2-6 MB) stay in
# cache across the 3 (forward) or 7 (backward) passes instead of streaming from memory
# each time; measured 2-4x faster than whole-tensor ops on the benchmark's 24k x 256.
SWIGLU_BLOCK_ROWS = 2048


def swiglu_forward(h: torch.Tensor, gate: Optional[torch.Tensor], block: int = SWIGLU_BLOCK_ROWS) -> torch.Tensor:
    """silu(g) * u (* gate) for h = [g | u] (M, 2H); one new (M, H) tensor, no chunk copies.
    On CPU the fused kernel computes it in fp32 and rounds once; the torch ops below round in
    the same order as `F.silu(g) * u * gate[:, None]`."""
    ops = extension.ops_for(h)
    if ops is not None:
        return ops.swiglu_forward(h, gate)
    m, hid = h.shape[0], h.shape[-1] // 2
    a = h.new_empty(m, hid)
    gcol = gate[:, None].to(h.dtype) if gate is not None else None
    for s in range(0, m, block):
        e = min(s + block, m)
        a_, h_ = a[s:e], h[s:e]
        torch.ops.aten.silu.out(h_[:, :hid], out=a_)
        a_.mul_(h_[:, hid:])
        if gcol is not None:
            a_.mul_(gcol[s:e])
    return a


def swiglu_backward(da: torch.Tensor, h: torch.Tensor, gate: Optional[torch.Tensor], need_gate_grad: bool,
                    block: int = SWIGLU_BLOCK_ROWS) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of swiglu_forward: dh (M, 2H), its two halves written in place (no
    concatenation), and dgate (M,) in gate's dtype (or None). silu(g) is recomputed
    from h. Overwrites da (the torch-op path)."""
    ops = extension.ops_for(h, da)
    if ops is not None:
        out = ops.swiglu_backward(da, h, gate, gate is not None and need_gate_grad)
        return out[0], (out[1].to(gate.dtype) if len(out) > 1 else None)
    m, hid = h.shape[0], h.shape[-1] // 2
    dh = torch.empty_like(h)
    gcol = gate[:, None].to(da.dtype) if gate is not None else None
    dgate = gate.new_empty(m) if gate is not None and need_gate_grad else None
    for s in range(0, m, block):
        e = min(s + block, m)
        g, u = h[s:e, :hid], h[s:e, hid:]
        dg, du, da_ = dh[s:e, :hid], dh[s:e, hid:], da[s:e]
        torch.ops.aten.silu.out(g, out=du)
        du.mul_(da_)  # da * silu(g)
        if gcol is not None:
            if dgate is not None:  # sum_j da * silu(g) * u (the sum accumulates in fp32 for bf16)
                dgate[s:e] = torch.linalg.vecdot(du, u)
            du.mul_(gcol[s:e])  # d/du = da * gate * silu(g)
            da_.mul_(gcol[s:e])
        da_.mul_(u)  # da * gate * u
        torch.ops.aten.silu_backward.grad_input(da_, g, grad_input=dg)  # d/dg
    return dh, dgate


# Consecutive experts are processed in blocks of at least this many rows: the block's
# pre-activation, SwiGLU output and gradients (~2-6 MB) stay in cache between the GEMMs
# and the elementwise passes, and no (M, H) / (M, 2H) temporary is ever allocated
# (fresh large tensors cost page faults on every step).
EXPERT_BLOCK_ROWS = 2048


def expert_blocks(counts: list[int], target: int = EXPERT_BLOCK_ROWS) -> list[tuple[int, int, int, int]]:
    """Non-empty blocks (e0, e1, r0, r1) of consecutive experts [e0, e1) owning rows [r0, r1)."""
    blocks, e0, r0, r = [], 0, 0, 0
    for e, n in enumerate(counts):
        r += n
        if r - r0 >= target:
            blocks.append((e0, e + 1, r0, r))
            e0, r0 = e + 1, r
    if r > r0:
        blocks.append((e0, len(counts), r0, r))
    return blocks


def _mm_rows(a: torch.Tensor, b: torch.Tensor, counts: list[int], e0: int, out: torch.Tensor) -> None:
    """out[rows of expert e0+i] = a[those rows] @ b[e0+i], one mm per non-empty expert."""
    s = 0
    for i, n in enumerate(counts):
        if n:
            torch.mm(a[s:s + n], b[e0 + i], out=out[s:s + n])
        s += n


def _wgrad_rows(a: torch.Tensor, b: torch.Tensor, counts: list[int], e0: int, out: torch.Tensor) -> None:
    """out[e0+i] = a_i^T @ b_i over the rows of expert e0+i (zero for an empty expert)."""
    s = 0
    for i, n in enumerate(counts):
        if n:
            torch.mm(a[s:s + n].t(), b[s:s + n], out=out[e0 + i])
        else:
            out[e0 + i].zero_()
        s += n


def _gmm_block(a: torch.Tensor, b: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
    """Rows of a in groups of counts[i], each times b[i] -> new tensor; torch._grouped_mm if `grouped`."""
    if grouped:
        offs = torch.tensor(counts, dtype=torch.int64).cumsum_(0).to(device=a.device, dtype=torch.int32)
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    _mm_rows(a, b, counts, 0, out)
    return out


def _grad_buffers(ctx, x, w1, w2, gate, held: bool = False):
    """Uninitialised (dx, dw1, dw2, dgate) for the inputs that need a gradient (else None); none for
    the weights when their gradients are `held` back (kernels/wgrad.py)."""
    need_x, need_w1, need_w2, need_gate = ctx.needs_input_grad[:4]
    need_w1, need_w2 = need_w1 and not held, need_w2 and not held
    return (x.new_empty(x.shape) if need_x else None, w1.new_empty(w1.shape) if need_w1 else None,
            w2.new_empty(w2.shape) if need_w2 else None,
            gate.new_empty(gate.shape) if need_gate and gate is not None else None)


class GroupedSwiGLUExperts(torch.autograd.Function):
    """out = (silu(x W1g^T) * x W1u^T * gate) W2^T per expert group of rows.

    x (M, d) sorted by expert, w1 (E, 2H, d), w2 (E, d, H), gate (M,) or None,
    counts (host ints), grouped: use torch._grouped_mm for the block GEMMs (else mm loops).
    Saves x, the pre-activation h and the SwiGLU output (in blocks); backward writes the
    weight gradients straight into the weights' layout (E, 2H, d) and (E, d, H), and
    keeps every other temporary block-sized."""

    @staticmethod
    def forward(ctx, x, w1, w2, gate, counts, grouped):
        out = x.new_empty(x.shape[0], w2.shape[1])
        w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
        blocks = expert_blocks(counts)
        hs, acts = [], []
        for e0, e1, r0, r1 in blocks:
            cs = counts[e0:e1]
            h = _gmm_block(x[r0:r1], w1t[e0:e1], cs, grouped)  # (rows, 2H)
            a = swiglu_forward(h, gate[r0:r1] if gate is not None else None, block=r1 - r0)
            _mm_rows(a, w2t, cs, e0, out[r0:r1])
            hs.append(h)
            acts.append(a)
        ctx.save_for_backward(w1, w2, gate, x, *hs, *acts)
        ctx.counts, ctx.blocks, ctx.grouped = counts, blocks, grouped
        return out

    @staticmethod
    def backward(ctx, dy):
        w1, w2, gate, x, *saved = ctx.saved_tensors
        hs, acts = saved[:len(ctx.blocks)], saved[len(ctx.blocks):]
        counts, grouped, blocks = ctx.counts, ctx.grouped, ctx.blocks
        dy = dy.contiguous()
        dhs: list = []  # each block's pre-activation gradient, when the weight gradients are held back

        def block_wgrads(i: int, dh: torch.Tensor, dw1: Optional[torch.Tensor], dw2: Optional[torch.Tensor]) -> None:
            """Block i's experts' weight gradients (and zeros for the empty experts before it; the
            last block's caller zeroes those after it)."""
            e0, e1, r0, r1 = blocks[i]
            for w in (dw1, dw2):
                if w is not None:
                    w[(blocks[i - 1][1] if i else 0):e0].zero_()
                    if i == len(blocks) - 1:
                        w[e1:].zero_()
            if dw2 is not None:
                _wgrad_rows(dy[r0:r1], acts[i], counts[e0:e1], e0, dw2)  # (E, d, H)
            if dw1 is not None:
                _wgrad_rows(dh, x[r0:r1], counts[e0:e1], e0, dw1)  # (E, 2H, d)

        def weight_grads():
            g1, g2 = w1.new_empty(w1.shape), w2.new_empty(w2.shape)
            for i, dh in enumerate(dhs):
                block_wgrads(i, dh, g1, g2)
            if not blocks:
                g1.zero_(), g2.zero_()
            return g1, g2

        held = all(ctx.needs_input_grad[1:3]) and wgrad.hold((w1, w2), weight_grads)
        dx, dw1, dw2, dgate = _grad_buffers(ctx, x, w1, w2, gate, held)
        need_x, need_gate = dx is not None, dgate is not None
        for i, (e0, e1, r0, r1) in enumerate(blocks):
            cs, h, dy_b = counts[e0:e1], hs[i], dy[r0:r1]
            g_b = gate[r0:r1] if gate is not None else None
            da = _gmm_block(dy_b, w2[e0:e1], cs, grouped)  # (rows, H)
            dh, dg = swiglu_backward(da, h, g_b, need_gate, block=r1 - r0)
            del da
            if dg is not None:
                dgate[r0:r1] = dg
            if held:
                dhs.append(dh)
            else:
                block_wgrads(i, dh, dw1, dw2)
            if need_x:
                _mm_rows(dh, w1, cs, e0, dx[r0:r1])
        if not blocks:
            for w in (dw1, dw2):
                if w is not None:
                    w.zero_()
        if need_gate and blocks:
            dgate[blocks[-1][3]:].zero_()
        return dx, dw1, dw2, dgate, None, None


# ----------------------------------------------------------------------------- rows in multiples of a quantum

# torch's CPU GEMM for bf16/fp16 is oneDNN, which compiles (JITs) a kernel for each GEMM shape and
# caches ~1024 of them. Per-expert row counts change every micro-batch, so exact-row GEMMs keep
# meeting new shapes: 100 experts of 100-400 rows ([m, 256] x [256, 256], one thread) ran at
# 80-240 GFLOP/s where the same GEMMs on cached shapes run at ~390. Rounding every expert's rows up to
# a multiple of 16 bounds the shapes (all cached after a few steps) for ~3% padding work at 256-row
# experts; fp32 goes through MKL, which compiles nothing, and GPUs have real grouped GEMMs.
EXPERT_ROW_QUANTUM = 16


def row_quantum(x: torch.Tensor) -> int:
    """Row multiple for x's expert GEMMs: EXPERT_ROW_QUANTUM on oneDNN's per-shape path, else 1."""
    return EXPERT_ROW_QUANTUM if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) else 1


def padded_rows(counts: list[int], q: int) -> list[tuple[int, int, int, int]]:
    """(s, m, p, mp) per expert: its m rows start at s in the caller's tensors and at p in the
    padded ones, where it owns mp = m rounded up to a multiple of q (0 for an empty expert)."""
    rows, s, p = [], 0, 0
    for m in counts:
        mp = -(-m // q) * q
        rows.append((s, m, p, mp))
        s, p = s + m, p + mp
    return rows


def _rows_in(t: torch.Tensor, s: int, m: int, mp: int) -> torch.Tensor:
    """mp rows standing for t[s:s+m]: t's own next rows when it has them (they belong to later
    experts and only ever meet zero rows of the other operand), else a zero-padded copy."""
    if s + mp <= t.shape[0]:
        return t[s:s + mp]
    out = t.new_zeros(mp, t.shape[1])
    out[:m] = t[s:s + m]
    return out


def _mm_to_rows(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, s: int, m: int) -> None:
    """out[s:s+m] = (a @ b)[:m] for a of mp >= m rows. The mp - m extra result rows land on the
    next rows of `out` when it has them: those belong to later experts, which overwrite them, so
    callers go through the experts in ascending order."""
    mp = a.shape[0]
    if s + mp <= out.shape[0]:
        torch.mm(a, b, out=out[s:s + mp])
    else:
        out[s:s + m] = torch.mm(a, b)[:m]


class PaddedSwiGLUExperts(torch.autograd.Function):
    """GroupedSwiGLUExperts with every GEMM on rows rounded up to a multiple of q (row_quantum).

    The pre-activation, the SwiGLU output and their gradients live in a padded layout where
    expert e owns mp rows; their pad rows carry a zero gate, so the SwiGLU output and the
    pre-activation gradient are exactly zero there whatever the pre-activation holds. The
    caller's tensors (x, dy, out, dx) stay unpadded: an expert's GEMM reads or writes the next
    mp - m rows of them (later experts' rows) instead of padding, which costs nothing and
    changes no result: those inputs only meet the zero rows in the weight-gradient sums, and
    those outputs are overwritten by their own expert. Only the last expert of a tensor needs a
    zero-padded copy. Results equal GroupedSwiGLUExperts' (tests/test_moe_kernels.py)."""

    @staticmethod
    def forward(ctx, x, w1, w2, gate, counts, q):
        out = x.new_empty(x.shape[0], w2.shape[1])
        w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
        rows = padded_rows(counts, q)
        blocks = expert_blocks(counts)
        gate_dtype = torch.promote_types(x.dtype if gate is None else gate.dtype, torch.float32)
        hs, acts, gates = [], [], []
        for e0, e1, _, _ in blocks:
            p0, p1 = rows[e0][2], rows[e1 - 1][2] + rows[e1 - 1][3]
            h = x.new_empty(p1 - p0, w1.shape[1])
            g = torch.zeros(p1 - p0, dtype=gate_dtype, device=x.device)  # zero on pad rows
            for e in range(e0, e1):
                s, m, p, mp = rows[e]
                if m:
                    torch.mm(_rows_in(x, s, m, mp), w1t[e], out=h[p - p0:p - p0 + mp])
                    g[p - p0:p - p0 + m] = 1.0 if gate is None else gate[s:s + m]
            a = swiglu_forward(h, g, block=p1 - p0)
            for e in range(e0, e1):
                s, m, p, mp = rows[e]
                if m:
                    _mm_to_rows(a[p - p0:p - p0 + mp], w2t[e], out, s, m)
            hs.append(h)
            acts.append(a)
            gates.append(g)
        ctx.save_for_backward(w1, w2, gate, x, *hs, *acts, *gates)
        ctx.rows, ctx.blocks = rows, blocks
        return out

    @staticmethod
    def backward(ctx, dy):
        w1, w2, gate, x, *saved = ctx.saved_tensors
        nb = len(ctx.blocks)
        hs, acts, gates = saved[:nb], saved[nb:2 * nb], saved[2 * nb:]
        rows = ctx.rows
        dy = dy.contiguous()
        dhs: list = []  # each block's pre-activation gradient, when the weight gradients are held back

        def block_wgrads(i: int, dh: torch.Tensor, dw1: Optional[torch.Tensor], dw2: Optional[torch.Tensor]) -> None:
            """Block i's experts' weight gradients (the empty experts' zeros are written apart)."""
            e0, e1, _, _ = ctx.blocks[i]
            p0 = rows[e0][2]
            for e in range(e0, e1):
                s, m, p, mp = rows[e]
                if m:
                    if dw2 is not None:
                        torch.mm(_rows_in(dy, s, m, mp).t(), acts[i][p - p0:p - p0 + mp], out=dw2[e])
                    if dw1 is not None:
                        torch.mm(dh[p - p0:p - p0 + mp].t(), _rows_in(x, s, m, mp), out=dw1[e])

        def zero_empty(*grads: Optional[torch.Tensor]) -> None:
            for e, (_, m, _, _) in enumerate(rows):
                if not m:  # an empty expert's gradients are zeros
                    for w in grads:
                        if w is not None:
                            w[e].zero_()

        def weight_grads():
            g1, g2 = w1.new_empty(w1.shape), w2.new_empty(w2.shape)
            zero_empty(g1, g2)
            for i, dh in enumerate(dhs):
                block_wgrads(i, dh, g1, g2)
            return g1, g2

        held = all(ctx.needs_input_grad[1:3]) and wgrad.hold((w1, w2), weight_grads)
        dx, dw1, dw2, dgate = _grad_buffers(ctx, x, w1, w2, gate, held)
        need_x, need_gate = dx is not None, dgate is not None
        zero_empty(dw1, dw2)
        for i, ((e0, e1, _, _), h, g) in enumerate(zip(ctx.blocks, hs, gates)):
            p0 = rows[e0][2]
            da = dy.new_empty(h.shape[0], w2.shape[2])
            for e in range(e0, e1):
                s, m, p, mp = rows[e]
                if m:
                    torch.mm(_rows_in(dy, s, m, mp), w2[e], out=da[p - p0:p - p0 + mp])
            dh, dg = swiglu_backward(da, h, g, need_gate, block=h.shape[0])
            del da
            if held:
                dhs.append(dh)
            else:
                block_wgrads(i, dh, dw1, dw2)
            for e in range(e0, e1):
                s, m, p, mp = rows[e]
                if not m:
                    continue
                if need_x:
                    _mm_to_rows(dh[p - p0:p - p0 + mp], w1[e], dx, s, m)
                if dg is not None:
                    dgate[s:s + m] = dg[p - p0:p - p0 + m]
        return dx, dw1, dw2, dgate, None, None


# ----------------------------------------------------------------------------- one thread per expert (CPU fp32)

def threaded_cpu_ops(x: torch.Tensor, *tensors: Optional[torch.Tensor]):
    """The fused kernels when ThreadedCPUExperts can take these tensors (contiguous fp32 on a CPU,
    kernels built), else None."""
    if x.dtype != torch.float32 or any(t is not None and t.dtype != torch.float32 for t in tensors):
        return None
    ops = extension.ops_on_cpu(x, *(t for t in tensors if t is not None))
    return ops if ops is not None and hasattr(ops, "experts_forward") else None


class ThreadedCPUExperts(torch.autograd.Function):
    """GroupedSwiGLUExperts on a CPU in fp32, each expert one task on one thread (cpu_kernels.cpp:
    experts_forward / experts_backward): an expert's GEMMs and SwiGLU run on one core while the
    block is in its cache, and the cores meet once per call instead of after every GEMM, which
    torch's per-GEMM threading splits across them (an expert's GEMMs are a few hundred rows).
    Saves x, the pre-activation and the SwiGLU output, as GroupedSwiGLUExperts does; results equal
    it up to float rounding (tests/test_moe_kernels.py)."""

    @staticmethod
    def forward(ctx, x, w1, w2, gate, counts, ops):
        onednn_min = extension.onednn_min_macs()
        out, h, a = ops.experts_forward(x.detach(), w1.detach(), w2.detach(),
                                        gate.detach() if gate is not None else None, counts, onednn_min)
        ctx.save_for_backward(x, w1, w2, gate, h, a)
        ctx.counts, ctx.ops, ctx.onednn_min = counts, ops, onednn_min
        return out

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, gate, h, a = ctx.saved_tensors
        need_x, need_w1, need_w2, need_gate = ctx.needs_input_grad[:4]
        dy, kept = dy.contiguous(), []

        def weight_grads():
            return ctx.ops.experts_weight_grads(dy, x, a, kept[0], w1, w2, ctx.counts)

        held = need_w1 and need_w2 and wgrad.hold((w1, w2), weight_grads)
        dx, dw1, dw2, dgate, dh = ctx.ops.experts_backward(dy, x, w1, w2, gate, h, a, ctx.counts, need_x,
                                                           (need_w1 or need_w2) and not held,
                                                           need_gate and gate is not None, ctx.onednn_min, held)
        if held:
            kept.append(dh)
            return dx, None, None, dgate, None, None
        return dx, dw1 if need_w1 else None, dw2 if need_w2 else None, dgate, None, None


def _grouped_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    return GROUPED_MM and x.dtype in _GROUPED_DTYPES and all(_aligned(t) for t in (x,) + weights)


def experts_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gate: Optional[torch.Tensor],
                    counts: list[int]) -> torch.Tensor:
    """The fastest CPU path for these tensors: padded rows for bf16/fp16, one thread per expert for
    fp32 (when the extension is built), else the blocked grouped GEMMs."""
    x = x.contiguous()
    q = row_quantum(x)
    if q > 1:
        return PaddedSwiGLUExperts.apply(x, w1, w2, gate, counts, q)
    ops = threaded_cpu_ops(x, w1, w2, gate)
    if ops is not None:
        return ThreadedCPUExperts.apply(x, w1, w2, gate, counts, ops)
    return GroupedSwiGLUExperts.apply(x, w1, w2, gate, counts, _grouped_ok(x, w1, w2))
