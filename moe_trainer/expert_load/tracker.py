"""The trainer's side of expert load: the aux-loss-free bias update once per optimizer step and,
at each log, the interval's imbalance metrics and its expert-load file (files.py).

The Trainer does not know which model it trains; the MoE layers it drives are counted here.
Collective: every rank calls `update_bias` and `metrics` at the same steps (all-reduces over the
mesh's data-parallel and pipeline groups). Not re-exported by expert_load/__init__: the tool that
reads the files needs no process group.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..config import ModelConfig
from ..metrics import MetricSink
from ..models.registry import moe_layers
from ..moe import balance
from ..parallel.comm import all_reduce_small
from ..parallel.mesh import Mesh
from .files import write_expert_load
from .stats import imbalance_stats


def all_moe_layer_ids(m) -> list[int]:
    """Global ids of the MoE layers: main layers from first_k_dense_replace on,
    then one per MTP depth (ids after the main layers, as in DeepSeek's checkpoints)."""
    if m.arch != "deepseek_v3":
        return []
    main = [i for i in range(m.num_hidden_layers) if i >= m.first_k_dense_replace]
    return main + [m.num_hidden_layers + k for k in range(m.num_nextn_predict_layers)]


def _global_layer_id(name: str, m) -> int:
    """'layers.3.mlp' -> 3; 'mtp.0.block.mlp' -> num_hidden_layers + 0."""
    kind, idx = name.split(".")[:2]
    return int(idx) if kind == "layers" else m.num_hidden_layers + int(idx)


class ExpertLoadTracker:
    """Expert load of this rank's MoE layers, kept per logging interval. Rows: every MoE layer of the
    model (global ids `layer_ids`); this stage owns some of them (`moe`: (row, layer))."""

    def __init__(self, cfg: ModelConfig, model: torch.nn.Module, mesh: Mesh, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.ep = mesh.layout.ep
        self.layer_ids = all_moe_layer_ids(cfg)
        local = {_global_layer_id(name, cfg): m for name, m in moe_layers(model)}
        self.moe = [(self.layer_ids.index(i), m) for i, m in local.items()]
        self._load_interval = torch.zeros(len(self.layer_ids), cfg.n_routed_experts)
        self._rank_load_interval = torch.zeros(len(self.layer_ids), self.ep)  # rows per EP rank

    @torch.no_grad()
    def update_bias(self, apply: bool = True) -> Optional[dict]:
        """Aux-loss-free balancing: counts summed over every rank that routed tokens,
        so every replica of each bias moves identically."""
        if not self.layer_ids:
            return None
        n, e, ep = len(self.layer_ids), self.cfg.n_routed_experts, self.ep
        counts = torch.zeros(n, e, device=self.device)  # rows of other stages stay 0 here
        # MoE.stats[:5], then the rows this rank's experts computed in column 5 + its EP index: the
        # dp x cp sum gives each EP rank's load (summed over expert-data-parallel replicas)
        stats = torch.zeros(n, 5 + ep, dtype=torch.float64, device=self.device)
        ep_rank = self.mesh.index("ep")
        for row, m in self.moe:
            counts[row], stats[row, :5], stats[row, 5 + ep_rank] = m.tokens_per_expert, m.stats[:5], m.stats[5]
        if self.mesh.group("dpcp") is not None:
            all_reduce_small(counts, self.mesh.group("dpcp"))
            all_reduce_small(stats, self.mesh.group("dpcp"))
        speed = self.cfg.bias_update_speed if apply else 0.0
        for row, layer in self.moe:
            if speed > 0:
                balance.update_bias(layer.gate.e_score_correction_bias, counts[row], speed)
            layer.reset_counters()
        if self.mesh.group("pp") is not None:  # every stage's rows, for logging
            all_reduce_small(counts, self.mesh.group("pp"))
            all_reduce_small(stats, self.mesh.group("pp"))
        counts, rank_rows = counts.cpu(), stats[:, 5:].float().cpu()  # rank_rows: (layers, ep) this step
        self._load_interval += counts
        self._rank_load_interval += rank_rows
        return {"counts": counts, "stats": stats[:, :5].cpu(), "rank_rows": rank_rows}

    def biases(self) -> torch.Tensor:
        """(moe_layers, E) balancing biases, every stage's rows (collective under pp)."""
        bias = torch.zeros(len(self.layer_ids), self.cfg.n_routed_experts, device=self.device)
        for row, m in self.moe:
            bias[row] = m.gate.e_score_correction_bias.detach().float()
        if self.mesh.group("pp") is not None:
            all_reduce_small(bias, self.mesh.group("pp"))
        return bias.cpu()

    def metrics(self, expert: dict, sink: Optional[MetricSink], out_dir: Path, step: int) -> dict:
        """The interval's imbalance metrics since the last call, and (rank 0, `sink` given) its
        expert-load file and histograms; `expert`: update_bias's last result."""
        load = self._load_interval
        self._load_interval = torch.zeros_like(load)
        stats = imbalance_stats(load)
        bias = self.biases()
        out = {"expert.max_over_mean": float(stats["max_over_mean"].mean()),
               "expert.cv": float(stats["cv"].mean()),
               "expert.frac_below_10pct": float(stats["frac_below_10pct"].mean()),
               "expert.bias_spread": float((bias.max(-1).values - bias.min(-1).values).mean())}
        s = expert["stats"]
        if self.cfg.capacity_factor is not None:
            out["expert.dropped_frac"] = float(s[:, 3].sum() / s[:, 4].sum().clamp_min(1))
        for i, layer_id in enumerate(self.layer_ids):
            out[f"expert_layer{layer_id}.max_over_mean"] = float(stats["max_over_mean"][i])
            out[f"expert_layer{layer_id}.cv"] = float(stats["cv"][i])
        if self.ep > 1:  # measured: the most loaded EP rank over the mean (what a placement plan lowers)
            ranks = imbalance_stats(self._rank_load_interval)["max_over_mean"]
            out["expert.rank_max_over_mean"] = float(ranks.mean())
            for i, layer_id in enumerate(self.layer_ids):
                out[f"expert_layer{layer_id}.rank_max_over_mean"] = float(ranks[i])
        self._rank_load_interval.zero_()
        if sink:
            write_expert_load(out_dir, step, load, bias=bias, layer_ids=self.layer_ids)
            for i, layer_id in enumerate(self.layer_ids):
                sink.histogram(f"expert_load/layer{layer_id}", load[i], step)
        return out
