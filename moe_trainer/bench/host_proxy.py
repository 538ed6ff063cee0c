"""Host time of a MoE decoder layer measured by proxy on a CPU: Megatron-Core's layer against ours.

The step-time model charges Megatron's eager per-layer path at a fused launcher's 9 us per kernel
(plan/gpus.py `launch_us`), and the fine-grained MoE runs trained with Megatron-Core read 1.3x fast
(docs/PLANS.md, "Why the fine-grained MoE runs read fast"). No public source gives Megatron's host
time per layer. This measures it by proxy: both layers at tiny shapes on one CPU thread, where the
ops' arithmetic is negligible and the wall time of a forward + backward is the host's work per op
(Python modules, autograd, the dispatcher, the aten op's own overhead), and the kernels each
dispatches, by part (attention, router, the token dispatcher's work, experts), so the reader sees
which parts the Qwen3 recipe's CUDA graphs and fusions remove.

- Megatron-Core (megatron-core, the test extra; called as a peer, nothing copied): a TransformerLayer
  built from `get_gpt_layer_local_spec` (the modules that need neither Transformer Engine nor Apex):
  RMSNorm, GQA self-attention with QK RMSNorm and RoPE (Qwen3's), a MoELayer with the alltoall token
  dispatcher, a softmax top-k router in fp32 with the aux loss as the Qwen3 recipes set it (not their
  forced balance: below), and SequentialMLP experts (the expert MLP it offers without TE or the
  grouped_gemm package: one Megatron MLP per local expert), at 1, 4 and 16 local experts, and at EP 2
  over two gloo processes (counted only). Stand-ins for what a CPU cannot run: the core attention is
  one F.scaled_dot_product_attention call (as TE's flash attention is one kernel each way; Megatron's
  local DotProductAttention allocates a CUDA buffer), and `_cuda_as_cpu` while the layer is built and
  run (no-op CUDA streams, the CPU as the current device, the split sizes as numpy arrays).
- This trainer: moe_trainer.models.deepseek_v3.DecoderLayer on the accelerator path
  (MOE_TRAINER_KERNELS=accelerator, the path CUDA runs), configs/moe_bench.yaml's MoE layer (MLA,
  top-6, 2 shared) at the same tiny width, with its 64 experts and with 8 (the reference: the same host
  path, less of a CPU's grouped-GEMM loop): the layer whose eager host cost was measured on an H200
  (plan/gpus.py `host_eager_us`, 72 us per kernel).

Rounds alternate the layers (A B C ...), each timing `--iters` forward + backward passes, in
`--step-blocks` blocks that each start with one run of our whole moe_bench step at the tiny width (the
scale: our layer's share of the step on this CPU against the H200's step). The report gives the
medians, the per-round ratios' quartiles, the machine's load, the kernels by part (as
bench.kernel_proxy counts them: views and bare allocations launch nothing; rms_norm and SDPA are one
kernel each way, as on CUDA) and the share of the host time by part, Megatron's host time per layer
derived for a GPU host, and what `tools/plan.py calibrate` reads with it (docs/BENCHMARKS.md,
"Megatron-Core's MoE layer on the host, by proxy").

    python -m moe_trainer.bench.host_proxy [--rounds 7] [--iters 20] [--tokens 16] [--step-blocks 5]
        [--out F.json]
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from .kernel_proxy import GEMMS, NO_KERNEL, FusedAsOnCuda, OpCounter, tensors_in

ROOT = Path(__file__).resolve().parents[2]
# the tiny width both layers run at: arithmetic negligible against the host's work per op
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERT_FFN = 64, 4, 2, 16, 32
# Megatron's local experts per rank in the Qwen3 recipes: 128 experts over EP 8 (30B) and EP 32
# (235B), and one (the expert path as one module call, which TE's grouped MLP is on a GPU); top-k at most
# the experts (the host's ops do not depend on k)
MEGATRON_CASES = {"megatron_e1": (1, 1), "megatron_e4": (4, 4), "megatron_e16": (16, 8)}  # (local experts, top-k)
REFERENCE = "ours_e8"  # the denominator of the ratios: this trainer's layer with 8 experts (our_layer)
PARTS = ("attention", "router", "dispatch", "experts", "shared", "norms+residual", "param grads")


# ----------------------------------------------------------------------------- Megatron-Core's layer

def _drop_grads(layer: torch.nn.Module, x: torch.Tensor) -> None:
    """Gradients back to None after each pass, so every pass writes them fresh and none adds into them:
    both frameworks accumulate micro-batches elsewhere (Megatron inside the weight-gradient GEMM or
    its grad buffer's hooks, this trainer in BF16_Optimizer's hooks, which the planner counts apart)."""
    for p in layer.parameters():
        p.grad = None
    x.grad = None


class _NoopEvent:
    def synchronize(self) -> None:
        pass


class _NoopStream:
    """What MoEAlltoAllTokenDispatcher asks of its device-to-host side stream, on a CPU: nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, *args) -> _NoopEvent:
        return _NoopEvent()


