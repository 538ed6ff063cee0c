"""Regional torch.compile (`train.compile: true`), as torchtitan compiles per block: each decoder
layer (the MTP depths' blocks included) is compiled on its own, and so are the final norm, the
output head and the cross-entropy. Every layer has the same code and shapes, so one compilation
serves them all (dynamo re-uses the graph and guards per layer's parameters), and parameter names
do not change (`Module.compile` compiles in place: no `_orig_mod.` prefix in checkpoints).

A MoE layer on the accelerator path is one graph with no break, at ep 1 and at ep > 1 alike
(tests/test_compile.py): under compile the expert-parallel all-to-alls are torch's functional
collectives, in the graph, and the split sizes their `.tolist()` reads are unbacked symbolic ints
(`enable_unbacked_splits`), so the row counts that follow are symbolic and nothing recompiles when
the routing changes. The host sync itself stays (a collective's split sizes live on the host), one
per layer and micro-batch, inside the graph. The bytes the all-to-alls move are counted by in-place
adds to a host tensor (CommCounter.in_graph: Python ints there would be guarded, and every new total
would recompile); their time is not measured inside a graph, so such runs log no
`time.all_to_all_s`, and straggler naming leaves the forward out of every rank's time
(forward_waits_timed). Recomputation (parallel.recompute) inside a compiled
layer is the partitioner's: the MoE counters are updated once, in the forward graph. The layers are
compiled with fullgraph=False all the same, so that a graph break from a future change degrades
speed, not a run. `train.compile_backend: aot_eager` traces the same graphs and runs them op by op
(what the CPU tests run).

Overlapped (`parallel.overlap: a2a`, parallel/overlap.py) the executor calls an MoE layer's pieces
itself, with its all-to-alls issued asynchronously between them, so a whole compiled layer would never
run; its MoE layers (the MTP blocks' too) are compiled by sub-layer region instead, as torchtitan and
Megatron compile blocks: the attention block (input norm, attention, residual, post-attention norm:
DecoderLayer.attention_block), the router, the routed experts and the shared experts
(compile_moe_regions); dense layers, head and loss as above. The dispatcher runs eager between them:
the split-size exchange and its one host read per layer and micro-batch, the all-to-alls (timed: such
runs log `time.all_to_all_s`, and straggler naming takes the waits out) and the reordering of rows
around them. Each region is one graph
on the accelerator path (fullgraph, tests/test_compile.py), shared by every layer as above; the routed
experts' rows arrive in a count that changes every call and may be 0, so it is marked an unbacked size
(Experts.rows_unbacked): one graph for every count, as inside a whole layer. The MTP block's shorter
sequence is a second shape for its regions (one recompile each, with a dynamic length). A compiled
experts region's backward is one graph: its weight gradients are made at once, not held back behind
the backward all-to-all as the eager kernels' are (kernels/wgrad.py; the CPU kernels, outside any
graph, still hold them back). The CPU back
end's kernels break the graphs on CPU ranks in either mode (their C++ calls are not traced). No GPU
has measured the overlapped regions yet: train.compile auto leaves an overlapped run eager.

The default is off: on CPU ranks the default path is the CPU back end
in fp32, and the compile costs about a minute on 2 cores (configs/moe_tiny.yaml on the accelerator
path in bf16, on a Zen 4: a 59 s first step, then steps 0.70x eager's on one rank and no gain at
ep 2; docs/BENCHMARKS.md); scripts/gpu_check.sh measures eager against compiled on a GPU to settle
the GPU default.
"""
from __future__ import annotations

import torch
from torch import nn

from .models.deepseek_v3 import DecoderLayer
from .models.lm import CausalLM, lm_loss
from .models.llama3 import LlamaLayer


def forward_waits_timed(cfg) -> bool:
    """Are the forward's expert all-to-alls timed (CommCounter spans), so that straggler naming can take
    a rank's waits for its slowest EP peer out of its forward time? Not under train.compile at ep > 1
    without overlap: there they run inside the layers' graphs, where no clock is read, and the forward
    holds the waits (overlapped, parallel.overlap=a2a, they run between the compiled regions, timed).
    The answer comes from the config, the same on every rank (pipeline stages without experts too), so
    every rank's time is measured alike."""
    # (train.compile auto: resolved to a bool at start)
    return not (cfg.train.compile is True and cfg.parallel.ep > 1 and cfg.parallel.overlap == "none")


def enable_unbacked_splits() -> None:
    """Let dynamo trace the all-to-all split sizes (`.tolist()` of the exchanged counts) as unbacked
    symbolic ints, so an expert-parallel MoE layer is one graph (dynamo's capture_scalar_outputs,
    a process-wide setting, as torchtitan sets it for MoE)."""
    torch._dynamo.config.capture_scalar_outputs = True


def compile_regions(model: nn.Module, backend: str = "inductor", fullgraph: bool = False,
                    overlap: bool = False) -> list[str]:
    """Compile every decoder layer, and the head and loss of the CausalLM inside `model` (a whole
    model or a pipeline stage holding one), in place. overlap (parallel.overlap=a2a): every MoE
    decoder layer, the MTP blocks' included, is compiled region by region instead (MOE_REGIONS), the
    pieces the overlapped executor's stages call. Returns the compiled modules' names."""
    enable_unbacked_splits()
    names = []
    for name, module in model.named_modules():
        if overlap and isinstance(module, DecoderLayer) and module.is_moe:
            names += [f"{name}.{part}" for part in compile_moe_regions(module, backend, fullgraph)]
        elif isinstance(module, (DecoderLayer, LlamaLayer)):
            module.compile(backend=backend, fullgraph=fullgraph)
            names.append(name)
        elif isinstance(module, CausalLM):
            for part in ("norm", "lm_head"):
                if isinstance(getattr(module, part, None), nn.Module):
                    getattr(module, part).compile(backend=backend, fullgraph=fullgraph)
                    names.append(f"{name}.{part}" if name else part)
            if module.loss_fn is lm_loss:  # tensor parallelism's vocabulary-parallel loss has collectives
                module.loss_fn = torch.compile(lm_loss, backend=backend, fullgraph=fullgraph)
                names.append(f"{name}.loss_fn" if name else "loss_fn")
    return names


MOE_REGIONS = ("attention_block", "mlp.gate", "mlp.experts", "mlp.shared_experts")


def compile_moe_regions(layer: DecoderLayer, backend: str = "inductor", fullgraph: bool = False) -> list[str]:
    """An MoE decoder layer compiled region by region, in place (the regions of MOE_REGIONS it has):
    its attention block (input norm, attention, residual, post-attention norm), router, routed experts
    and shared experts. On the accelerator kernels the routed experts' rows are an unbacked size
    (Experts.rows_unbacked: one graph for every row count, 0 included, as inside a whole compiled
    layer); the CPU back end's kernels take the counts on the host, a graph break there in any case,
    and check them against the rows, which the padded row of an unbacked count would fail. The dispatcher
    stays eager, between the regions: the split-size exchange and its host read, the all-to-alls,
    and the reordering of the rows around them."""
    layer.attention_block = torch.compile(layer.attention_block, backend=backend, fullgraph=fullgraph)
    moe = layer.mlp
    moe.experts.rows_unbacked = moe.experts.kernels.name == "accelerator"
    for part in (moe.gate, moe.experts, moe.shared_experts):
        if part is not None:
            part.compile(backend=backend, fullgraph=fullgraph)
    return [r for r in MOE_REGIONS if r != "mlp.shared_experts" or moe.shared_experts is not None]
