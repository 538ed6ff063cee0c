"""The rank order and its groups: one pure function of the layout and the node size (parallel/mesh.py).
MoE runs use Megatron-Core's tp-cp-ep-dp-pp order, so TP and EP groups sit inside a node whenever
they fit; dense runs keep Llama 3's [tp, cp, pp, dp]. build_mesh makes the same group-creation calls
on every rank (NCCL's rule), one communicator per distinct rank set."""
import itertools

import pytest

from moe_trainer.config import DENSE_ORDER, MOE_ORDER, ConfigError, Layout, validate_layout
from moe_trainer.resolve import load_config
from moe_trainer.parallel import mesh as mesh_mod
from moe_trainer.parallel.mesh import build_mesh
from moe_trainer.parallel.order import (DIMS, coords, describe_nodes, expert_group_nodes, group_ranks, layout_warnings,
                                        nodes_spanned, rank_of)


def layout(world, pp=1, tp=1, cp=1, ep=1, order=MOE_ORDER, node=0) -> Layout:
    dp = world // (pp * tp * cp)
    return Layout(world=world, pp=pp, tp=tp, cp=cp, dp=dp, ep=ep, edp=dp * cp // ep, grad_accum=1, order=order,
                  gpus_per_node=node)


LAYOUTS = [layout(16, pp=2, ep=8), layout(16, pp=2, tp=2, cp=2, ep=2), layout(24, pp=3, tp=2, ep=4),
           layout(8, cp=2, tp=2, ep=4), layout(12, pp=3, cp=2, ep=1)]


@pytest.mark.parametrize("order", [MOE_ORDER, DENSE_ORDER, "pp-tp-cp-dp"])
@pytest.mark.parametrize("base", LAYOUTS, ids=str)
def test_every_kind_partitions_the_world_and_coords_invert(order, base):
    L = Layout(**{**base.__dict__, "order": order})
    for r in range(L.world):
        c = coords(r, L)
        assert rank_of(L, **{d: c[d] for d in DIMS}) == r
    for kind, lists in group_ranks(L).items():
        assert sorted(itertools.chain(*lists)) == list(range(L.world)), kind  # each rank once
        assert all(g == sorted(g) for g in lists), kind  # torch's new_group sorts: index = group rank
        assert len({len(g) for g in lists}) == 1, kind
    g = group_ranks(L)
    for r in range(L.world):  # a rank's expert coordinates are its position in its ep / edp groups
        c = coords(r, L)
        ep = next(x for x in g["ep"] if r in x)
        edp = next(x for x in g["edp"] if r in x)
        assert ep.index(r) == c["ep"] and edp.index(r) == c["edp"]
        assert all(coords(q, L)["pp"] == c["pp"] and coords(q, L)["tp"] == c["tp"] for q in ep + edp)


def test_moe_order_keeps_tp_and_ep_inside_a_node_and_the_pipeline_outside():
    L = layout(32, pp=2, tp=2, ep=4, node=8)  # tp * ep = 8 = one node
    assert nodes_spanned(L)["tp"] == 1 and nodes_spanned(L)["ep"] == 1 and nodes_spanned(L)["pp"] == 2
    assert layout_warnings(L) == []
    old = Layout(**{**L.__dict__, "order": DENSE_ORDER})  # the order every MoE run had before
    assert nodes_spanned(old)["ep"] == 2  # each EP group over 2 nodes: the defect this order fixes
    assert any("ep groups" in w for w in layout_warnings(old))


def test_shipped_16_gpu_config_keeps_ep_in_a_node():
    cfg = load_config("configs/moe_1b_16gpu.yaml", [])
    L = validate_layout(cfg, 16, local_world_size=8)  # the launcher's LOCAL_WORLD_SIZE
    assert L.order == MOE_ORDER and L.gpus_per_node == 8
    ep = group_ranks(L)["ep"]
    assert ep == [list(range(8)), list(range(8, 16))]
    assert nodes_spanned(L) == {**nodes_spanned(L), "ep": 1, "pp": 2}


