"""Regional torch.compile (`train.compile: true`), as torchtitan compiles per block: each decoder
layer (the MTP depths' blocks included) is compiled on its own, and so are the final norm, the
output head and the cross-entropy. Every layer has the same code and shapes, so one compilation
serves them all (dynamo re-uses the graph and guards per layer's parameters), and parameter names
do not change (`Module.compile` compiles in place: no `_orig_mod.` prefix in checkpoints).

At ep 1 a MoE layer on the accelerator path is one graph with no break in bf16 and fp32
(tests/test_compile.py); at ep > 1 the split-size exchange (`.tolist()` in parallel/expert.py, a
host sync) breaks the layer's graph (ep 2, bf16: 7 graphs, 6 breaks, all from that read), which is
why the layers are compiled with fullgraph=False. The default is
off: on CPU ranks the compile costs minutes (about 2 minutes for a tiny MoE layer on 2 cores) for
a small gain, and scripts/gpu_check.sh measures eager against compiled on a GPU to settle the
GPU default.
"""
from __future__ import annotations

import torch
from torch import nn

from .models.deepseek_v3 import DecoderLayer
from .models.lm import CausalLM, lm_loss
from .models.llama3 import LlamaLayer


def enable_unbacked_splits() -> None:
    """Let dynamo trace the all-to-all split sizes (`.tolist()` of the exchanged counts) as unbacked
    symbolic ints, so an expert-parallel MoE layer is one graph (dynamo's capture_scalar_outputs,
    a process-wide setting, as torchtitan sets it for MoE)."""
    torch._dynamo.config.capture_scalar_outputs = True


def compile_regions(model: nn.Module, backend: str = "inductor", fullgraph: bool = False) -> list[str]:
    """Compile every decoder layer, and the head and loss of the CausalLM inside `model` (a whole
    model or a pipeline stage holding one), in place. Returns the compiled modules' names."""
    enable_unbacked_splits()
    names = []
    for name, module in model.named_modules():
        if isinstance(module, (DecoderLayer, LlamaLayer)):
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
