"""Pipeline parallelism: stage partition, the 1F1B step order, the stage module,
and the executor that runs one optimizer step through a DeepSpeed ZeRO-1 engine.

Why our own executor and not DeepSpeed's PipelineEngine: each stage holds
MoE layers with expert-parallel groups inside the stage, auxiliary losses are
born on every stage, multi-token prediction on the last stage needs the
token embeddings of the first, and the balancing bias is updated after the
step. The executor keeps DeepSpeed's engine for ZeRO-1: every backward goes
through `engine.backward`, every micro-batch ends with `engine.step()`, so the
optimizer steps at the accumulation boundary exactly as without a pipeline. With
v chunks per rank (interleaved 1F1B, `parallel.virtual_stages`) a micro-batch has
v backwards on a rank, and step() follows each micro-batch's chunk-0 backward.
No backward is the accumulation boundary (DeepSpeed would reduce the gradients in
it, before its input gradient leaves for the stage before): the boundary is set
after the step's last send, for `engine.allreduce_gradients()` and the last step().

Stages exchange one tensor per micro-batch: the hidden states, with the token
embeddings concatenated along the last dimension when MTP is on (the last
stage then reads Emb(t_{i+k}) from them, and their gradient flows back to the
embedding on the first stage: no weight is duplicated across stages).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..metrics import StepClock
from ..models.lm import LMOutput, add_aux
from .comm import shm_transport
from .p2p import PeerExchange, chunk_peers, comm_plan
from .surrogate import backward_surrogate, reduce_after_backwards

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
    """Global layer ids of every virtual stage (pp * virtual_stages of them, in model order):
    `parallel.pp_partition` if set, else cost-balanced over all of them. Rank s runs virtual
    stages s, s + pp, s + 2 pp, ... (`rank_chunks`)."""
    m, p = cfg.model, cfg.parallel
    sizes = p.pp_partition
    if sizes is None:
        costs = layer_costs(m, seq_len)
        head = 2.0 * m.hidden_size * m.vocab_size * (1 + m.num_nextn_predict_layers)
        mtp = m.num_nextn_predict_layers * (max(costs) + 4.0 * m.hidden_size ** 2) if m.arch == "deepseek_v3" else 0
        sizes = partition(costs, p.pp * p.virtual_stages, first_extra=0.0, last_extra=head + mtp)
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_chunks(virtual: list, stage: int, stages: int) -> list:
    """The chunks of pipeline rank `stage`: virtual stages stage, stage + stages, ... (Megatron's
    interleaved assignment: consecutive chunks of one rank are `stages` virtual stages apart)."""
    return virtual[stage::stages]


# ----------------------------------------------------------------------------- schedules (pure)

Op = tuple[str, int, int]  # ("F" | "B", micro-batch index, chunk index on this rank)


def one_f_one_b(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Op]:
    """PipeDream-flush 1F1B order of one stage (interleaved when chunks > 1).

    warm-up:   stages - stage - 1 forwards (at most m), filling the pipe;
    steady:    one forward then one backward, m - warm-up times;
    cool-down: the remaining backwards.
    The oldest micro-batch is freed first, so stage s never holds more than
    min(stages - s, m) micro-batches' activations.
    """
    if chunks > 1:
        return interleaved_one_f_one_b(stage, stages, micro_batches, chunks)
    warmup = min(stages - stage - 1, micro_batches)
    ops: list[Op] = [("F", i, 0) for i in range(warmup)]
    f, b = warmup, 0
    while f < micro_batches:
        ops += [("F", f, 0), ("B", b, 0)]
        f, b = f + 1, b + 1
    ops += [("B", i, 0) for i in range(b, micro_batches)]
    return ops


def virtual_op(kind: str, k: int, stages: int, chunks: int) -> Op:
    """The k-th forward (or backward) of a rank under the interleaved order (Megatron-Core's
    mapping): micro-batches go through in groups of `stages`; a group passes chunk 0, 1, ...,
    v-1 forwards and v-1, ..., 0 backwards before the next group.  (m must be a multiple of p.)"""
    group, within = divmod(k, stages * chunks)
    chunk = within // stages
    micro = group * stages + within % stages
    return kind, micro, (chunk if kind == "F" else chunks - 1 - chunk)


def interleaved_warmup(stage: int, stages: int, micro_batches: int, chunks: int) -> int:
    """Forwards before the first backward. With m == p every forward (as Megatron-Core: a steady
    state there would need the pair's receives before sends its neighbours wait on)."""
    total = micro_batches * chunks
    if micro_batches == stages:
        return total
    return min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)


