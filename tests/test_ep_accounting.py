"""Expert-parallel dispatch on spawned gloo ranks: byte accounting against the
planner, the dedup dispatcher against the single-rank layer, and the same
accounting through the real Trainer (in-process and under the deepspeed launcher).

What is asserted about bytes: for the routing the router actually chose (read
with a forward hook and all-gathered over the EP group), the dispatcher's
CommCounter on each rank equals `plan.alltoall_bytes_exact` for that rank:
    sent[dispatch]      == dispatch_send     received[dispatch]      == dispatch_recv
    sent[combine]       == combine_send      received[combine]       == combine_recv
    sent[dispatch_grad] == dispatch_recv     sent[combine_grad]      == combine_recv
(the backward of an all-to-all is the reverse all-to-all), with and without dedup.
"""
import os
import subprocess
import textwrap

import pytest
import torch
import torch.distributed as dist

from moe_trainer import plan
from moe_trainer.moe.layer import MoE
from moe_trainer.parallel.comm import CommCounter
from moe_trainer.parallel.expert import AllToAllDispatcher, shard_experts

from conftest import ROOT, TINY, VENV_BIN, EventLikeClock, check, env, ep_layer_parity_errors, free_port, read_metrics, spawn_ranks

E, K, D, H = 8, 2, 16, 8
KINDS = ("dispatch", "combine", "dispatch_grad", "combine_grad")