CPU = torch.device("cpu")


@contextlib.contextmanager
def _cuda_as_cpu():
    """While Megatron's layer is built and run on a CPU (restored on exit): torch.cuda's stream calls as
    no-ops (the alltoall dispatcher creates a side stream for its device-to-host copies at construction
    and enters it at its sync point; on CPU tensors those copies are no-ops already), and the current
    CUDA device as the CPU (where Megatron allocates buffers and, in the router, moves its weight); at
    EP > 1 the all-to-all's split sizes as numpy arrays, as the dispatcher's device-to-host copy makes
    them on a GPU (a CPU tensor it leaves as it is, which torch.distributed refuses as split sizes)."""
    current = _NoopStream()
    saved = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, torch.cuda.current_device)
    torch.cuda.Stream, torch.cuda.current_stream = _NoopStream, lambda *a, **k: current
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_device = lambda: CPU
    from megatron.core.transformer.moe import token_dispatcher
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host_as_on_cuda(tensor, as_numpy=False, record_stream=False):
        # a CPU tensor stays as it is, where the GPU path copies the split sizes into numpy arrays
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host_as_on_cuda
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, torch.cuda.current_device = saved
        token_dispatcher.maybe_move_tensor_to_cpu = to_host


class SdpaCoreAttention(torch.nn.Module):
    """Causal attention as one F.scaled_dot_product_attention call, in Megatron's core-attention slot
    (its constructor's and forward's signature; [s, b, heads, dim] in, [s, b, heads * dim] out): the
    stand-in for TE's flash attention, one kernel each way on a GPU."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _megatron_parallel_state() -> None:
    """One gloo rank and Megatron's model-parallel groups of size 1 (idempotent; a spawned EP rank has
    initialised its own already, `_ep_rank`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)