def interleaved_one_f_one_b(stage: int, stages: int, micro_batches: int, chunks: int) -> list[Op]:
    """Interleaved 1F1B (Narayanan et al. 2021; Megatron-Core) of one rank holding `chunks` chunks.

    warm-up:   2 (stages - stage - 1) + (chunks - 1) stages forwards (at most v m): the pipe filled
               once per chunk, plus what the ranks below need to start their steady state;
    steady:    one forward then one backward of the chunks, in the order virtual_op gives;
    cool-down: the remaining backwards.
    Each chunk's forward is 1/v of a stage's, so the bubble shrinks to (p-1)/(v m + p-1); a rank
    holds up to warm-up + 1 chunk activations (stage 0: (v p + p - 1) / v micro-batches' worth)."""
    total = micro_batches * chunks
    warmup = interleaved_warmup(stage, stages, micro_batches, chunks)
    ops = [virtual_op("F", k, stages, chunks) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [virtual_op("F", warmup + k, stages, chunks), virtual_op("B", k, stages, chunks)]
    ops += [virtual_op("B", k, stages, chunks) for k in range(total - warmup, total)]
    return ops


def gpipe(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Op]:
    """All forwards, then all backwards (the reference order: m micro-batches in flight), the
    chunks in the interleaved order's sequence."""
    total = micro_batches * chunks
    return forward_only(stage, stages, micro_batches, chunks) + \
        [virtual_op("B", k, stages, chunks) for k in range(total)]


def forward_only(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Op]:
    """Evaluation: every forward, in the interleaved order's sequence (plain order when chunks == 1)."""
    return [virtual_op("F", k, stages, chunks) for k in range(micro_batches * chunks)]


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def schedule_units(schedule: str, stage: int, stages: int, micro_batches: int, chunks: int = 1,
                   overlap: bool = False) -> list[list[Op]]:
    """The schedule's operations grouped for p2p.comm_plan: one operation per unit, except the
    interleaved 1F1B's steady state, whose forward-backward pairs are one unit each.

    overlap (parallel.overlap=a2a; resolve.check_overlap lets it run with interleaved 1F1B only,
    see overlap.py, the grouping holds for both): the steady state's units are
    (backward k, the forward after it) pairs, which the executor runs interleaved (overlap.py):
    the same operations in the same order, grouped one forward later than the interleaved units,
    because a steady forward and the backward after it may be one micro-batch's (on the last rank
    each forward's backward follows it at once) while a backward and the forward after it never
    are. Both receives come before the pair, both sends after it (tests/test_p2p.py simulates it)."""
    ops = SCHEDULES[schedule](stage, stages, micro_batches, chunks)
    if schedule == "1f1b" and overlap:
        warmup = interleaved_warmup(stage, stages, micro_batches, chunks) if chunks > 1 else \
            min(stages - stage - 1, micro_batches)
        end = len(ops) - warmup  # the cool-down: as many backwards as warm-up forwards
        if end - warmup < 4:  # fewer than two steady forwards: no pair
            return [[op] for op in ops]
        return [[op] for op in ops[:warmup + 1]] + [ops[n:n + 2] for n in range(warmup + 1, end - 1, 2)] + \
            [[op] for op in ops[end - 1:]]
    if schedule != "1f1b" or chunks == 1:
        return [[op] for op in ops]
    warmup = interleaved_warmup(stage, stages, micro_batches, chunks)
    end = len(ops) - warmup  # the cool-down: as many backwards as warm-up forwards
    return [[op] for op in ops[:warmup]] + [ops[n:n + 2] for n in range(warmup, end, 2)] + \
        [[op] for op in ops[end:]]


def peak_in_flight(ops: list[Op]) -> int:
    """Most chunk activations alive at once (forwards whose backward has not run)."""
    live = peak = 0
    for kind, *_ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def theoretical_bubble(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """(p-1)/(v m + p-1): the fill and drain of the pipe, each chunk 1/v of a stage's work."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)


# ----------------------------------------------------------------------------- the stage module

class PipelineStage(nn.Module):
    """The part of a CausalLM one pipeline rank runs: one chunk of consecutive layers, or several
    (interleaved schedule: chunk c holds virtual stage rank + c * pp). It adopts the model's own
    submodules under the same attribute names, so parameter names (and checkpoints) stay
    layout-independent: `layers.7.mlp...` on whichever rank and chunk; DeepSpeed sees one module
    per rank (ZeRO-1 over every chunk's parameters)."""

    def __init__(self, model: nn.Module, chunks: list[list[int]], first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last = first, last  # holds the model's first chunk (embedding) / last (head)
        self.chunks = [[str(i) for i in ids] for ids in chunks]
        self.carry_emb = getattr(model, "mtp", None) is not None and len(model.mtp) > 0
        if first:
            self.embed_tokens = model.embed_tokens
        self.layers = nn.ModuleDict({i: model.layers[i] for ids in self.chunks for i in ids})
        if last:
            self.norm, self.lm_head = model.norm, model.lm_head
            if self.carry_emb:
                self.mtp = model.mtp
        self.rotary = model.rotary
        marker = getattr(model, "deepspeed_moe_marker", None)
        if marker is not None and any(getattr(p, "allreduce", True) is False for p in self.parameters()):
            self.deepspeed_moe_marker = marker  # only stages that hold experts are MoE to DeepSpeed
        self._model = (model,)  # the full model's methods (rope, loss), not registered as a submodule

    def is_first(self, chunk: int) -> bool:
        return self.first and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.last and chunk == len(self.chunks) - 1

    def forward(self, carried: Optional[torch.Tensor], input_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                documents: Optional[torch.Tensor] = None, chunk: int = 0):
        """The model's first chunk: input_ids -> carried. Others: carried (B, T, d or 2d) ->
        carried, or the LMOutput on the model's last chunk. Returns (out, aux). Every stage reads
        the micro-batch itself, so positions and document ids reach each one with the tokens."""
        model = self._model[0]
        d = self.cfg.hidden_size
        if self.is_first(chunk):
            h = emb = self.embed_tokens(input_ids)
        else:
            h, emb = (carried[..., :d], carried[..., d:]) if self.carry_emb else (carried, None)
        cos, sin = model.rope(input_ids.shape[1], h.device, h.dtype, positions)
        aux = None
        for i in self.chunks[chunk]:
            h, layer_aux = self.layers[i](h, cos, sin, documents)
            aux = add_aux(aux, layer_aux)
        if not self.is_last(chunk):
            return (torch.cat([h, emb], dim=-1) if self.carry_emb else h), aux
        logits = self.lm_head(self.norm(h))
        if labels is None:
            return LMOutput(logits), None
        return model.loss(logits, labels, h, emb, aux, documents, positions), None


def build_stage(model: nn.Module, cfg, stage: int, seq_len: int) -> PipelineStage:
    if cfg.model.tie_word_embeddings:
        raise ConfigError("model.tie_word_embeddings cannot be used with parallel.pp > 1 (the embedding and the "
                          "head live on different stages); set it to false.")
    chunks = rank_chunks(stage_layers(cfg, seq_len), stage, cfg.parallel.pp)
    return PipelineStage(model, chunks, stage == 0, stage == cfg.parallel.pp - 1)


# ----------------------------------------------------------------------------- tracing and activation memory

@dataclass
class Trace:
    """Start/end times of this rank's forward, backward, send and receive events in the last step.
    They are taken as StepClock marks (CUDA events on a GPU) and turned into seconds since the
    step's start by resolve(), once the step's host sync has passed."""

    events: list = field(default_factory=list)
    enabled: bool = False
    clock: StepClock = field(default_factory=StepClock)
    origin: object = None
    marks: list = field(default_factory=list)  # (kind, micro, chunk, start mark, end mark)

    def start(self, clock: StepClock) -> None:
        self.events.clear()
        self.clock = clock
        if self.enabled:
            self.origin = clock.mark()

    def record(self, kind: str, micro: int, t0, t1, chunk: int = 0) -> None:
        if self.enabled:
            self.marks.append((kind, micro, chunk, t0, t1))

    def resolve(self) -> None:
        """The recorded marks as events (call after the step's host sync)."""
        seconds = self.clock.seconds
        self.events += [{"kind": kind, "micro": micro, "chunk": chunk, "start": seconds(self.origin, t0),
                         "end": seconds(self.origin, t1)} for kind, micro, chunk, t0, t1 in self.marks]
        self.marks.clear()


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


# ----------------------------------------------------------------------------- the backward surrogate

# ----------------------------------------------------------------------------- the executor

@dataclass
class StepResult:
    losses: dict  # summed over micro-batches on this stage (detached)
    # StepClock mark pairs of this stage's forwards, backwards and waits for receives (on a GPU: the
    # compute stream waiting for the transfers), read once the step's host sync has passed
    spans: dict = field(default_factory=lambda: {"forward": [], "backward": [], "wait": []})

    def seconds(self, clock: StepClock, kind: str) -> float:
        return sum(clock.seconds(a, b) for a, b in self.spans[kind])


class PipelineExecutor:
    """Runs one optimizer step of one pipeline rank: the schedule's forwards and backwards of its
    chunks, and the point-to-point transfers with the ranks before and after each chunk, batched
    as p2p.comm_plan says (NCCL-safe)."""

    def __init__(self, engine, stage: PipelineStage, mesh, micro_batches: int, carried_shape: tuple,
                 dtype: torch.dtype, device: torch.device, schedule: str = "1f1b", trace: Optional[Trace] = None,
                 meter: Optional[ActivationMeter] = None, counter=None, clock: Optional[StepClock] = None,
                 overlap: Optional[tuple] = None, before_reduce: Optional[Callable[[], None]] = None):
        """overlap: (EP group, parallel.recompute) for parallel.overlap=a2a: each steady (backward,
        forward) pair runs interleaved at sub-layer granularity (overlap.StagedPair), each all-to-all
        of one in flight while the other computes; warm-up and cool-down run as before.
        before_reduce: run after the step's last backward, before the gradient reduction (the redundant
        slots' gradients to their owners: slots.SlotExperts.hand_back)."""
        if getattr(getattr(engine, "optimizer", None), "overlap_comm", False):
            # with it ZeRO-1 reduces in its gradient hooks during a boundary backward only, and then
            # allreduce_gradients (reduce_and_step, after the backwards) would reduce nothing
            raise ValueError("the pipeline executor needs ZeRO's overlap_comm off (zero.py never sets it)")
        self.engine, self.stage, self.mesh = engine, stage, mesh
        self.before_reduce = before_reduce
        self.clock = clock or StepClock(device)
        self.m = micro_batches
        self.v = len(stage.chunks)
        pp, s = mesh.layout.pp, mesh.coord["pp"]
        self.pp, self.s = pp, s
        self.units = schedule_units(schedule, s, pp, micro_batches, self.v, overlap=overlap is not None)
        self.pair = None
        if overlap is not None:
            from .overlap import StagedPair
            from .overlap_model import chunk_stage_functions
            if meter is not None:
                raise ValueError("the activation meter's hooks cannot follow two interleaved micro-batches")
            self.pair = StagedPair(engine, micro_batches, overlap[0], counter, self.clock)
            self.pieces = [chunk_stage_functions(stage, c, overlap[1]) for c in range(self.v)]
        self.ops = [op for unit in self.units for op in unit]
        self.boundary = [op for op in self.ops if op[0] == "B"][-1]  # the last backward: reduce_and_step steps for it
        self.peers = chunk_peers(s, pp, self.v, mesh.members["pp"])
        self.trace = trace or Trace()
        self.meter = meter
        # CPU ranks of one host: through the pipeline group's shared-memory rings when it has them
        self.exchange = PeerExchange(carried_shape, dtype, device, counter, self.trace.record, self.clock,
                                     transport=shm_transport(mesh.group("pp")), ranks=mesh.members["pp"])
        self.poison = False  # fault drill: make this step's loss NaN on the last stage

    def _run(self, units: list, run_op: Callable, res: Optional[StepResult] = None,
             run_pair: Optional[Callable] = None) -> None:
        """The units' operations in order, each after its batch of transfers; run_op(op, received) ->
        {(kind, micro, chunk): tensor} to send. run_pair(unit, received), if given, runs the units of
        two operations instead (their second operation's batch is empty: comm_plan)."""
        received, outgoing = {}, {}
        pairs = {unit[0]: unit for unit in units if len(unit) == 2} if run_pair is not None else {}
        second = {unit[1] for unit in pairs.values()}
        for batch, op in comm_plan(units, self.peers):
            t = self.clock.mark()
            received.update(self.exchange.run(batch, outgoing))
            if res is not None and any(not tr.send for tr in batch):
                res.spans["wait"].append((t, self.clock.mark()))
            if op in pairs:
                outgoing.update(run_pair(pairs[op], received))
            elif op is not None and op not in second:
                outgoing.update(run_op(op, received))

    def step(self, get_batch: Callable[[int], tuple]) -> StepResult:
        """get_batch(i) -> (input_ids, labels, positions[, documents]) of micro-batch i; what follows
        the labels goes to the stage as it is."""
        if self.pair is not None:
            return self._step_overlapped(get_batch)
        res = StepResult(losses={})
        saved: dict[tuple, tuple] = {}

        def run_op(op, received):
            kind, i, c = op
            if kind == "F":
                return self._forward(i, c, get_batch, received.pop(("act", i, c), None), saved, res)
            # no backward is DeepSpeed's accumulation boundary (whose epilogue would reduce the gradients
            # before this backward's input gradient leaves): every one only accumulates, see reduce_and_step
            self.engine.set_gradient_accumulation_boundary(False)
            out = self._backward(i, c, received.pop(("grad", i, c), None), saved, res)
            if c == 0 and op != self.boundary:  # a micro-batch's last backward on this rank: one step() each
                self.engine.step()
            return out

        self._run(self.units, run_op, res)
        self.reduce_and_step()
        return res

    def _step_overlapped(self, get_batch: Callable[[int], tuple]) -> StepResult:
        """step() under parallel.overlap=a2a: every operation through the chunk's stages
        (overlap_model), a pair's two interleaved, a lone one alone; the same engine calls."""
        res = StepResult(losses={})
        saved: dict[tuple, list] = {}

        def run_pair(unit, received):
            sends: dict = {}
            # the forward resumes first, as at pp = 1 (every EP rank of the stage issues the same order)
            self.pair._run(*[self._forward_staged(op, get_batch, received, saved, res, sends) for op in unit
                             if op[0] == "F"], *[self._backward_staged(op, received, saved, res, sends)
                                                 for op in unit if op[0] == "B"])
            for op in unit:
                if op[0] == "B" and op[2] == 0 and op != self.boundary:  # one step() per micro-batch, as step()
                    self.engine.step()
            return sends

        self._run(self.units, lambda op, received: run_pair([op], received), res, run_pair)
        self.reduce_and_step()
        return res

    def _forward_staged(self, op, get_batch, received, saved, res, sends):
        """Generator: forward `op` stage by stage (yields with an all-to-all in flight); its record in
        `saved`, its activations in `sends`, its losses in `res`, as _forward."""
        _, i, c = op
        ids, labels, *rest = get_batch(i)
        carried = received.pop(("act", i, c), None)
        if carried is not None:
            carried.requires_grad_()
        inputs = {"carried": carried, "input_ids": ids, "labels": labels,
                  "positions": rest[0] if rest else None, "documents": rest[1] if len(rest) > 1 else None}
        records: list = []
        n = len(res.spans["forward"])
        yield from self.pair._timed(self.pair._forward(inputs, records, self.pieces[c]), res.spans["forward"])
        for t0, t1 in res.spans["forward"][n:]:
            self.trace.record("forward", i, t0, t1, c)
        out = records[-1]
        saved[(i, c)] = records
        if self.stage.is_last(c):
            if self.poison:
                out.loss, out.losses = out.loss * float("nan"), {k: v * float("nan") for k, v in out.losses.items()}
            for k, v in out.losses.items():
                res.losses[k] = res.losses.get(k, 0.0) + v.float()
            return
        aux = records[-2].outputs["aux"]
        if aux is not None:
            res.losses["aux"] = res.losses.get("aux", 0.0) + aux.detach().float()
        sends[("act", i, c)] = out.detach()

    def _backward_staged(self, op, received, saved, res, sends):
        """Generator: backward `op` stage by stage in reverse (yields with a gradient all-to-all in
        flight); its input gradient in `sends`, as _backward."""
        _, i, c = op
        grads: dict = {}
        n = len(res.spans["backward"])
        yield from self.pair._timed(self.pair._backward(saved.pop((i, c)), received.pop(("grad", i, c), None), grads),
                                    res.spans["backward"])
        for t0, t1 in res.spans["backward"][n:]:
            self.trace.record("backward", i, t0, t1, c)
        if not self.stage.is_first(c):
            sends[("grad", i, c)] = grads[("carried", 0)]

    def reduce_and_step(self) -> None:
        """The step's gradient reduction (ZeRO-1's, over the data-parallel group) and the optimizer step,
        once _run has posted the final sends. Reducing first would add each stage's reduction to the
        drain (stage s - 1 waits for stage s's last input gradient, s - 2 for s - 1's, ...); after its
        send a stage reduces while the stages before it still run their last backwards. The optimizer
        step comes last: its gradient norm is a collective over every stage."""
        t0 = self.clock.mark()
        reduce_after_backwards(self.engine, self.before_reduce)
        _, i, c = self.boundary
        self.trace.record("reduce", i, t0, self.clock.mark(), c)
        self.engine.step()

    def _forward(self, i, c, get_batch, carried, saved, res) -> dict:
        inputs, labels, *rest = get_batch(i)  # rest: positions, and document ids when the batch has them
        last = self.stage.is_last(c)
        if carried is not None:
            carried.requires_grad_()
        t0 = self.clock.mark()
        ctx = self.meter.hooks() if self.meter else contextlib.nullcontext()
        with ctx:
            out, aux = self.engine(carried, inputs, labels if last else None, *rest, chunk=c)
        t1 = self.clock.mark()
        self.trace.record("forward", i, t0, t1, c)
        res.spans["forward"].append((t0, t1))
        if last:
            loss = out.loss * float("nan") if self.poison else out.loss
            for k, v in out.losses.items():
                res.losses[k] = res.losses.get(k, 0.0) + (v.float() * float("nan") if self.poison else v.float())
            saved[(i, c)] = (carried, loss, None)
            return {}
        if aux is not None:
            res.losses["aux"] = res.losses.get("aux", 0.0) + aux.detach().float()
        saved[(i, c)] = (carried, out, aux)
        return {("act", i, c): out.detach()}

    def _backward(self, i, c, grad, saved, res) -> dict:
        carried, out, aux = saved.pop((i, c))
        t0 = self.clock.mark()
        if self.stage.is_last(c):
            self.engine.backward(out)
        else:
            # grad already carries the 1/GAS of the last stage's loss: no scaling by the engine
            self.engine.backward(backward_surrogate(out, grad, aux, self.m), scale_wrt_gas=False)
        t1 = self.clock.mark()
        self.trace.record("backward", i, t0, t1, c)
        res.spans["backward"].append((t0, t1))
        return {} if self.stage.is_first(c) else {("grad", i, c): carried.grad}

    @torch.no_grad()
    def forward_only(self, get_batch) -> dict:
        """Evaluation: every micro-batch through the stages, no backward."""
        losses: dict = {}
        module = self.engine.module

        def run_op(op, received):
            _, i, c = op
            inputs, labels, *rest = get_batch(i)
            last = self.stage.is_last(c)
            out, _ = module(received.pop(("act", i, c), None), inputs, labels if last else None, *rest, chunk=c)
            if last:
                losses["lm"] = losses.get("lm", 0.0) + out.losses["lm"].float()
                return {}
            return {("act", i, c): out}

        self._run([[op] for op in forward_only(self.s, self.pp, self.m, self.v)], run_op)
        return losses
