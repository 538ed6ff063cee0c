"""Pipeline parallelism: stage partition, the 1F1B step order, the stage module,
and the executor that runs one optimizer step through a DeepSpeed ZeRO-1 engine.

Why our own executor and not DeepSpeed's PipelineEngine: each stage holds
MoE layers with expert-parallel groups inside the stage, auxiliary losses are
born on every stage, multi-token prediction on the last stage needs the
token embeddings of the first, and the balancing bias is updated after the
step. The executor keeps DeepSpeed's engine for ZeRO-1: every backward goes
through `engine.backward`, every micro-batch ends with `engine.step()`, so the
optimizer steps at the accumulation boundary exactly as without a pipeline.

Stages exchange one tensor per micro-batch: the hidden states, with the token
embeddings concatenated along the last dimension when MTP is on (the last
stage then reads Emb(t_{i+k}) from them, and their gradient flows back to the
embedding on the first stage: no weight is duplicated across stages).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..models.lm import LMOutput, add_aux
from .p2p import PeerExchange, comm_plan

# ----------------------------------------------------------------------------- partition (pure)


def layer_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Relative forward cost of each decoder layer (FLOPs per token)."""
    from ..metrics import attention_flops_per_token, attention_proj_params
    d = cfg.hidden_size
    mtp = cfg.num_nextn_predict_layers if cfg.arch == "deepseek_v3" else 0
    core = attention_flops_per_token(cfg, seq_len) / (cfg.num_hidden_layers + mtp)  # scores + values
    attn = 2.0 * attention_proj_params(cfg) + core
    dense = 6.0 * d * cfg.intermediate_size
    moe = 6.0 * d * cfg.moe_intermediate_size * (cfg.n_shared_experts + cfg.num_experts_per_tok) + \
        2.0 * d * cfg.n_routed_experts
    is_moe = [cfg.arch == "deepseek_v3" and i >= cfg.first_k_dense_replace for i in range(cfg.num_hidden_layers)]
    return [attn + (moe if m else dense) for m in is_moe]


def partition(costs: list[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Contiguous split of layers into `stages` non-empty stages minimising the
    most expensive stage (the pipeline's pace); the first stage also pays
    `first_extra` (embedding), the last `last_extra` (head, loss, MTP).
    Returns layers per stage. Exact dynamic programme, O(stages * n^2)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, lo: int, hi: int) -> float:  # stage s holds layers [lo, hi)
        return prefix[hi] - prefix[lo] + (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][i]: first i layers in s stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], cost(s - 1, j, i))
                if v < best[s][i] - 1e-9:
                    best[s][i], cut[s][i] = v, j
    sizes, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def stage_layers(cfg, seq_len: int) -> list[list[int]]:
    """Global layer ids of every stage: `parallel.pp_partition` if set, else cost-balanced."""
    m, pp = cfg.model, cfg.parallel.pp
    sizes = cfg.parallel.pp_partition
    if sizes is None:
        costs = layer_costs(m, seq_len)
        head = 2.0 * m.hidden_size * m.vocab_size * (1 + m.num_nextn_predict_layers)
        mtp = m.num_nextn_predict_layers * (max(costs) + 4.0 * m.hidden_size ** 2) if m.arch == "deepseek_v3" else 0
        sizes = partition(costs, pp, first_extra=0.0, last_extra=head + mtp)
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


# ----------------------------------------------------------------------------- schedules (pure)

Op = tuple[str, int]  # ("F" | "B", micro-batch index)


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Op]:
    """PipeDream-flush 1F1B order of one stage.

    warm-up:   stages - stage - 1 forwards (at most m), filling the pipe;
    steady:    one forward then one backward, m - warm-up times;
    cool-down: the remaining backwards.
    The oldest micro-batch is freed first, so stage s never holds more than
    min(stages - s, m) micro-batches' activations.
    """
    warmup = min(stages - stage - 1, micro_batches)
    ops: list[Op] = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < micro_batches:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    ops += [("B", i) for i in range(b, micro_batches)]
    return ops


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Op]:
    """All forwards, then all backwards (the reference order: m micro-batches in flight)."""
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def peak_in_flight(ops: list[Op]) -> int:
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def theoretical_bubble(stages: int, micro_batches: int) -> float:
    return (stages - 1) / (micro_batches + stages - 1)


