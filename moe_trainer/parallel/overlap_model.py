"""A DeepSeek-V3 model's forward cut into the overlapped executor's stages (overlap.py).

Each MoE decoder layer is cut at its two all-to-alls:
  A: attention (with its norms and residual), post-attention norm (DecoderLayer.attention_block),
     router, the dispatcher's split-size exchange and the token rows to send (dispatch_out);
  -- dispatch all-to-all --
  B: the dispatch's completion, the routed experts, the shared experts, the rows to send back
     (combine_out);
  -- combine all-to-all --
  C: the combine's completion, + shared experts, the residual.
A stage runs from one all-to-all to the next: stage 0 is the embedding, the dense layers and the first
MoE layer's A; then B of layer j; then C of layer j, any dense layers and A of layer j + 1; the last
stage is C of the last MoE layer, the final norm, the head, the losses and multi-token prediction
(whose MoE block sends its all-to-alls blocking, inside the stage). Every op is the plain forward's
(DecoderLayer.forward, MoE.forward), in the same order, so the results are bit-identical.

Under train.compile the modules a stage calls are compiled regions (compile.compile_moe_regions: the
attention block with its norms, the router, the routed and the shared experts; dense layers, head and
loss whole); the dispatcher's pieces run eager between them.

A stage function maps (inputs, received) to (outputs, outbound, aux): inputs and outputs are dicts of
what one stage hands the next (tensors and the dispatcher's completion closures), received the rows
of the all-to-all before it, outbound the (tensors, specs) of the all-to-all after it, aux its
router's weighted auxiliary loss. Full recomputation checkpoints each piece (A, B, C) on its own;
selective recomputation is in the modules already (recompute.py).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from ..models.lm import add_aux
from .recompute import _checkpointed


def _attention_and_route(layer: nn.Module, inp: dict) -> tuple[dict, tuple, object]:
    """Piece A of an MoE layer."""
    h1, x = layer.attention_block(inp["h"], inp["cos"], inp["sin"], inp["documents"])
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    moe = layer.mlp
    routing = moe.gate(flat)
    ob = moe.dispatcher.dispatch_out(flat, routing.topk_idx, routing.topk_weight)
    aux = moe._aux_loss(routing, b)
    if moe.training:
        moe._count(routing, ob)  # ob carries the dropped copies and the rank's load, as Dispatched does
    out = {"h1": h1, "flat": flat, "carried": ob.carried, "complete": ob.complete}
    return out, (ob.tensors, ob.specs), aux


def _experts(layer: nn.Module, inp: dict, received: tuple) -> tuple[dict, tuple]:
    """Piece B of an MoE layer."""
    moe = layer.mlp
    d = inp["complete"](received, inp["carried"])
    y = moe._run_experts(d)
    ob = moe.dispatcher.combine_out(y, d)
    shared = moe.shared_experts(inp["flat"]) if moe.shared_experts is not None else None
    return {"h1": inp["h1"], "shared": shared, "carried": ob.carried, "complete": ob.complete}, (ob.tensors, ob.specs)


def _combine(layer: nn.Module, inp: dict, received: tuple) -> torch.Tensor:
    """Piece C of an MoE layer: the layer's output hidden states."""
    h1 = inp["h1"]
    out = inp["complete"](received, inp["carried"])
    if inp["shared"] is not None:
        out = out + inp["shared"]
    return h1 + out.view(h1.shape)


_CONTEXT = ("cos", "sin", "documents", "labels", "positions", "emb", "aux")


def _context(inp: dict) -> dict:
    return {k: inp[k] for k in _CONTEXT}


def stage_functions(model: nn.Module, recompute: str = "none") -> list[Callable]:
    """The stages of one micro-batch's forward; the first takes inputs {input_ids, labels, positions,
    documents}, the last returns {"out": LMOutput} (its loss the micro-batch's total)."""
    return _stage_functions(model, list(model.layers.values()), model.embed_tokens, (model.norm, model.lm_head),
                            None, recompute)


