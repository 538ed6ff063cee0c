"""Expert placement with redundant experts: the problem DeepSeek's EPLB solves.

Given the load of every logical expert of every MoE layer, choose R >= E
physical expert slots (every logical expert at least once, hot experts
replicated) and put them on P GPUs, S = R / P slots each, so that the most
loaded GPU is as light as possible. Tokens routed to a replicated expert are
spread evenly over its replicas, so one replica carries load_e / count_e.

Slot layout (as in EPLB): GPU g holds physical slots [g*S, (g+1)*S); node n
holds GPUs [n*P/N, (n+1)*P/N). When the number of expert groups G (the unit
of DeepSeek-V3's group-limited routing) is divisible by the number of nodes N
the policy is hierarchical: every group lives on one node, G/N groups per node,
so a token's experts span few nodes. Otherwise the policy is global (one pool
of P GPUs, groups ignored), as in EPLB.

Solvers (pure: tensors in, tensors out, no collectives or process groups):
- `eplb_reference` (eplb.py): our implementation of the published EPLB greedy
  (balanced packing of groups to nodes -> per node, greedily give the next
  replica to the expert with the largest load per replica -> balanced packing
  of the physical experts to the node's GPUs).
- `rebalance_experts` (search.py): ours, built on EPLB's pieces:
  1. group-to-node splits: EPLB's, EPLB's improved by swapping groups between
     nodes, and (when the splits can be enumerated, e.g. G <= 8) the best few
     by the node-level lower bound;
  2. per node: EPLB's greedy replica counts (they minimise the max load per
     replica), packed by EPLB's balanced packing and then improved by swap
     local search between the most loaded GPU and the others (one-for-one,
     then two-for-two, so every GPU keeps R/P slots);
  3. then single replicas are moved between experts (e.g. one replica fewer
     for a hot expert, one more for another) while that lowers the node's max
     GPU load: minimising the max replica load is not the same as minimising
     the max GPU load once every GPU must hold exactly R/P replicas.
  Per layer the best of these plans and EPLB's own is returned, so the result
  is never worse than EPLB by construction.
Evaluation (evaluate.py): `gpu_loads`, `max_over_mean` and `lower_bound` (what no plan can beat).

Applying a plan at run time (runtime.py; pure pieces, parallel/replicas.py builds on them):
- `check_plan`: a phy2log table against a model and an EP size;
- `relabel_gpus`: which EP rank hosts each plan GPU, so that as many slots as
  possible hold an expert whose weights already live on that rank;
- `replica_candidates` / `pick_replicas`: the physical slot each routed copy
  goes to (a replica on the sender's own rank if there is one, else round-robin
  over the expert's replicas).
Online re-placement's planning (online.py: owned slots that move, redundant
slots holding copies; what parallel/slots.py's Replacer decides and the
planner replays): `replan`, `copy_slots`, `keep_in_place`, `rank_loads`.
"""
from .eplb import (PlacementError, balanced_packing, check_layout, eplb_reference, is_hierarchical,
                   replicate_experts)
from .evaluate import gpu_loads, lower_bound, max_over_mean
from .runtime import check_plan, pick_replicas, relabel_gpus, replica_candidates
from .search import log2phy_from_phy2log, rebalance_experts

__all__ = [
    "PlacementError",
    "check_layout",
    "is_hierarchical",
    "balanced_packing",
    "replicate_experts",
    "eplb_reference",
    "rebalance_experts",
    "gpu_loads",
    "max_over_mean",
    "lower_bound",
    "log2phy_from_phy2log",
    "check_plan",
    "relabel_gpus",
    "replica_candidates",
    "pick_replicas",
]