def _ep_rank(rank: int, ep: int, store_path: str, out_path: str, tokens: int) -> None:
    """One of `ep` gloo ranks: Megatron's layer at EP `ep`, one local expert (top-1 of `ep`), counted."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, ep), rank=rank, world_size=ep)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    torch.manual_seed(rank)
    _layer, step, parts = megatron_layer(ep, 1, tokens)
    counts = count_by_part(step, parts, timing_iters=1)
    if rank == 0:
        Path(out_path).write_text(json.dumps(counts))
    dist.barrier()
    dist.destroy_process_group()


def megatron_ep_counts(ep: int, tokens: int) -> dict:
    """The kernels by part of Megatron's layer on rank 0 of `ep` gloo processes (one local expert each):
    what the alltoall dispatcher adds at EP > 1 (its all-to-alls, the gather of the token counts, the
    sort of the received chunks), against the one-rank count."""
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "counts.json")
        mp.spawn(_ep_rank, args=(ep, str(Path(tmp) / "store"), out, tokens), nprocs=ep, join=True)
        return json.loads(Path(out).read_text())


def megatron_layer(local_experts: int, top_k: int, tokens: int):
    """Megatron-Core's MoE TransformerLayer (local spec, Qwen3's router settings) and a closure that runs
    one forward + backward of it on `tokens` tokens of one sequence. `local_experts` is the number of
    experts over all EP ranks: all of them local at EP 1."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.moe import moe_utils
    _megatron_parallel_state()
    # megatron-core 0.16.1 without Transformer Engine leaves this name undefined (its import guard sets
    # HAVE_TE = False only), and the router's fp32 GEMM tests it: None is what it means there (torch.mm)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM, ffn_hidden_size=4 * HIDDEN, normalization="RMSNorm", qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
        # the Qwen3 recipes' MoE: top-k of the experts, softmax scores normalised over the top-k
        # (pre_softmax false; Megatron requires it at top-1, the one-expert case), fp32 router, aux loss 1e-3, alltoall dispatcher. Not their forced balance
        # (moe_router_force_load_balancing: random logits drawn under Megatron's CUDA RNG tracker, which
        # a CPU cannot fork): one randn and two RNG-state swaps per layer on a GPU, left out
        num_moe_experts=local_experts, moe_router_topk=top_k, moe_ffn_hidden_size=EXPERT_FFN,
        moe_router_score_function="softmax", moe_router_pre_softmax=top_k == 1, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)
    spec = get_gpt_layer_local_spec(num_experts=local_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    with _cuda_as_cpu():
        layer = build_module(spec, config=cfg, layer_number=1)
    # RoPE's angles [s, 1, 1, dim], as RotaryEmbedding makes them once per step in GPTModel (its
    # forward moves them to the CUDA device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.outer(torch.arange(tokens, dtype=torch.float32), inv_freq)
    rope = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    x = torch.randn(tokens, 1, HIDDEN, dtype=torch.bfloat16, requires_grad=True)

    def step():
        with _cuda_as_cpu():
            out, _context = layer(x, attention_mask=None, rotary_pos_emb=rope)
            out.float().sum().backward()
        _drop_grads(layer, x)

    parts = {"attention": [layer.self_attention], "router": [layer.mlp.router], "experts": [layer.mlp.experts],
             "dispatch": [layer.mlp], "norms+residual": [layer.input_layernorm, layer.pre_mlp_layernorm]}
    return layer, step, parts


# ----------------------------------------------------------------------------- this trainer's layer

def our_layer(tokens: int, experts: int = 64):
    """This trainer's MoE decoder layer (configs/moe_bench.yaml's MoE block at the tiny width, with
    `experts` routed experts) on the accelerator path, and a closure running one forward + backward of
    it on `tokens` tokens. The host's work does not depend on `experts` (one grouped GEMM over all of
    them); a CPU's torch._grouped_mm loops over the groups, so fewer experts time less of the CPU's
    arithmetic and the same host path."""
    from .. import kernels
    from ..models.deepseek_v3 import DecoderLayer
    from ..resolve import load_config
    cfg = load_config(str(ROOT / "configs/moe_bench.yaml"), [
        f"model.hidden_size={HIDDEN}", f"model.num_attention_heads={HEADS}", "model.q_lora_rank=32",
        "model.kv_lora_rank=16", "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=16", "model.v_head_dim=16",
        f"model.moe_intermediate_size={EXPERT_FFN}", f"model.n_routed_experts={experts}", f"train.seq_len={tokens}"])
    with kernels.using("accelerator"):
        layer = DecoderLayer(cfg.model, cfg.model.first_k_dense_replace).to(torch.bfloat16)
    rope = cfg.model.qk_rope_head_dim
    cos = torch.randn(tokens, rope, dtype=torch.bfloat16)
    sin = torch.randn(tokens, rope, dtype=torch.bfloat16)
    h = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=True)

    def step():
        with kernels.using("accelerator"):
            out, aux = layer(h, cos, sin)
            loss = out.float().sum()
            (loss + aux if aux is not None else loss).backward()
        _drop_grads(layer, h)

    mlp = layer.mlp
    parts = {"attention": [layer.self_attn], "router": [mlp.gate], "experts": [mlp.experts], "dispatch": [mlp],
             "norms+residual": [layer.input_layernorm, layer.post_attention_layernorm]}
    if mlp.shared_experts is not None:
        parts["shared"] = [mlp.shared_experts]
    return layer, step, parts


