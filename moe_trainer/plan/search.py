"""Layout search: every legal layout of a config on N GPUs (the trainer's own validation decides what
is legal), those that fit in the GPU's memory (the planner's memory model), ranked by the step-time
model's tokens per second per GPU.

Enumerated: tp (powers of two up to the node), cp (1, and 2..8 for sequences of 32K and more, where
it pays), pp (powers of two up to the layers), virtual stages (1, 2, 4), ep (powers of two dividing
the experts, MoE only), micro-batch size (1, 2) and recomputation (none, selective, full). The
global batch stays the config's (micro-batches per step follow from dp and the micro-batch size).
The all-to-all overlap follows the config's `parallel.overlap` as a CUDA run resolves it per layout
(resolve.check_overlap, overlap_runs): a2a overlaps every layout where the executor runs (ep > 1,
tp = cp = 1, pp 1 or interleaved) and drops the others, as the trainer refuses them; auto, the
default, overlaps there only where the run stays eager (train.compile false); none never overlaps.
An overlapped layout is planned with its memory and its mechanisms.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..config import Config, ConfigError, validate, validate_layout
from ..resolve import check_overlap, overlap_runs
from .gpus import Efficiency, Gpu
from .memory import _stage_blocks, copy_bytes, model_state_bytes, rank_params, stage_activation_bytes
from .params import GB, is_moe_layer, precision_for
from .pipeline import stage_partition
from . import replacement
from .replacement import MeasuredLoad
from .time import Mechanisms, Replacement, StepTime, step_time, trainer_mechanisms
from .work import Setup, setup_from_config


@dataclass(frozen=True)
class Candidate:
    setup: Setup  # the layout, as the step-time model read it
    peak_gb: float
    time: StepTime
    reason: str = ""
    overlap: str = "none"  # parallel.overlap as a CUDA run resolves it for this layout (its --set)
    mechanisms: Mechanisms = Mechanisms()  # what the step time was estimated under

    def label(self) -> str:
        s = self.setup
        v = f" v{s.virtual_stages}" if s.virtual_stages > 1 else ""
        o = " a2a overlap" if self.mechanisms.a2a_overlap else ""
        return (f"tp {s.tp} cp {s.cp} pp {s.pp}{v} ep {s.ep} dp {s.dp} mbs {s.micro_batch_size} "
                f"recompute {s.recompute}{o}")

    def overrides(self) -> list[str]:
        """--set overrides that give this layout to the trainer, the dry run or the planner."""
        s = self.setup
        return [f"parallel.tp={s.tp}", f"parallel.cp={s.cp}", f"parallel.pp={s.pp}",
                f"parallel.virtual_stages={s.virtual_stages}", f"parallel.ep={s.ep}",
                f"train.micro_batch_size={s.micro_batch_size}", f"parallel.recompute={s.recompute}",
                "parallel.micro_batches=0", "parallel.pp_partition=null", f"parallel.overlap={self.overlap}"]


def _powers(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _with(cfg: Config, tp, cp, pp, v, ep, mbs, recompute, overlap: str) -> Config:
    c = copy.copy(cfg)
    c.parallel = dataclasses.replace(cfg.parallel, tp=tp, cp=cp, pp=pp, virtual_stages=v, ep=ep, micro_batches=0,
                                     recompute=recompute, pp_partition=None, overlap=overlap)
    c.train = dataclasses.replace(cfg.train, micro_batch_size=mbs)
    return c


def peak_memory(cfg: Config, gpus: int, node: int, partition: list[int], zero: int = 1) -> float:
    """Bytes on the heaviest rank (model states under ZeRO + activations under the recompute), the
    layers per pipeline rank given (the trainer's split)."""
    layout = validate_layout(cfg, gpus, node)
    prec = precision_for(None, cfg.train.dtype, cfg.train.grad_accum_dtype)
    p = cfg.parallel
    worst = 0.0
    for stage, params in enumerate(rank_params(cfg.model, p, partition)):
        states = model_state_bytes(params, prec, zero, layout.dp * layout.cp, layout.edp)
        acts = stage_activation_bytes(cfg, partition, stage, layout.grad_accum, prec)
        act = acts.full_recompute if p.recompute == "full" else acts.no_recompute
        moe = sum(is_moe_layer(cfg.model, i) for i in _stage_blocks(cfg.model, partition, stage))
        copies = copy_bytes(cfg, moe, prec)  # parallel.redundant_slots
        worst = max(worst, states.total + copies.cache + max(act + copies.activations, copies.after_backward))
    return worst


def candidates(cfg: Config, gpus: int, node: int, overlap: Optional[str] = None) -> list[Config]:
    """Every layout the trainer's validation accepts, its parallel.overlap resolved for it from
    `overlap` (the config's own request, before load_config resolved it for the config's layout;
    default the config's)."""
    overlap = overlap or cfg.parallel.overlap
    m, t = cfg.model, cfg.train
    moe = m.arch == "deepseek_v3" and m.num_hidden_layers > m.first_k_dense_replace
    cps = [c for c in _powers(8) if c == 1 or t.seq_len >= 32768]
    eps = [e for e in _powers(m.n_routed_experts) if not moe and e == 1 or moe and m.n_routed_experts % e == 0]
    out = []
    for tp in _powers(node):
        for cp in cps:
            for pp in _powers(m.num_hidden_layers):
                if gpus % (tp * cp * pp):
                    continue
                for v in (1, 2, 4):
                    for ep in eps:
                        for mbs in (1, 2):
                            for rc in ("none", "selective", "full"):
                                c = _with(cfg, tp, cp, pp, v, ep, mbs, rc, overlap)
                                try:
                                    validate(c)
                                    validate_layout(c, gpus, node)
                                    check_overlap(c)
                                except ConfigError:
                                    continue
                                out.append(c)
    return out


def load_of(cfg: Config, s: Setup, gpu: Gpu, eff: Efficiency, mech: Mechanisms, imbalance: Optional[float],
            load: Optional[MeasuredLoad]) -> tuple[Optional[float], Optional[Replacement]]:
    """(the busiest EP rank's share, the re-placement's traffic) the layout `s` meets: a run's measured load
    (`load`: at home, or as the config's parallel.replace_every re-places it, each decision applied where
    the step model says it pays at this layout: replacement.at_layout, paying), else `imbalance` (None:
    uniform routing's) and no re-placement."""
    if load is None:
        return imbalance, None
    pays = replacement.paying(s, gpu, eff, mech)
    return replacement.at_layout(load, s.ep, cfg.parallel.replace_every, cfg.parallel.redundant_slots, pays)[:2]


def search(cfg: Config, gpus: int, gpu: Gpu, eff: Efficiency, mech: Mechanisms, gpu_memory_gb: float,
           imbalance: Optional[float] = None, top: int = 10,
           overlap: Optional[str] = None, load: Optional[MeasuredLoad] = None) -> tuple[list[Candidate], int, int]:
    """(the `top` fastest fitting layouts, layouts tried, layouts that fit). Each layout runs under
    `mech` with this trainer's mechanisms for its own overlap (trainer_mechanisms: the all-to-all
    paired, the weight gradients held back, compile auto eager); `mech.a2a_overlap` models the
    overlap at every layout (tools/plan.py --overlap, a what-if). With a run's `load` each layout meets
    it at its own ep (`load_of`: replayed once per ep, its decisions weighed at the first fitting layout
    of that ep)."""
    node = cfg.parallel.gpus_per_node or gpu.gpus_per_node
    found, tried = [], 0
    partitions: dict = {}  # (pp, v) -> the trainer's cost-balanced layers per rank (stage_partition)
    at_ep: dict = {}  # ep -> load_of's (share, re-placement)
    for c in candidates(cfg, gpus, node, overlap):
        tried += 1
        key = (c.parallel.pp, c.parallel.virtual_stages)
        if key not in partitions:
            partitions[key] = stage_partition(c)
        peak = peak_memory(c, gpus, node, partitions[key])
        if peak > gpu_memory_gb * GB:
            continue
        s = setup_from_config(c, gpus, gpus_per_node=node, partition=tuple(partitions[key]))
        own = layout_mechanisms(c, mech)
        if s.ep not in at_ep:
            at_ep[s.ep] = load_of(c, s, gpu, eff, own, imbalance, load)
        found.append(Candidate(s, peak / GB, step_time(s, gpu, eff, own, *at_ep[s.ep]),
                               overlap="a2a" if overlap_runs(c) else "none", mechanisms=own))
    found.sort(key=lambda x: -x.time.tokens_per_s_per_gpu)
    best = found[:top]
    return [dataclasses.replace(x, reason=_reason(x, best[i + 1] if i + 1 < len(best) else None))
            for i, x in enumerate(best)], tried, len(found)


def layout_mechanisms(c: Config, mech: Mechanisms) -> Mechanisms:
    """`mech` with this trainer's mechanisms for a layout whose parallel.overlap is resolved: paired
    all-to-alls and held-back weight gradients where it overlaps, and train.compile auto then eager."""
    own = trainer_mechanisms(c.train.compile, overlap_runs(c), mech.gemm_dtype)
    if mech.a2a_overlap and not own.a2a_overlap:
        own = trainer_mechanisms(c.train.compile, True, mech.gemm_dtype)
    return dataclasses.replace(mech, a2a_overlap=own.a2a_overlap, wgrad_split=own.wgrad_split, host=own.host,
                               fused_glue=own.fused_glue, replay_a2a=own.replay_a2a)


_PARTS = (("compute", "compute"), ("exposed_comm", "exposed communication"), ("bubble", "bubble"),
          ("optimizer", "optimizer"))


def _reason(a: Candidate, b: Optional[Candidate]) -> str:
    """What makes `a` faster than the next one down: the part of the step it saves most on."""
    if b is None:
        return "last of the list"
    ta, tb = a.time, b.time
    # per token, so layouts with other micro-batch sizes compare alike
    per = lambda t, k: getattr(t, k) / t.tokens_per_s_per_gpu / t.step  # noqa: E731  (seconds per token)
    gains = {label: per(tb, key) - per(ta, key) for key, label in _PARTS}
    label, gain = max(gains.items(), key=lambda kv: kv[1])
    if gain <= 0:
        return "ties with the next"
    return f"its {label} is shorter by {gain / per(tb, 'step'):.1%} of the next one's step"
