"""The plan and the ZeRO table as markdown."""
from __future__ import annotations

from typing import Sequence

from .layout import Plan
from .memory import ZeroRow
from .params import GB, PARTS, PRECISIONS, ParamReport
from .pipeline import bubble_fraction, in_flight


def _bubble_line(plan: Plan, pp: int, mb: int) -> str:
    """The pipeline bubble and stage 0's activations in flight, plain or interleaved (v > 1)."""
    v = plan.virtual_stages
    flight = plan.stages[0].activations.in_flight
    if v == 1:
        return (f"**Pipeline bubble** (p-1)/(m+p-1) = {pp - 1}/{mb + pp - 1} = {plan.bubble:.1%}. "
                f"In flight on stage 0: {flight} micro-batches.")
    return (f"**Pipeline bubble**, interleaved 1F1B over v = {v} chunks per rank: (p-1)/(v*m+p-1) = {pp - 1}/"
            f"{v * mb + pp - 1} = {plan.bubble:.1%} (plain 1F1B: {bubble_fraction(pp, mb):.1%}). In flight on "
            f"stage 0: {flight:g} micro-batches' worth of activations (plain 1F1B: {in_flight(0, pp, mb)}).")


# ----------------------------------------------------------------------------- reports

def fmt_count(n: float) -> str:
    """Parameter counts: 671.03B, 14.7M, 320."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def fmt_bytes(n: float) -> str:
    """Decimal byte units (GB = 1e9 bytes): 31.41 GB, 924.8 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


_PART_LABELS = {
    "embedding": "embedding (embed_tokens + lm_head)", "attention": "attention", "dense_ffn": "dense FFN",
    "shared_experts": "shared experts", "routed_experts": "routed experts", "mtp": "MTP modules (own parameters)",
    "norms_router": "norms + router",
}


def _param_lines(pr: ParamReport) -> list[str]:
    rows = [[_PART_LABELS[p], fmt_count(getattr(pr.total, p)), fmt_count(getattr(pr.activated, p))] for p in PARTS]
    rows += [["**main model** (without MTP)", f"**{fmt_count(pr.total.main)}**",
              f"**{fmt_count(pr.activated.main)}**"],
             ["all unique parameters (= sum of numel)", fmt_count(pr.total.total), fmt_count(pr.activated.total)]]
    lines = ["### Parameters", "", *_table(["part", "total", "activated per token"], rows), ""]
    if pr.total.mtp:
        mtp = pr.mtp_parts
        lines += [f"MTP modules: {fmt_count(mtp.total)} own parameters (routed experts "
                  f"{fmt_count(mtp.routed_experts)}), "
                  f"{fmt_count(mtp.total + pr.shared_embedding_head)} counted with the embedding and head they share; "
                  f"main model + MTP with its shared copies = {fmt_count(pr.hf_checkpoint_total)} "
                  f"(the Hugging Face checkpoint's size).", ""]
    lines += ["Activated: the top-k routed experts, the lm_head, not the input embedding table (a lookup reads one "
              "row of it).", ""]
    return lines


def _state_lines(plan: Plan) -> list[str]:
    rows = [[name, f"ZeRO-{z}", fmt_bytes(s.params), fmt_bytes(s.grads), fmt_bytes(s.optimizer), fmt_bytes(s.total)]
            for name, states in plan.state_table.items() for z, s in enumerate(states)]
    heavy = plan.stages[plan.heaviest_stage].params
    notes = [f"`{p.name}`: {p.description}" for p in PRECISIONS.values()]
    experts = f", {fmt_count(heavy.expert)} expert parameters over edp = {plan.edp}" if heavy.expert else ""
    return [f"### Model states per rank (stage {plan.heaviest_stage}, the heaviest: {fmt_count(heavy.dense)} dense "
            f"parameters, ZeRO over dp x cp = {plan.dense_group} ranks{experts})", "", *_table(["precision", "ZeRO", "parameters", "gradients", "optimizer", "total"], rows),
            "", "; ".join(notes) + ".", ""]