def chunk_stage_functions(stage: nn.Module, chunk: int, recompute: str = "none") -> list[Callable]:
    """The stages of one micro-batch's forward through chunk `chunk` of a pipeline.PipelineStage, cut as
    above. The first takes {carried, input_ids, labels, positions, documents} (carried: what the
    previous pipeline stage sent, None on the model's first chunk); the last returns {"out": LMOutput}
    on the model's last chunk, else {"out": carried for the next stage, "aux": the chunk's auxiliary
    losses, detached}: the values of PipelineStage.forward, op for op."""
    width = stage.cfg.hidden_size if stage.carry_emb else None
    return _stage_functions(stage._model[0], [stage.layers[i] for i in stage.chunks[chunk]],
                            stage.embed_tokens if stage.is_first(chunk) else None,
                            (stage.norm, stage.lm_head) if stage.is_last(chunk) else None, width, recompute)


def _stage_functions(model: nn.Module, layers: list, embed, head, width, recompute: str) -> list[Callable]:
    """embed: the embedding (else the first stage reads `carried`: the hidden states, and the token
    embeddings after `width` features when width is set); head: (norm, lm_head), else the last stage
    hands on the hidden states (concatenated with the embeddings when width is set); model: the full
    model, for its rope and loss."""
    moe_at = [i for i, layer in enumerate(layers) if layer.is_moe]
    full = recompute == "full"

    def piece(fn, layer):
        bound = functools.partial(fn, layer)
        return _checkpointed(bound, layer) if full else bound

    def dense(h, ctx, lo, hi):
        for layer in layers[lo:hi]:
            h, _ = layer(h, ctx["cos"], ctx["sin"], ctx["documents"])
        return h

    def then_route(ctx: dict, h: torch.Tensor, lo: int, j: int):
        """Dense layers [lo, moe_at[j]) then A of MoE layer j (or, past the last, the dense rest and the tail)."""
        if j == len(moe_at):
            return tail(ctx, dense(h, ctx, lo, len(layers)))
        h = dense(h, ctx, lo, moe_at[j])
        out, outbound, aux = piece(_attention_and_route, layers[moe_at[j]])({**ctx, "h": h})
        ctx = dict(ctx, aux=add_aux(ctx["aux"], aux.detach() if aux is not None else None))
        return {**ctx, **out}, outbound, aux

    def tail(ctx: dict, h: torch.Tensor):
        if head is None:
            return {"out": torch.cat([h, ctx["emb"]], dim=-1) if width else h, "aux": ctx["aux"]}, None, None
        logits = head[1](head[0](h))
        return {"out": model.loss(logits, ctx["labels"], h, ctx["emb"], ctx["aux"], ctx["documents"],
                                  ctx["positions"])}, None, None

    def first(inp: dict, received: tuple):
        ids, carried = inp["input_ids"], inp.get("carried")
        if embed is not None:
            h = emb = embed(ids)
        else:
            h, emb = (carried[..., :width], carried[..., width:]) if width else (carried, None)
        cos, sin = model.rope(ids.shape[1], h.device, h.dtype, inp["positions"])
        ctx = {"cos": cos, "sin": sin, "documents": inp["documents"], "labels": inp["labels"],
               "positions": inp["positions"], "emb": emb, "aux": None}
        return then_route(ctx, h, 0, 0)

    def experts(j):
        def run(inp: dict, received: tuple):
            out, outbound = piece(_experts, layers[moe_at[j]])(inp, received)
            return {**_context(inp), **out}, outbound, None
        return run

    def combine_then_route(j):
        def run(inp: dict, received: tuple):
            h = piece(_combine, layers[moe_at[j]])(inp, received)
            return then_route(_context(inp), h, moe_at[j] + 1, j + 1)
        return run

    stages = [first]
    for j in range(len(moe_at)):
        stages += [experts(j), combine_then_route(j)]
    return stages