# ----------------------------------------------------------------------------- the stage module

class PipelineStage(nn.Module):
    """The part of a CausalLM one stage runs. It adopts the model's own
    submodules under the same attribute names, so parameter names (and
    checkpoints) stay layout-independent: `layers.7.mlp...` on whichever stage."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last = first, last
        self.carry_emb = getattr(model, "mtp", None) is not None and len(model.mtp) > 0
        if first:
            self.embed_tokens = model.embed_tokens
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        if last:
            self.norm, self.lm_head = model.norm, model.lm_head
            if self.carry_emb:
                self.mtp = model.mtp
        self.rotary = model.rotary
        marker = getattr(model, "deepspeed_moe_marker", None)
        if marker is not None and any(getattr(p, "allreduce", True) is False for p in self.parameters()):
            self.deepspeed_moe_marker = marker  # only stages that hold experts are MoE to DeepSpeed
        self._model = (model,)  # the full model's methods (rope, loss), not registered as a submodule

    def forward(self, carried: Optional[torch.Tensor], input_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None):
        """First stage: input_ids -> carried. Others: carried (B, T, d or 2d) ->
        carried, or the LMOutput on the last stage. Returns (out, aux)."""
        model = self._model[0]
        d = self.cfg.hidden_size
        if self.first:
            h = emb = self.embed_tokens(input_ids)
        else:
            h, emb = (carried[..., :d], carried[..., d:]) if self.carry_emb else (carried, None)
        cos, sin = model.rope(input_ids.shape[1], h.device, h.dtype, positions)
        aux = None
        for layer in self.layers.values():
            h, layer_aux = layer(h, cos, sin)
            aux = add_aux(aux, layer_aux)
        if not self.last:
            return (torch.cat([h, emb], dim=-1) if self.carry_emb else h), aux
        logits = self.lm_head(self.norm(h))
        if labels is None:
            return LMOutput(logits), None
        return model.loss(logits, labels, h, emb, aux), None


def build_stage(model: nn.Module, cfg, stage: int, seq_len: int) -> PipelineStage:
    if cfg.model.tie_word_embeddings:
        raise ConfigError("model.tie_word_embeddings cannot be used with parallel.pp > 1 (the embedding and the "
                          "head live on different stages); set it to false.")
    layers = stage_layers(cfg, seq_len)
    return PipelineStage(model, layers[stage], stage == 0, stage == cfg.parallel.pp - 1)


# ----------------------------------------------------------------------------- tracing and activation memory

@dataclass
class Trace:
    """Start/end times of this rank's forward, backward, send and receive events."""

    events: list = field(default_factory=list)
    origin: float = 0.0
    enabled: bool = False

    def start(self) -> None:
        self.origin = time.perf_counter()

    def record(self, kind: str, micro: int, t0: float, t1: float) -> None:
        if self.enabled:
            self.events.append({"kind": kind, "micro": micro, "start": t0 - self.origin, "end": t1 - self.origin})


class ActivationMeter:
    """Bytes of tensors saved for backward that are alive, via saved-tensor hooks
    (device-independent). Parameters are not activations and are skipped."""

    def __init__(self, module: nn.Module):
        self.param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.live = 0
        self.peak = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.param_storages:
            return t
        holder = _Saved(t)
        nbytes = t.numel() * t.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._release, nbytes)
        return holder

    @staticmethod
    def unpack(obj):
        return obj.t if isinstance(obj, _Saved) else obj

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


# ----------------------------------------------------------------------------- the executor

@dataclass
class StepResult:
    losses: dict  # summed over micro-batches on this stage (detached)
    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0  # blocked in receives