def _stage_lines(plan: Plan) -> list[str]:
    limit = plan.gpu_memory_gb * GB
    rows = [[s.stage, f"{s.layers} + MTP {s.mtp_blocks}" if s.mtp_blocks else s.layers, s.moe_blocks,
             fmt_count(s.params.dense + s.params.expert), fmt_bytes(s.states.total),
             fmt_bytes(s.activations.per_micro_batch), fmt_bytes(s.activations.per_micro_batch_recompute),
             s.activations.in_flight, fmt_bytes(s.activations.no_recompute), fmt_bytes(s.activations.full_recompute),
             fmt_bytes(s.total), "yes" if s.total <= limit else "**no**"] for s in plan.stages]
    header = ["stage", "layers", "MoE blocks", "params/rank", "model states", "act/micro-batch",
              "act/micro-batch recomputed", "in flight", "act no recompute", "act full recompute", f"total ({plan.recompute})",
              f"fits {plan.gpu_memory_gb:g} GB"]
    return [f"### Memory per rank by stage (ZeRO-{plan.zero}, `{plan.precision.name}`, recompute {plan.recompute})",
            "", *_table(header, rows), "",
            "Activations (Korthikanti et al. 2022's accounting with flash attention, real MLA/GQA/SwiGLU shapes, "
            "MoE: top-k routed copies per token, fp32 logits on the last stage): in flight = min(pp - stage, "
            "micro-batches) under 1F1B; full recomputation keeps each layer's input plus one layer being "
            "recomputed. Not counted: communication buffers, allocator fragmentation, CUDA workspaces.", "",
            _sp_note(plan), "",
            *_mtp_note(plan)]


def _sp_note(plan: Plan) -> str:
    """How the plan holds the sequence-parallel regions' inputs, and the backward's own peak."""
    sp = ("Sequence parallelism: each region keeps its input's 1/tp shard and all-gathers it again in the "
          "backward (Megatron's, as Meta trained Llama 3: --sp-regather)." if plan.sp_regather else
          "Sequence parallelism as this trainer runs it: each tensor-parallel region keeps its all-gathered "
          "input ((1 - 1/tp) h more per token and region than the shard; --sp-regather plans Megatron's)."
          if plan.sequence_parallel else "")
    return (sp + " Each total adds the backward's own peak (the gradients inside the heaviest layer, or the "
            "last stage's cross-entropy backward) and is at least the step's gradient buckets.").strip()


def _mtp_note(plan: Plan) -> list[str]:
    """Name the MTP modules where the last stage counts them (its layers column says `+ MTP n`)."""
    last = plan.stages[-1]
    if not last.mtp_blocks:
        return []
    return [f"Stage {last.stage} also holds the multi-token-prediction module{'s' if last.mtp_blocks > 1 else ''} "
            f"(MTP, {last.mtp_blocks}): {'their blocks count' if last.mtp_blocks > 1 else 'its block counts'} in "
            f"the stage's MoE blocks, parameters and activations, with an extra head and loss per module.", ""]


_ZERO_TRAFFIC = {0: "all-reduce of gradients", 1: "all-reduce gradients (as DeepSpeed's stage 1 does) + all-gather "
                                                 "parameters, once per step",
                 2: "reduce-scatter gradients every micro-batch + all-gather parameters",
                 3: "all-gather parameters twice and reduce-scatter gradients, every micro-batch"}


def _comm_rows(plan: Plan) -> list[tuple[str, object]]:
    """(label, bytes of a StagePlan) for each kind of traffic."""
    recompute = " + recompute" if plan.recompute == "full" else ""
    sp = ", as all-gather + reduce-scatter with SP" if plan.sequence_parallel else ""
    return [
        (f"data parallel, dense (ZeRO-{plan.zero}: {_ZERO_TRAFFIC[plan.zero]}; dp x cp = {plan.dense_group} ranks)",
         lambda s: s.comm.dense_dp.total),
        (f"data parallel, experts (same, over edp = {plan.edp} ranks)", lambda s: s.comm.expert_dp.total),
        (f"expert all-to-all (dispatch + combine, forward + backward{recompute}; "
         f"{fmt_bytes(plan.alltoall_per_layer.sent)} per MoE layer and micro-batch)", lambda s: s.comm.all_to_all),
        ("pipeline send/recv (activations forward, gradients backward)", lambda s: s.comm.pipeline),
        (f"tensor parallel (tp {plan.tp}: 2 all-reduces per layer per pass{sp}; embedding, head input, "
         f"vocabulary-parallel loss, replicated-weight grads)", lambda s: s.comm.tensor),
        (f"context parallel (cp {plan.cp}: all-gather K, V forward; reduce-scatter grads backward)",
         lambda s: s.comm.context),
        ("**total**", lambda s: s.comm.total),
    ]


def _comm_lines(plan: Plan) -> list[str]:
    rows = []
    for label, get in _comm_rows(plan):
        worst = max(plan.stages, key=get)
        rows.append([label, fmt_bytes(get(worst)), worst.stage] if get(worst) else [label, "-", "-"])
    dedup = " with one copy per destination rank (dedup)" if plan.dedup_dispatch else ""
    return ["### Communication per optimizer step, bytes sent by one rank (received: the same)", "",
            *_table(["collective", "bytes per step", "worst stage"], rows), "",
            "Ring collectives over g ranks: all-reduce 2(g-1)/g x size, reduce-scatter and all-gather (g-1)/g x "
            f"size. All-to-all: only copies that leave the rank, under uniform routing{dedup}.", ""]


