"""Pipeline stages: layers per stage, which stage holds a parameter, the 1F1B in-flight
count and the bubble."""
from __future__ import annotations

from typing import Sequence

from ..config import Config, ModelConfig
from .params import PlanError, _layer_id


# ----------------------------------------------------------------------------- pipeline stages

def balanced_partition(n_layers: int, pp: int) -> list[int]:
    """Decoder layers per pipeline stage, as even as possible.

    The extra layers go to the middle stages first, so the first stage (embedding) and the last
    (final norm, head, loss, MTP) get the fewer: Llama 3 405B's 126 layers on 16 stages give
    7, 8 x 14, 7, the split Meta reports.
    """
    if not 1 <= pp <= n_layers:
        raise PlanError(f"pipeline stages ({pp}) must be between 1 and the number of layers ({n_layers}).")
    base, extra = divmod(n_layers, pp)
    order = list(range(1, pp - 1)) + [0, pp - 1][: min(pp, 2)]
    sizes = [base] * pp
    for stage in order[:extra]:
        sizes[stage] += 1
    return sizes


def stage_partition(cfg: Config) -> list[int]:
    """Layers per stage exactly as the trainer splits them: `parallel.pp_partition`
    if given, else balanced by estimated compute (parallel/pipeline.py). With
    parallel.virtual_stages > 1, the layers of each rank's chunks together (the
    memory figures treat them as one block)."""
    from ..parallel.pipeline import rank_chunks, stage_layers
    virtual, pp = stage_layers(cfg, cfg.train.seq_len), cfg.parallel.pp
    return [sum(len(c) for c in rank_chunks(virtual, s, pp)) for s in range(pp)]


def in_flight(stage: int, pp: int, micro_batches: int, chunks: int = 1) -> float:
    """Micro-batches' worth of activations stage `stage` (0-based) holds at once under 1F1B:
    min(pp - stage, m); interleaved (chunks = v > 1): the warm-up's chunk forwards plus one,
    each 1/v of the stage's layers (stage 0: (v p + p - 1) / v, more than plain 1F1B's p)."""
    if chunks == 1:
        return min(pp - stage, micro_batches)
    from ..parallel.pipeline import interleaved_warmup
    warmup = interleaved_warmup(stage, pp, micro_batches, chunks)
    return min(warmup + 1, chunks * micro_batches) / chunks


def bubble_fraction(pp: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share of a 1F1B / GPipe step: (p - 1) / (m + p - 1); interleaved over v chunks per
    rank: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (chunks * micro_batches + pp - 1)


def _layer_stages(partition: Sequence[int]) -> list[int]:
    """Stage of each decoder layer."""
    return [stage for stage, n in enumerate(partition) for _ in range(n)]


def _stages_of(name: str, m: ModelConfig, layer_stage: list[int]) -> tuple[int, ...]:
    """Stages that hold a parameter. No stage copies embed_tokens: MTP modules on the last stage read
    the token embeddings that the first stage sends along with the hidden states (the trainer's
    pipeline carries [h, emb]), and a head tied to the embedding is refused with pp > 1. Only a
    tied head (pp = 1 in the trainer) would need a copy."""
    last = max(layer_stage)
    layer = _layer_id(name)
    if layer is not None:
        return (layer_stage[layer] if layer < m.num_hidden_layers else last,)
    if "embed_tokens" in name:
        return (0, last) if last > 0 and m.tie_word_embeddings else (0,)
    return (last,)  # model.norm, lm_head