def test_deepseek_v3_671b_ep64_groups_span_exactly_8_nodes_and_expert_groups_follow_nodes():
    cfg = load_config("configs/deepseek_v3_671b.yaml", ["parallel.gpus_per_node=8"])
    L = validate_layout(cfg, 2048)
    m = cfg.model
    ep_groups = group_ranks(L)["ep"]
    assert len(ep_groups) == 2048 // 64
    assert all(len({r // 8 for r in g}) == 8 for g in ep_groups)  # each exactly 8 whole nodes
    assert expert_group_nodes(L, m.n_routed_experts, m.n_group) == 1  # 32 experts of a group on one node
    lines = describe_nodes(L, m.n_routed_experts, m.n_group, m.topk_group)
    assert "at most 4 node(s)" in lines[1] and not any(line.startswith("warning") for line in lines)
    # the same layout in Llama 3's order would have spread each EP group over 64 nodes
    assert nodes_spanned(Layout(**{**L.__dict__, "order": DENSE_ORDER}))["ep"] == 64


def test_dense_model_keeps_llama3_order_and_node_size_defaults():
    cfg = load_config("configs/llama3_tiny.yaml", ["parallel.tp=2", "parallel.pp=2"])
    L = validate_layout(cfg, 8)
    assert L.order == DENSE_ORDER and L.gpus_per_node == 8  # no launcher: one node holds the world
    g = group_ranks(L)
    assert g["tp"][0] == [0, 1] and g["pp"][0] == [0, 2] and g["dp"][0] == [0, 4]
    assert validate_layout(cfg, 8, local_world_size=4).gpus_per_node == 4
    cfg = load_config("configs/llama3_tiny.yaml", ["parallel.tp=2", "parallel.gpus_per_node=3"])
    with pytest.raises(ConfigError, match="gpus_per_node"):
        validate_layout(cfg, 8)


def test_a_layout_that_cannot_fit_its_ep_groups_in_a_node_is_warned():
    L = layout(24, ep=6, node=8)  # 6 does not divide 8: groups [6..11], [18..23] straddle nodes
    assert nodes_spanned(L)["ep"] == 2
    assert any(w.startswith("warning: ep groups") for w in describe_nodes(L))


class RecordingDist:
    """torch.distributed's group-creation calls as one rank makes them, recorded."""

    def __init__(self):
        self.calls = []
        self.group = type("G", (), {"WORLD": type("W", (), {"bound_device_id": None})()})

    def new_group(self, ranks, timeout=None):
        self.calls.append(tuple(ranks))
        return ("pg", tuple(ranks))


@pytest.mark.parametrize("base", LAYOUTS[:3], ids=str)
def test_every_rank_makes_the_same_group_calls_once_per_distinct_rank_set(monkeypatch, base):
    seqs = {}
    for r in range(base.world):
        fake = RecordingDist()
        monkeypatch.setattr(mesh_mod, "dist", fake)
        m = build_mesh(base, r)
        seqs[r] = fake.calls
        for kind, members in m.members.items():
            pg = m.group_or_self(kind)
            assert pg == ("pg", tuple(members)), kind  # the group object of exactly these ranks
    assert all(s == seqs[0] for s in seqs.values())  # NCCL: every rank, every creation, same order
    sets = [c for c in seqs[0] if len(c) > 1]
    assert len(sets) == len(set(sets))  # one communicator per distinct rank set
    distinct = {tuple(g) for lists in group_ranks(base).values() for g in lists if len(g) > 1}
    assert set(sets) == distinct
    degree_one = any(len(lists[0]) == 1 for lists in group_ranks(base).values())
    assert [c for c in seqs[0] if len(c) == 1] == ([(r,) for r in range(base.world)] if degree_one else [])