# ----------------------------------------------------------------------------- counting by part

class PartCounter(OpCounter):
    """bench.kernel_proxy's kernel count, split by the part of the layer that launched each kernel: the
    forward's by the module running (hooks), the backward's by the autograd node running, mapped back
    to the module that created it through the nodes' sequence numbers.

    `timing`: instead, every aten op the CPU runs (views included) and the wall time since the previous
    one ended (the Python between them and the op itself) are booked to the op's part; the counter's own
    bookkeeping and the hooks' marks are kept out of the clock."""

    def __init__(self, timing: bool = False):
        super().__init__()
        self.timing = timing
        self.by_part: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.last = time.perf_counter()
        self.stack = ["norms+residual"]
        self.marks: list[tuple[int, str]] = []  # (first sequence number, part) in forward order

    def _sequence_nr(self) -> int:
        with self.pause(), torch.enable_grad():
            return (torch.zeros((), requires_grad=True) * 1.0).grad_fn._sequence_nr()

    def enter(self, part: str) -> None:
        t = time.perf_counter()
        self.stack.append(part)
        self.marks.append((self._sequence_nr(), part))
        self.last += time.perf_counter() - t

    def leave(self) -> None:
        t = time.perf_counter()
        self.stack.pop()
        self.marks.append((self._sequence_nr(), self.stack[-1]))
        self.last += time.perf_counter() - t

    def part_now(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:
            return self.stack[-1]
        seq = node._sequence_nr()
        if seq >= 2 ** 63 - 1 or node.name() == "torch::autograd::AccumulateGrad":
            return "param grads"
        starts = [s for s, _ in self.marks]
        i = bisect.bisect_right(starts, seq) - 1
        return self.marks[i][1] if i >= 0 else "norms+residual"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        if self.timing:
            t = time.perf_counter()
            part = self.part_now()
            self.seconds[part] += t - self.last
            self.by_part[part] += 1
            self.last = time.perf_counter()
            return out
        if func.is_view or func in NO_KERNEL:
            return out
        self.by_part[self.part_now()] += 1
        if func in GEMMS:
            self.gemm["calls"] += 1
        else:
            ins, outs = tensors_in(list(args) + list(kwargs.values())), tensors_in(out)
            super().record(func.__name__, ins, outs)
        return out

    def record(self, name, ins, outs) -> None:  # rms_norm booked as one kernel (FusedAsOnCuda)
        self.by_part[self.part_now()] += 1
        super().record(name, ins, outs)

    def record_sdpa(self, ins, outs, flops) -> None:
        self.by_part[self.part_now()] += 1
        super().record_sdpa(ins, outs, flops)

    def kernels(self) -> int:
        return self.ops + self.gemm["calls"] + self.sdpa["calls"]


def count_by_part(step, parts: dict[str, list], timing_iters: int = 20) -> dict:
    """One forward + backward of `step` under the part counter: kernels in all and by part; then
    `timing_iters` more under the timing counter: the CPU's aten ops by part and the share of the host
    time each part takes."""
    counter = _hooked(step, parts, PartCounter(), as_cuda=True)
    timer = PartCounter(timing=True)
    for _ in range(timing_iters):
        _hooked(step, parts, timer, as_cuda=False)
    total = sum(timer.seconds.values())
    return {"kernels": counter.kernels(), "by_part": {p: counter.by_part.get(p, 0) for p in PARTS},
            "gemm_calls": counter.gemm["calls"], "sdpa_calls": counter.sdpa["calls"],
            "cpu_ops": sum(timer.by_part.values()) // timing_iters,
            "cpu_ops_by_part": {p: timer.by_part.get(p, 0) // timing_iters for p in PARTS},
            "time_share_by_part": {p: timer.seconds.get(p, 0.0) / total for p in PARTS},
            "timed_us": total / timing_iters * 1e6}


def _hooked(step, parts: dict[str, list], counter: PartCounter, as_cuda: bool) -> PartCounter:
    """Runs `step` once under `counter`, each part's modules marking where it starts and ends."""
    counter.stack, counter.marks = ["norms+residual"], []
    handles = []
    # innermost first wins: a module's own part is entered after its parents' (hooks run per module)
    for part, modules in parts.items():
        for m in modules:
            handles.append(m.register_forward_pre_hook(lambda mod, args, p=part: counter.enter(p)))
            handles.append(m.register_forward_hook(lambda mod, args, out: counter.leave()))
    try:
        with (FusedAsOnCuda(counter) if as_cuda else contextlib.nullcontext()), counter:
            counter.last = time.perf_counter()
            step()
    finally:
        for h in handles:
            h.remove()
    return counter


# ----------------------------------------------------------------------------- timing

def time_rounds(steps: dict, rounds: int, iters: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds per forward + backward of each case, one figure per round, the cases alternating."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    out: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            out[name].append((time.perf_counter() - t0) / iters)
    return out


def _spread(xs: list[float]) -> tuple[float, float, float]:
    """The lower quartile, median and upper quartile."""
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def run(rounds: int, iters: int, tokens: int, threads: int = 1, step_blocks: int = 5) -> dict:
    """The counts, then `step_blocks` blocks, each one run of our whole step (our_step_on_cpu) and
    rounds / step_blocks rounds of the layers; the step over our layer in the same block is the scale
    (`step_over_layer`)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cases = {"ours": our_layer(tokens), REFERENCE: our_layer(tokens, experts=8)}
    for name, (experts, k) in MEGATRON_CASES.items():
        cases[name] = megatron_layer(experts, k, tokens)
    counts = {name: count_by_part(step, parts) for name, (_layer, step, parts) in cases.items()}
    ep2 = megatron_ep_counts(2, tokens)  # before the timing: its two processes would share the cores
    load_before = os.getloadavg()
    steps = {name: step for name, (_l, step, _p) in cases.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    step_over_layer, our_steps = [], []
    per_block = max(1, -(-rounds // max(1, step_blocks)))
    for _ in range(max(1, step_blocks)):
        step_s = our_step_on_cpu(1)[0] if step_blocks else None
        block = time_rounds(steps, per_block, iters, warmup=1)
        for name, ts in block.items():
            times[name] += ts
        if step_s is not None:
            our_steps.append(step_s)
            step_over_layer.append(step_s / statistics.median(block[REFERENCE]))
    load_after = os.getloadavg()
    ours = times[REFERENCE]
    result = {"tokens": tokens, "hidden": HIDDEN, "threads": threads, "rounds": len(ours), "iters": iters,
              "load_1min": [load_before[0], load_after[0]], "cpu": _cpu_name(), "torch": torch.__version__,
              "megatron_ep2": ep2, "our_step_s": our_steps, "step_over_layer": step_over_layer, "cases": {}}
    for name, ts in times.items():
        ratios = [t / o for t, o in zip(ts, ours)]  # per round: the same moment's load for both
        result.setdefault("ratio_range", {})[name] = [min(ratios), max(ratios)]
        result["cases"][name] = {
            "seconds": ts, "median_us": statistics.median(ts) * 1e6, "min_us": min(ts) * 1e6, "max_us": max(ts) * 1e6,
            "ratio_to_ours": _spread(ratios), "us_per_kernel": statistics.median(ts) * 1e6 / counts[name]["kernels"],
            **counts[name]}
    return result


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# ----------------------------------------------------------------------------- our whole step, for the scale

# configs/moe_bench.yaml eager on one H200 (docs/BENCHMARKS.md, First GPU run): a launch-bound step, so
# its wall time is the host's: 4 micro-batches, everything the trainer does on the host included
H200_MOE_BENCH_STEP_S = 0.197
# the same trainer and config at the layer's tiny width on the CPU, the accelerator path, one thread
STEP_OVERRIDES = [f"model.hidden_size={HIDDEN}", f"model.num_attention_heads={HEADS}", "model.q_lora_rank=32",
                  "model.kv_lora_rank=16", "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=16",
                  "model.v_head_dim=16", f"model.moe_intermediate_size={EXPERT_FFN}", "model.intermediate_size=128",
                  "model.n_routed_experts=8", "train.seq_len=16", "train.micro_batch_size=1",
                  "train.global_batch_size=4", "train.max_steps=14", "train.log_every=1", "train.compile=false",
                  "train.dtype=bf16", "train.checkpoint_every=0"]


def our_step_on_cpu(repeats: int) -> list[float]:
    """Median step time (steps 5-14) of `repeats` runs of `python -m moe_trainer.train` on
    configs/moe_bench.yaml at the tiny width (STEP_OVERRIDES), one thread, the accelerator path: the
    same host work as the H200's launch-bound step (H200_MOE_BENCH_STEP_S) with the arithmetic shrunk,
    so their ratio converts this CPU's host time into that GPU host's for this trainer's code."""
    import subprocess
    import tempfile
    env = {**os.environ, "MOE_TRAINER_KERNELS": "accelerator", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            sets = [a for kv in [*STEP_OVERRIDES, f"run.out_dir={tmp}/run"] for a in ("--set", kv)]
            subprocess.run([sys.executable, "-m", "moe_trainer.train", "--config", str(ROOT / "configs/moe_bench.yaml"),
                            *sets], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            recs = [json.loads(line) for line in (Path(tmp) / "run/metrics.jsonl").read_text().splitlines()]
            steps = [r["step_time_last_s"] for r in recs if "step_time_last_s" in r]
            out.append(statistics.median(steps[4:]))
    return out


# ----------------------------------------------------------------------------- the figure for a GPU

# the Megatron-Core runs the planner holds to published figures (plan/published.py): whatever host figure
# is read off this proxy applies to all three alike
MEGATRON_RUNS = ("configs/qwen3_235b_a22b.yaml", "configs/mixtral_8x22b.yaml", "configs/published/qwen3_30b_a3b.yaml")
# local experts per rank in the Qwen3 recipes (128 experts over EP 32 and EP 8)
QWEN3_LOCAL_EXPERTS = {"Qwen3-235B-A22B": 4, "Qwen3-30B-A3B": 16}
# the parts the recipes' fusions and graphs take off the eager path: moe_router_fusion (both), CUDA graphs
# over the router and the dispatcher's preprocessing (235B), moe_permute_fusion (both)
FUSED_OR_GRAPHED = ("router", "dispatch")


def derived(result: dict, host_eager_us: float, launch_us: float, fused_kernels: int) -> dict:
    """Megatron's host time per MoE layer on a GPU: (Megatron's CPU time / ours, per round) x our layer's
    host time on the H200, two ways: `kernel_average`, host_eager_us x our layer's kernels (the step's
    host time spread evenly over its kernels); `step_matched`, the H200's step x our layer's share of
    the same step on this CPU (`step_over_layer`). Megatron's experts as TE's grouped MLP runs them: the
    one-expert case (one module call) plus a GEMM launch at `launch_us` for each further local expert's 6
    GEMMs, forward and backward. Low: the router's and the dispatcher's share of the time taken off
    (fused or under CUDA graphs); high: all of it; high + EP: and the dispatcher's kernels at EP 2 beyond
    EP 1's, at the layer's mean cost per kernel. Each also as the planner's launch_us over the fused
    kernel count of a MoE block (`fused_kernels`)."""
    ours = result["cases"][REFERENCE]
    one = result["cases"]["megatron_e1"]
    kept = 1.0 - sum(one["time_share_by_part"][p] for p in FUSED_OR_GRAPHED)
    ep_more = result["megatron_ep2"]["kernels"] - one["kernels"]
    scales = {"kernel_average": host_eager_us * ours["kernels"]}
    if result.get("step_over_layer"):
        scales["step_matched"] = H200_MOE_BENCH_STEP_S * 1e6 / statistics.median(result["step_over_layer"])
    out = {"kept_share_low": kept, "ep_extra_kernels": ep_more, "our_layer_gpu_us": scales, "scales": {}}
    ratios = one["ratio_to_ours"]  # quartiles and median
    for scale, ours_gpu in scales.items():
        med = ratios[1] * ours_gpu
        by_run = {"one figure": {"low": med * kept, "high": med, "high + EP": med * (1 + ep_more / one["kernels"])}}
        for run_name, local in QWEN3_LOCAL_EXPERTS.items():
            extra = 6 * (local - 1) * launch_us
            by_run[run_name] = {k: v + extra for k, v in by_run["one figure"].items()}
        out["scales"][scale] = {
            "megatron_layer_us_quartiles": [r * ours_gpu for r in ratios],
            "us_per_layer": by_run,
            "launch_us": {run: {k: v / fused_kernels for k, v in d.items()} for run, d in by_run.items()}}
    return out


def calibrate_at(megatron_launch_us: list[float]) -> dict[str, list[float]]:
    """`tools/plan.py calibrate`'s estimate / published speed of every run, with the host's time per kernel
    of the Megatron-Core runs (MEGATRON_RUNS) at each of `megatron_launch_us` and every other run's figures
    as they are."""
    import dataclasses
    from ..plan import gpus, published
    from ..plan import time as time_mod
    runs = published.calibration_setups(ROOT)
    base = gpus.Efficiency()
    out: dict[str, list[float]] = {}
    for pub, setup in runs:
        row = []
        for us in [base.launch_us, *megatron_launch_us]:
            eff = dataclasses.replace(base, launch_us=us) if pub.config in MEGATRON_RUNS else base
            r = time_mod.step_time(setup, gpus.gpu_named(pub.gpu), eff, pub.mechanisms, published.imbalance_of(pub))
            est = published.estimate_in_unit(pub.unit, r.tokens_per_s_per_gpu, r.model_tflops_per_gpu, r.mfu)
            row.append(published.ratio(pub.unit, est, pub.figure))
        out[pub.name.split(" (")[0]] = row
    return out


def format_report(result: dict) -> str:
    lines = [f"CPU: {result['cpu']}, torch {result['torch']}, {result['threads']} thread(s); "
             f"{result['tokens']} tokens, hidden {result['hidden']}; {result['rounds']} alternating rounds of "
             f"{result['iters']} forward + backward each; load (1 min) {result['load_1min'][0]:.2f} before, "
             f"{result['load_1min'][1]:.2f} after", "",
             "| layer | fwd+bwd median (min-max), us | / ours_e8 (quartiles and median over rounds) | kernels (as on CUDA) "
             "| CPU aten ops | us per kernel |", "|---|---|---|---|---|---|"]
    for name, c in result["cases"].items():
        lo, med, hi = c["ratio_to_ours"]
        lines.append(f"| {name} | {c['median_us']:,.0f} ({c['min_us']:,.0f}-{c['max_us']:,.0f}) | "
                     f"{lo:.2f}-{med:.2f}-{hi:.2f} | {c['kernels']} | {c['cpu_ops']} | {c['us_per_kernel']:.1f} |")
    lines += ["", "By part: kernels as on CUDA / share of the host time (dispatch-mode timer)", "",
              "| layer | " + " | ".join(PARTS) + " |", "|---" * (1 + len(PARTS)) + "|"]
    for name, c in result["cases"].items():
        lines.append(f"| {name} | " + " | ".join(f"{c['by_part'][p]} / {c['time_share_by_part'][p]:.0%}"
                                                for p in PARTS) + " |")
    ep2 = result["megatron_ep2"]
    lines += ["", f"megatron at EP 2 (rank 0 of two gloo processes, one local expert): {ep2['kernels']} kernels, "
              + ", ".join(f"{p} {n}" for p, n in ep2["by_part"].items() if n)]
    return "\n".join(lines)


def format_derived(result: dict) -> str:
    d = result["derived"]
    lines = ["", f"Our whole step on this CPU: {', '.join(f'{x:.3f}' for x in result.get('our_step_s', []))} s "
             f"(median of steps 5-14 per run; the H200: {H200_MOE_BENCH_STEP_S} s); step / our layer per block: "
             + ", ".join(f"{x:.1f}" for x in result.get("step_over_layer", [])),
             f"Router + dispatch share of Megatron's one-expert layer (off in the low figures): "
             f"{1 - d['kept_share_low']:.0%}; its dispatcher's extra kernels at EP 2: {d['ep_extra_kernels']}", "",
             "| scale | our layer on the H200, ms | Megatron's layer, ms (quartiles) | figure | low, ms | high, ms "
             "| high + EP, ms | as launch_us (low / high / high + EP) |", "|---" * 8 + "|"]
    for scale, sd in d["scales"].items():
        q = sd["megatron_layer_us_quartiles"]
        for run, v in sd["us_per_layer"].items():
            lu = sd["launch_us"][run]
            lines.append(f"| {scale} | {d['our_layer_gpu_us'][scale] / 1e3:.2f} | "
                         f"{q[0] / 1e3:.2f} / {q[1] / 1e3:.2f} / {q[2] / 1e3:.2f} | {run} | {v['low'] / 1e3:.2f} | "
                         f"{v['high'] / 1e3:.2f} | {v['high + EP'] / 1e3:.2f} | "
                         f"{lu['low']:.1f} / {lu['high']:.1f} / {lu['high + EP']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--step-blocks", type=int, default=5,
                   help="runs of our whole step on the CPU, each followed by its share of the rounds (0: none)")
    p.add_argument("--out", default=None, help="write the figures as JSON")
    args = p.parse_args(argv)
    result = run(args.rounds, args.iters, args.tokens, args.threads, args.step_blocks)
    from ..plan.gpus import Efficiency
    from ..plan.work import KERNELS
    eff = Efficiency()
    d = derived(result, eff.host_eager_us, eff.launch_us, KERNELS[("moe", "compiled")])
    result["derived"] = d
    print(format_report(result))
    print(format_derived(result))
    points = {f"{scale.split('_')[0]}: {run.split('-')[-1] if run != 'one figure' else run}, {k}": v
              for scale, sd in d["scales"].items() for run, kv in sd["launch_us"].items() for k, v in kv.items()}
    table = calibrate_at(list(points.values()))
    result["calibrate"] = {"megatron_launch_us": {"sourced": eff.launch_us, **points}, "ratios": table}
    print("\ncalibrate's estimate / published speed with launch_us of the Megatron-Core runs (Qwen3-235B, "
          "Mixtral, Qwen3-30B) at each figure, medians; the other runs' figures unchanged:\n")
    # one row per figure, one column per run (the transposed table reads better with many figures)
    names = list(table)
    print("| figure | launch_us | " + " | ".join(names) + " |\n" + "|---" * (2 + len(names)) + "|")
    for i, (label, us) in enumerate({"sourced": eff.launch_us, **points}.items()):
        print(f"| {label} | {us:.1f} | " + " | ".join(f"{table[n][i]:.2f}" for n in names) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