_NODE_KINDS = (("dense_dp", "data parallel, dense"), ("expert_dp", "data parallel, experts"),
               ("all_to_all", "expert all-to-all"), ("pipeline", "pipeline send/recv"), ("tensor", "tensor parallel"),
               ("context", "context parallel"))


def _node_lines(plan: Plan) -> list[str]:
    """Bytes inside and across nodes and the communication time, for the stage that spends the most."""
    worst = max(plan.stages, key=lambda s: s.comm_seconds)
    rows = [[label, fmt_bytes(worst.nodes[k].intra_node), fmt_bytes(worst.nodes[k].inter_node),
             worst.nodes[k].nodes, f"{worst.nodes[k].seconds * 1e3:.1f}"]
            for k, label in _NODE_KINDS if worst.nodes[k].intra_node + worst.nodes[k].inter_node > 0]
    rows.append(["**total**", fmt_bytes(sum(n.intra_node for n in worst.nodes.values())),
                 fmt_bytes(sum(n.inter_node for n in worst.nodes.values())), "", f"{worst.comm_seconds * 1e3:.1f}"])
    lk = plan.links
    return [f"### Inside and across nodes ({plan.gpus_per_node} GPUs per node, rank order {plan.rank_order}; "
            f"stage {worst.stage}, the most communication time)", "",
            *_table(["traffic", "inside a node", "across nodes", "nodes spanned", "ms per step"], rows), "",
            f"Links per GPU and direction: NVLink {lk.nvlink_gbps:g} Gb/s ({lk.nvlink_gbps / 8:g} GB/s), network "
            f"{lk.ib_gbps:g} Gb/s ({lk.ib_gbps / 8:g} GB/s) (--nvlink-gbps, --ib-gbps; defaults: an H100 node with one "
            f"400 Gb/s NIC per GPU). A ring over n nodes sends n/g of its bytes across and runs at the network's "
            f"pace; the all-to-all's NVLink and network parts run at once. The times add up, with no overlap.", ""]


def format_plan(plan: Plan, title: str = "") -> str:
    """The plan as a markdown report."""
    mb, pp = plan.micro_batches, plan.pp
    tokens = plan.global_batch_size * plan.seq_len
    verdict = "fits" if plan.fits else "does NOT fit"
    lines = [f"## {title or plan.arch}", "",
             f"{plan.gpus} GPUs = pp {pp} x dp {plan.dp} x tp {plan.tp} x cp {plan.cp}; ep {plan.ep} inside dp x cp, "
             f"expert-data-parallel {plan.edp}. Stages (layers): {plan.partition}. Micro-batch "
             f"{plan.micro_batch_size} x {plan.seq_len} tokens, {mb} micro-batches per step, global batch "
             f"{plan.global_batch_size} sequences = {tokens / 1e6:.1f}M tokens.", "",
             *_param_lines(plan.params), *_state_lines(plan), *_stage_lines(plan), *_comm_lines(plan),
             *_node_lines(plan),
             _bubble_line(plan, pp, mb), "",
             f"**Verdict:** the heaviest rank (stage {plan.peak_stage}) needs {fmt_bytes(plan.peak_bytes)}; "
             f"it {verdict} in {plan.gpu_memory_gb:g} GB.", ""]
    return "\n".join(lines)


def _paper_gb(n: float) -> str:
    """The ZeRO paper's rounding: 120 GB, 31.4 GB, 1.9 GB."""
    gb = n / GB
    return f"{gb:.0f} GB" if gb >= 100 else f"{gb:.1f} GB"


def format_zero_table(rows: Sequence[ZeroRow], n_params: float, dp: int, k: int = 12) -> str:
    """The ZeRO table as markdown."""
    names = ["0 (data parallel)", "1 (P_os)", "2 (P_os+g)", "3 (P_os+g+p)"]
    comm = ["2x parameters (all-reduce)", "2x parameters (reduce-scatter + all-gather)", "2x parameters",
            "3x parameters (1.5x data parallel)"]
    body = [[names[r.stage], _paper_gb(r.params), _paper_gb(r.grads), _paper_gb(r.optimizer), _paper_gb(r.total),
             comm[r.stage]] for r in rows]
    head = (f"ZeRO memory per rank (Rajbhandari et al. 2019): {n_params:.4g} parameters, data parallel {dp}, "
            f"mixed precision Adam with 2 + 2 + K={k} bytes per parameter; GB = 1e9 bytes.")
    return "\n".join([head, "", *_table(["stage", "parameters", "gradients", "optimizer state",
                                         "total per rank", "communication per step"], body), ""])