class PipelineExecutor:
    """Runs one optimizer step of one stage: the schedule's forwards and backwards, and the
    point-to-point transfers with its neighbours, batched as p2p.comm_plan says (NCCL-safe)."""

    def __init__(self, engine, stage: PipelineStage, mesh, micro_batches: int, carried_shape: tuple,
                 dtype: torch.dtype, device: torch.device, schedule: str = "1f1b", trace: Optional[Trace] = None,
                 meter: Optional[ActivationMeter] = None, counter=None):
        self.engine, self.stage, self.mesh = engine, stage, mesh
        self.m = micro_batches
        pp, s = mesh.layout.pp, mesh.coord["pp"]
        self.ops = SCHEDULES[schedule](s, pp, micro_batches)
        ranks = mesh.members["pp"]
        self.prev = ranks[s - 1] if s > 0 else None
        self.next = ranks[s + 1] if s < pp - 1 else None
        self.trace = trace or Trace()
        self.meter = meter
        self.exchange = PeerExchange(carried_shape, dtype, device, counter, self.trace.record)
        self.poison = False  # fault drill: make this step's loss NaN on the last stage

    def _run(self, ops: list, run_op: Callable, res: Optional[StepResult] = None) -> None:
        """ops in order, each after its batch of transfers; run_op(op, received) -> {(kind, micro): tensor}
        to send."""
        received, outgoing = {}, {}
        for batch, op in comm_plan(ops, self.prev, self.next):
            t = time.perf_counter()
            received.update(self.exchange.run(batch, outgoing))
            if res is not None and any(not tr.send for tr in batch):
                res.wait_s += time.perf_counter() - t
            if op is not None:
                outgoing.update(run_op(op, received))

    def step(self, get_batch: Callable[[int], tuple]) -> StepResult:
        """get_batch(i) -> (input_ids, labels, positions) of micro-batch i."""
        res = StepResult(losses={})
        saved: dict[int, tuple] = {}

        def run_op(op, received):
            kind, i = op
            if kind == "F":
                return self._forward(i, get_batch, received.pop(("act", i), None), saved, res)
            return self._backward(i, received.pop(("grad", i), None), saved, res)

        self._run(self.ops, run_op, res)
        # the accumulation boundary: the optimizer step all-reduces the gradient norm over every
        # stage, so it comes after the step's last transfers were posted (a collective between
        # the last backward and its send would wait for a stage that waits for that send)
        self.engine.step()
        return res

    def _forward(self, i, get_batch, carried, saved, res) -> dict:
        inputs, labels, positions = get_batch(i)
        if carried is not None:
            carried.requires_grad_()
        t0 = time.perf_counter()
        ctx = self.meter.hooks() if self.meter else contextlib.nullcontext()
        with ctx:
            out, aux = self.engine(carried, inputs, labels if self.stage.last else None, positions)
        t1 = time.perf_counter()
        self.trace.record("forward", i, t0, t1)
        res.forward_s += t1 - t0
        if self.stage.last:
            loss = out.loss * float("nan") if self.poison else out.loss
            for k, v in out.losses.items():
                res.losses[k] = res.losses.get(k, 0.0) + (v.float() * float("nan") if self.poison else v.float())
            saved[i] = (carried, loss, None)
            return {}
        if aux is not None:
            res.losses["aux"] = res.losses.get("aux", 0.0) + aux.detach().float()
        saved[i] = (carried, out, aux)
        return {("act", i): out.detach()}

    def _backward(self, i, grad, saved, res) -> dict:
        carried, out, aux = saved.pop(i)
        t0 = time.perf_counter()
        if self.stage.last:
            self.engine.backward(out)
        else:
            # d(surrogate)/d(out) = grad, which already carries the 1/GAS of the
            # last stage's loss; this stage's own aux loss gets that scale here
            surrogate = (out.float() * grad.float()).sum()
            if aux is not None:
                surrogate = surrogate + aux / self.m
            self.engine.backward(surrogate, scale_wrt_gas=False)
        t1 = time.perf_counter()
        self.trace.record("backward", i, t0, t1)
        res.backward_s += t1 - t0
        if self.ops[-1] != ("B", i):  # DeepSpeed counts micro-batches; step() ends the last one
            self.engine.step()
        return {("grad", i): carried.grad} if self.prev is not None else {}

    @torch.no_grad()
    def forward_only(self, get_batch) -> dict:
        """Evaluation: every micro-batch through the stages, no backward."""
        losses: dict = {}
        module = self.engine.module

        def run_op(op, received):
            i = op[1]
            inputs, labels, positions = get_batch(i)
            out, _ = module(received.pop(("act", i), None), inputs, labels if self.stage.last else None, positions)
            if self.stage.last:
                losses["lm"] = losses.get("lm", 0.0) + out.losses["lm"].float()
                return {}
            return {("act", i): out}

        self._run([("F", i) for i in range(self.m)], run_op)
        return losses