def make_layer(n_group, topk_group, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layer = MoE(D, E, K, H, n_shared_experts=1, n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                routed_scaling_factor=1.5)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer.to(dtype)


def expected_counts(routing, rank, ep, row_elem_bytes, dedup):
    """CommCounter's expected sent/received per kind, from the planner."""
    b = plan.alltoall_bytes_exact(routing, E, ep, rank, D, row_elem_bytes, dedup)
    sent = {"dispatch": b.dispatch_send, "combine": b.combine_send,
            "dispatch_grad": b.dispatch_recv, "combine_grad": b.combine_recv}
    received = {"dispatch": b.dispatch_recv, "combine": b.combine_recv,
                "dispatch_grad": b.dispatch_send, "combine_grad": b.combine_send}
    return sent, received


def gather_routing(topk_idx, group=None):
    """Every EP rank's (N, k) routing, rank-major (all ranks have N tokens here)."""
    out = [torch.empty_like(topk_idx) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, topk_idx.contiguous(), group=group)
    return out


def _layer_case(rank, world, dedup, routing_mode, dtype) -> dict:
    """One MoE layer's forward + backward on this EP rank's tokens: counted bytes against the planner's,
    and (fp32) outputs and gradients against the single-rank layer on all ranks' tokens."""
    # node-limited: one group of experts per EP rank, each token picks one group (as DeepSeek-V3 maps
    # groups to nodes); free: plain top-k over all experts
    n_group, topk_group = (world, 1) if routing_mode == "node_limited" else (1, 1)
    errors = []
    xs = [torch.randn(3, 5, D, generator=torch.Generator().manual_seed(7 + r)).to(dtype) for r in range(world)]
    ref = make_layer(n_group, topk_group, dtype=dtype)
    x_ref = torch.cat(xs).requires_grad_()
    ref_out, _ = ref(x_ref)
    ref_out.float().pow(2).sum().backward()

    layer = make_layer(n_group, topk_group, dtype=dtype)
    shard_experts(layer, rank, world)
    counter = CommCounter(EventLikeClock())
    layer.dispatcher = AllToAllDispatcher(E, world, dist.group.WORLD, counter=counter, dedup=dedup)
    seen = []
    layer.gate.register_forward_hook(lambda m, i, o: seen.append(o.topk_idx.detach().clone()))
    x = xs[rank].clone().requires_grad_()
    out, _ = layer(x)
    out.float().pow(2).sum().backward()

    routing = gather_routing(seen[0])
    sent, received = expected_counts(routing, rank, world, torch.finfo(dtype).bits // 8, dedup)
    got_sent = {k: counter.sent.get(k, 0) for k in KINDS}
    got_recv = {k: counter.received.get(k, 0) for k in KINDS}
    if got_sent != sent or got_recv != received:
        errors.append(f"bytes: counted sent {got_sent} received {got_recv}; planned sent {sent} received {received}")
    # every exchange is timed by clock marks (CUDA events on a GPU), readable only after the step's sync
    try:
        counter.reset()
        errors.append("the all-to-all times were read before the step's host sync")
    except AssertionError:
        pass
    counter.clock.synced = True
    counted = counter.reset()
    if set(counted["seconds"]) != set(counted["sent"]) | {"dispatch_counts"} or min(counted["seconds"].values()) <= 0:
        errors.append(f"timed kinds {counted['seconds']}, expected every counted kind {sorted(counted['sent'])} "
                      f"and dispatch_counts")

    if dtype == torch.float32:  # parity with the single-rank layer on all ranks' tokens
        errors += ep_layer_parity_errors(layer, ref, out, ref_out, x, x_ref, rank, world, 3, E)
    return {"errors": errors, "sent": got_sent, "n_routes": int(seen[0].numel()),
            "rows_sent": got_sent["dispatch"] // (D * (torch.finfo(dtype).bits // 8))}


# every (dedup, routing, dtype) case, run one after another in one process group per world size
# (each process start costs more than all the cases it runs)
CASES = [(dedup, routing, "float32") for routing in ("free", "node_limited") for dedup in (False, True)] + \
        [(True, "free", "bfloat16")]


def _layer_worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results[rank] = {case: _layer_case(rank, world, case[0], case[1], getattr(torch, case[2])) for case in CASES}
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def layer_runs(request):
    """{case: {rank: result}} of every CASES entry on `world` spawned gloo ranks."""
    world = request.param
    by_rank = spawn_ranks(_layer_worker, world)
    return world, {case: {r: by_rank[r][case] for r in by_rank} for case in CASES}


@pytest.mark.parametrize("dedup", [False, True])
def test_dispatcher_bytes_equal_planner_and_layer_equals_single_rank(layer_runs, dedup):
    _, runs = layer_runs
    res = runs[(dedup, "free", "float32")]
    assert all(not r["errors"] for r in res.values()), {k: r["errors"] for k, r in res.items()}
    assert sum(r["sent"]["dispatch"] for r in res.values()) > 0


def test_dedup_bytes_bf16_equal_planner(layer_runs):
    _, runs = layer_runs
    res = runs[(True, "free", "bfloat16")]
    assert all(not r["errors"] for r in res.values()), {k: r["errors"] for k, r in res.items()}


def test_dedup_sends_fewer_bytes_for_node_limited_routing(layer_runs):
    """Each token picks one group = one EP rank, so dedup sends at most one row per token (k without);
    the router and inputs are identical in both runs, so the routing is too."""
    _, runs = layer_runs
    plain, dedup = runs[(False, "node_limited", "float32")], runs[(True, "node_limited", "float32")]
    for res in (plain, dedup):
        assert all(not r["errors"] for r in res.values()), {k: r["errors"] for k, r in res.items()}
    total_plain = sum(r["sent"]["dispatch"] for r in plain.values())
    total_dedup = sum(r["sent"]["dispatch"] for r in dedup.values())
    assert 0 < total_dedup <= total_plain / K  # K experts of one rank -> one row
    for r in dedup.values():
        assert r["rows_sent"] <= r["n_routes"] // K


# ------------------------------------------------------------------ through the real Trainer, in-process

def trainer_in_rank(rank, world, port, overrides, out_dir):
    """What moe_trainer.train.main does, inside a spawned rank: returns the Trainer."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from moe_trainer.config import validate_layout
    from moe_trainer.resolve import load_config
    from moe_trainer.parallel.mesh import build_mesh
    from moe_trainer.trainer import Trainer
    cfg = load_config(str(ROOT / "configs/moe_tiny.yaml"), TINY + overrides + [f"run.out_dir={out_dir}"])
    cfg.data.path = str(ROOT / cfg.data.path) if cfg.data.path and not os.path.isabs(cfg.data.path) \
        else cfg.data.path
    layout = validate_layout(cfg, world)
    from moe_trainer.parallel.launch import init_distributed
    init_distributed(300)  # and unlink DeepSpeed's /dev/shm segment
    mesh = build_mesh(layout, rank)
    return Trainer(cfg, mesh, torch.device("cpu"))


def moe_modules(trainer):
    return [m for m in trainer.engine.module.modules() if isinstance(m, MoE)]


def _trainer_worker(rank, world, port, overrides, out_dir, results):
    os.chdir(ROOT)
    trainer = trainer_in_rank(rank, world, port, overrides, out_dir)
    seen = []  # (layer index, topk_idx) per training forward, in call order
    for i, m in enumerate(moe_modules(trainer)):
        m.gate.register_forward_hook(lambda mod, a, o, i=i: seen.append((i, o.topk_idx.detach().clone())))
    ep, ep_group = trainer.mesh.size("ep"), trainer.mesh.group("ep")
    ep_rank = trainer.mesh.index("ep")
    dedup = trainer.cfg.parallel.dedup_dispatch
    hidden = trainer.cfg.model.hidden_size
    elem = 2 if trainer.cfg.train.dtype == "bf16" else 4
    errors, steps = [], []
    for step in range(3):
        seen.clear()
        record = trainer.train_step()
        trainer.step += 1
        want = {k: 0 for k in KINDS}
        for _, topk in seen:
            routing = gather_routing(topk, ep_group)
            b = plan.alltoall_bytes_exact(routing, trainer.cfg.model.n_routed_experts, ep, ep_rank, hidden, elem,
                                          dedup)
            want["dispatch"] += b.dispatch_send
            want["combine"] += b.combine_send
            want["dispatch_grad"] += b.dispatch_recv
            want["combine_grad"] += b.combine_recv
        got = {k: record["comm"]["sent"].get(k, 0) for k in KINDS}
        steps.append((got, want, len(seen)))
        if got != want:
            errors.append(f"step {step}: trainer counted {got}, planner {want}")
    results[rank] = {"errors": errors, "steps": steps}
    dist.destroy_process_group()


@pytest.mark.parametrize("dedup", [False, True])
def test_trainer_step_bytes_equal_planner(tmp_path, dedup):
    """The Trainer's per-step CommCounter record (what it logs as comm.*_sent_bytes) equals the planner's
    exact bytes for the routing of every MoE layer and micro-batch of that step."""
    overrides = ["parallel.ep=2", f"parallel.dedup_dispatch={str(dedup).lower()}"]
    res = spawn_ranks(_trainer_worker, 2, overrides, str(tmp_path / "run"))
    assert all(not r["errors"] for r in res.values()), {k: r["errors"] for k, r in res.items()}
    for r in res.values():
        for got, _want, forwards in r["steps"]:  # got == want: the ranks' errors, above
            assert forwards == 2 * 2  # 2 MoE layers (TINY: 3 layers, first dense) x 2 micro-batches
            assert got["dispatch"] > 0


# ------------------------------------------------------------------ under the deepspeed launcher, from the logs

PROBE = textwrap.dedent('''
    """Run moe_trainer.train unchanged, recording every training forward's routing to a file per rank."""
    import os, sys
    sys.path.insert(0, {root!r})
    import torch
    from moe_trainer.moe import router
    seen = []
    _forward = router.Router.forward
    def forward(self, x):
        r = _forward(self, x)
        if self.training:
            seen.append(r.topk_idx.detach().clone())
        return r
    router.Router.forward = forward
    from moe_trainer.train import main
    rc = main(sys.argv[1:])
    torch.save(seen, os.path.join({out!r}, "routing_rank%s.pt" % os.environ["RANK"]))
    sys.exit(rc)
''')


def test_launched_trainer_logged_bytes_equal_planner(tmp_path, dedup=True):
    """Real launcher, real train.main, deduplicated dispatch (the plain one's logged bytes are checked in
    process by test_trainer_step_bytes_equal_planner, through the same CommCounter): rank 0's logged comm.dispatch_sent_bytes (and combine) per step equals
    plan.alltoall_bytes_exact over the routings both ranks recorded; those routings are tied to the trainer's
    own logs by their per-expert counts equalling the logged expert load of each step."""
    from moe_trainer.expert_load import expert_load_path, read_expert_load
    out = tmp_path / "run"
    out.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(root=str(ROOT), out=str(out)))
    steps, layers, micro = 3, 2, 2
    overrides = TINY + [f"train.max_steps={steps}", "parallel.ep=2", f"parallel.dedup_dispatch={str(dedup).lower()}",
                        f"run.out_dir={out}"]
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(probe),
           "--config=configs/moe_tiny.yaml"] + [a for o in overrides for a in ("--set", o)]
    check(subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300))
    routing = [torch.load(out / f"routing_rank{r}.pt") for r in range(2)]
    assert all(len(rr) == steps * micro * layers for rr in routing)
    metrics = {m["step"]: m for m in read_metrics(out) if "comm.dispatch_sent_bytes" in m}
    assert sorted(metrics) == list(range(1, steps + 1))
    cfg_hidden = int(next(o for o in TINY if o.startswith("model.hidden_size=")).split("=")[1])
    n_exp = int(next(o for o in TINY if o.startswith("model.n_routed_experts=")).split("=")[1])
    for s in range(steps):
        calls = range(s * micro * layers, (s + 1) * micro * layers)  # micro-major, layer-minor
        want = {"dispatch": 0, "combine": 0}
        load = torch.zeros(layers, n_exp)
        for c in calls:
            b = plan.alltoall_bytes_exact([routing[0][c], routing[1][c]], n_exp, 2, 0, cfg_hidden, 4, dedup)
            want["dispatch"] += b.dispatch_send
            want["combine"] += b.combine_send
            for r in range(2):
                load[c % layers] += torch.bincount(routing[r][c].reshape(-1), minlength=n_exp).float()
        m = metrics[s + 1]
        assert m["comm.dispatch_sent_bytes"] == want["dispatch"], (s, m["comm.dispatch_sent_bytes"], want)
        assert m["comm.combine_sent_bytes"] == want["combine"], (s, m["comm.combine_sent_bytes"], want)
        logged = read_expert_load(expert_load_path(out, s + 1))
        torch.testing.assert_close(torch.as_tensor(logged.counts).float(), load, rtol=0, atol=0)
