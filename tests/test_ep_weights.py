"""Expert weights per rank after real Trainer steps (world 4, ep 2: dp 4, edp 2).

The Trainer is built in-process in 4 spawned gloo ranks exactly as
moe_trainer.train.main builds it, trained a few steps, and every rank's local
expert weights are all-gathered. Asserted:
  * an expert's replicas are bit-identical on every rank of its expert-data-
    parallel group ([0, 2] hold experts 0..3, [1, 3] hold experts 4..7);
  * the two EP ranks' experts differ, and the experts within a rank differ;
  * the experts trained (moved from their initial values).
Negative control: the same run with the DeepSpeed MoE marker removed (the
engine then treats experts as dense, all-reduces their gradients over all 4
data-parallel ranks and ZeRO-1 all-gathers one copy of the flat buffer to every
rank) must violate the check: expert e on EP rank 0 ends up equal to expert
e + 4 on EP rank 1.
"""
import os

import torch
import torch.distributed as dist

from moe_trainer.moe.layer import MoE

from conftest import ROOT, spawn_ranks
from test_ep_accounting import trainer_in_rank

STEPS = 3


def local_expert_weights(trainer) -> torch.Tensor:
    """(moe layers, n_local, params per expert) of this rank, fp32."""
    layers = [m for m in trainer.engine.module.modules() if isinstance(m, MoE)]
    return torch.stack([torch.cat([m.experts.gate_up_proj.detach().flatten(1),
                                   m.experts.down_proj.detach().flatten(1)], 1).float() for m in layers])


def violations(w: list[torch.Tensor], init: list[torch.Tensor], ep: int) -> list[str]:
    """Problems with per-rank expert weights w[rank] (rank's EP index = rank % ep, EDP group = rank % ep)."""
    out = []
    world = len(w)
    for r in range(world):
        for q in range(r + 1, world):
            same = torch.equal(w[r], w[q])
            if r % ep == q % ep and not same:
                out.append(f"replicas differ: ranks {r} and {q} (same experts) max diff "
                           f"{(w[r] - w[q]).abs().max().item():.3g}")
            if r % ep != q % ep:
                for layer in range(w[r].shape[0]):
                    for e in range(w[r].shape[1]):
                        if torch.equal(w[r][layer, e], w[q][layer, e]):
                            out.append(f"different experts equal: layer {layer} local expert {e} on ranks {r} "
                                       f"(EP {r % ep}) and {q} (EP {q % ep})")
    for r in range(world):
        n_local = w[r].shape[1]
        for layer in range(w[r].shape[0]):
            for a in range(n_local):
                for b in range(a + 1, n_local):
                    if torch.equal(w[r][layer, a], w[r][layer, b]):
                        out.append(f"experts {a} and {b} equal on rank {r}, layer {layer}")
        if torch.equal(w[r], init[r]):
            out.append(f"rank {r}: experts did not train")
    return out


def _weights_worker(rank, world, port, remove_marker, out_dir, results):
    os.chdir(ROOT)
    if remove_marker:  # DeepSpeed sees no MoE: expert grads are reduced and gathered as if dense
        from moe_trainer.parallel import parallelize
        apply = parallelize.apply_expert_parallel

        def apply_without_moe_marks(model, *a, **k):
            model = apply(model, *a, **k)
            model.deepspeed_moe_marker = None
            for p in model.parameters():
                for attr in ("allreduce", "group_name"):
                    if hasattr(p, attr):
                        delattr(p, attr)
            return model
        parallelize.apply_expert_parallel = apply_without_moe_marks
    trainer = trainer_in_rank(rank, world, port, ["parallel.ep=2", f"train.max_steps={STEPS}"], out_dir)
    init = local_expert_weights(trainer)
    for _ in range(STEPS):
        trainer.train_step()
        trainer.step += 1
    mine = local_expert_weights(trainer)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    inits = [torch.empty_like(init) for _ in range(world)]
    dist.all_gather(gathered, mine)
    dist.all_gather(inits, init)
    if rank == 0:
        results["violations"] = violations(gathered, inits, trainer.mesh.size("ep"))
        results["has_moe_layers"] = bool(trainer.engine.has_moe_layers)
    dist.barrier()
    dist.destroy_process_group()


def test_expert_weights_synchronised_only_within_expert_data_parallel_group(tmp_path):
    res = spawn_ranks(_weights_worker, 4, False, str(tmp_path / "ok"))
    assert res["has_moe_layers"]
    assert res["violations"] == []


def test_negative_control_experts_treated_as_dense_is_caught(tmp_path):
    res = spawn_ranks(_weights_worker, 4, True, str(tmp_path / "dense"))
    assert not res["has_moe_layers"]
    assert any(v.startswith("different experts equal") for v in res["violations"]), res["violations"]
