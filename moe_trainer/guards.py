"""The fault guards of the training loop, as one component the loop calls at fixed points.

    before_step(step)      kill / hang / slow injection; the replica check when it is due
    lr_factor(step)        spike injection: the step's learning rate factor      (before forward)
    poisoned(step)         nan injection: is this rank's loss made non-finite    (before forward)
    after_step(record)     bit-flip injection; the NaN policy; the spike guard   (after the optimizer step)
                           -> True when the run rolled back (the step counter is the checkpoint's)
    before_checkpoint()    the replica check, if this state has not passed it    (before a checkpoint)
                           -> True when the run rolled back
    at_log_step(record)    straggler naming, with the ranks' compute times       (at log steps)
    state_dict()           saved in each checkpoint, loaded at a resume: the spike guard's history and
                           the rest of what decides the next step, so a restart guards as an
                           uninterrupted run would

The mechanisms live in faults.py (injection, checksums, the spike rule, straggler events); this
module decides when they run and what the run does about what they find: repair, roll back, skip,
stop. It holds the trainer it guards: a rollback loads a checkpoint into it and moves its step.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist

from . import checkpoint, checkpoint_pick
from .compile import forward_waits_timed
from .faults import (Faults, ReplicaCheck, SpikeGuard, owner_drift, owner_partitions, parse_faults, repair_from_owners,
                     straggler_events)
from .parallel.comm import all_reduce_small
from .parallel.launch import progress


class TrainingHalted(RuntimeError):
    """Training stopped by policy (e.g. repeated non-finite losses): one sentence, exit 3."""


class Guards:
    def __init__(self, trainer):
        self.trainer = trainer
        cfg, t, mesh = trainer.cfg, trainer.cfg.train, trainer.mesh
        self.cfg, self.mesh, self.layout, self.is_logger = cfg, mesh, trainer.layout, trainer.is_logger
        # the faults of a long run (faults.py); None when unset, so the loop makes no call for them
        self.faults = (Faults(parse_faults(cfg.debug.faults, self.layout.world), trainer.out_dir, mesh.rank)
                       if cfg.debug.faults else None)
        self.replicas = ReplicaCheck(trainer.engine.module, mesh, t.replica_check_every)
        self.replicas = self.replicas if self.replicas.sets and t.replica_check_every else None
        self.owners = owner_partitions(trainer.engine) if self.replicas else None  # (fp32 master, model slice)
        self.last_checked: Optional[int] = None  # the newest step whose state passed the replica check
        self.spikes = SpikeGuard() if t.spike_guard else None
        self.rolled_back_to: Optional[int] = None  # the checkpoint step of the last rollback
        self._nan_skips = 0

    def _event(self, step: int, row: dict, tb_prefix: str = "") -> None:
        self.trainer.observers.event(step, row, tb_prefix)

    def _find(self, at_most: int):
        """The newest intact checkpoint of step `at_most` or before (collective: every rank agrees)."""
        return checkpoint_pick.pick(self.trainer.out_dir, "auto", self.mesh.rank, self.layout.world,
                                    self.trainer.device, warn=self.is_logger, at_most=at_most)

    # ------------------------------------------------------------------ the loop's fixed points
    def before_step(self, step: int) -> None:
        """At the start of step `step` (1-based): injected kill / hang / slow, then the replica check."""
        if self.faults:
            self.faults.before_step(step)
        if self.replicas and self.replicas.due(step - 1) and self.last_checked != step - 1:
            progress(step, "replica check")
            self.check_replicas()

    def before_checkpoint(self) -> bool:
        """Before a checkpoint is written (every train.checkpoint_every steps and at the last step): the
        replica check, unless this state passed it already, so that no checkpoint is written from
        replicas that were never compared, however short the run. True if it rolled back (a corrupt
        owner partition): the checkpoint is not written, the loop goes on from the older one."""
        tr = self.trainer
        if not self.replicas or self.last_checked == tr.step:
            return False
        at = tr.step
        progress(at, "replica check")
        self.check_replicas()
        return tr.step != at

    def lr_factor(self, step: int) -> float:
        """spike@S: a diverging update."""
        return self.faults.lr_factor(step) if self.faults else 1.0

    def poisoned(self, step: int) -> bool:
        """This step's loss made non-finite on the last rank (debug.inject_nan_steps, or nan@S)."""
        steps = self.cfg.debug.inject_nan_steps
        planned = bool(steps) and step in steps
        fault = self.faults is not None and self.faults.poison(step)
        return (planned or fault) and self.mesh.rank == self.layout.world - 1

    def after_step(self, record: dict) -> bool:
        """After the optimizer step (the trainer's step counter counts it): an injected bit flip, the
        NaN policy, the spike guard. True if the run rolled back."""
        if self.faults:
            self.flip_bit()
        self.check_finite(record)
        return bool(self.spikes and not record["skipped"] and self.guard_spike(record))

    def at_log_step(self, record: dict) -> None:
        self.name_stragglers(record)

    # ------------------------------------------------------------------ restart state
    def state_dict(self) -> dict:
        """What a resumed run needs to guard its next step exactly as the uninterrupted run would: the
        spike guard's history, the last rollback, the non-finite steps in a row, the last step the
        replica check passed. The same on every rank (reduced values, collective decisions), so it is
        written once, in the checkpoint's state.json (under the manifest's checksum)."""
        return {"spike_guard": self.spikes.state_dict() if self.spikes else None,
                "rolled_back_to": self.rolled_back_to, "nan_skips": self._nan_skips, "last_checked": self.last_checked}

    def load_state_dict(self, state: dict) -> None:
        """At a resume (not at a rollback, which starts the spike history afresh). A checkpoint from
        before the guards were saved leaves them as a fresh start has them."""
        if self.spikes is not None and state.get("spike_guard") is not None:
            self.spikes.load_state_dict(state["spike_guard"])
        self.rolled_back_to = state.get("rolled_back_to")
        self._nan_skips = int(state.get("nan_skips", 0))
        self.last_checked = state.get("last_checked")

    # ------------------------------------------------------------------ NaN
    def check_finite(self, record: dict) -> None:
        """NaN/inf loss policy: the optimizer skipped the step (DeepSpeed skips
        non-finite gradient norms); allow max_nan_skips in a row, then stop with a
        checkpoint of the last good state (unchanged by the skipped steps)."""
        if not record["skipped"]:
            self._nan_skips = 0
            return
        tr = self.trainer
        self._nan_skips += 1
        limit = self.cfg.train.max_nan_skips
        if self.is_logger:
            print(f"warning: step {tr.step}: non-finite loss ({record['losses']['lm']}); step skipped "
                  f"({self._nan_skips} in a row, train.max_nan_skips={limit})", file=sys.stderr, flush=True)
            # JSON has no NaN: the loss is written as its name; in TensorBoard events/nan/in_a_row
            self._event(tr.step, {"event": "nan", "lm_loss": str(record["losses"]["lm"]), "in_a_row": self._nan_skips,
                                  "action": "stopped" if self._nan_skips > limit else "skipped"},
                        tb_prefix="events/nan/")
        if self._nan_skips > limit:
            tr.step -= self._nan_skips  # the weights are those after the last good step
            tr.save_checkpoint()
            raise TrainingHalted(f"stopped at step {tr.step + self._nan_skips}: {self._nan_skips} non-finite "
                                 f"losses in a row (train.max_nan_skips={limit}); the last good state is "
                                 f"checkpoint step_{tr.step}.")

    # ------------------------------------------------------------------ faults that do not kill
    def flip_bit(self) -> None:
        """bitflip@S:R and bitflip_master@S:R, right after step S's update."""
        tr = self.trainer
        name = self.faults.after_update(tr.step, tr.engine.module)
        if name is not None:
            print(f"fault injected: rank {self.mesh.rank}: one bit flipped in {name} after step {tr.step}",
                  file=sys.stderr, flush=True)
        if self.faults.after_update_master(tr.step, tr.engine) is not None:
            print(f"fault injected: rank {self.mesh.rank}: one bit flipped in its ZeRO-1 fp32 master partition "
                  f"after step {tr.step}", file=sys.stderr, flush=True)

    def check_replicas(self) -> None:
        """Before this step's forward: do the replicas agree, and does every ZeRO-1 owner's fp32
        partition still match the model copy it wrote? A replica that differs is repaired from the
        owners' partitions (and the ranks whose copy changed are named); an owner's partition that
        differs while every replica agrees is the corrupt copy, with nothing to repair it from: the
        run rolls back. Collective; one host sync (a single fault at a time: a replica that differs
        in the owner's own slice explains that owner's drift too, so the repair comes first)."""
        flags = torch.stack([self.replicas.mismatched(), owner_drift(self.owners)]).to(torch.float32)
        if self.layout.world > 1:
            all_reduce_small(flags, op="max")
        replica_bad, owner_bad = flags.tolist()  # host sync, once per check
        if replica_bad:
            self.repair_replicas()
        elif owner_bad:
            self.roll_back_corrupt_owner()
        else:
            self.last_checked = self.trainer.step

    def repair_replicas(self) -> None:
        """Every rank's weights gathered again from the owners' partitions; the ranks whose copy
        changed are named. Collective."""
        before = self.replicas.local_sums()
        repair_from_owners(self.trainer.engine)
        changed = self.replicas.changed(before)
        reports = [None] * self.layout.world
        dist.all_gather_object(reports, changed)
        ranks = [r for r, names in enumerate(reports) if names]
        params = sorted({n for names in reports for n in names})
        if self.is_logger:
            event = {"event": "replica_mismatch", "ranks": ranks, "params": params, "action": "repaired"}
            print(f"replica mismatch before step {self.trainer.step + 1}: rank(s) {ranks} held a copy that differs "
                  f"in {len(params)} parameter(s) ({', '.join(params[:3])}{', ...' if len(params) > 3 else ''}); "
                  f"repaired from the ZeRO-1 owners' partitions", file=sys.stderr, flush=True)
            self._event(self.trainer.step, event)

    def roll_back_corrupt_owner(self) -> None:
        """An owner's fp32 partition differs from the weights every replica holds: back to the newest
        checkpoint at or before the last step that passed the check (the state after it was written
        is the one that check saw), the same batches replayed. Collective."""
        tr = self.trainer
        mine = bool(owner_drift(self.owners).item())  # host sync, on this rare path only
        reports = [None] * self.layout.world
        dist.all_gather_object(reports, mine)
        ranks = [r for r, bad in enumerate(reports) if bad]
        found_at = tr.step
        reason = (f"the ZeRO-1 fp32 master partition of rank(s) {ranks} differs from the weights every replica "
                  f"holds (found before step {found_at + 1})")
        at_most = self.last_checked if self.last_checked is not None else found_at - 1
        found = self._find(at_most)
        if found is None:
            raise TrainingHalted(f"stopped before step {found_at + 1}: {reason}, and no checkpoint from step "
                                 f"{at_most} or before is there to roll back to.")
        tr.step = checkpoint.load(found, tr)  # the batches after it are trained again, not skipped
        if self.spikes:
            self.spikes.reset()
        event = {"event": "rollback", "to": tr.step, "skipped_steps": [], "ranks": ranks,
                 "cause": "owner_partition", "reason": reason}
        if self.is_logger:
            print(f"{reason}; rolled back to {found}, training steps {tr.step + 1}-{found_at} again",
                  file=sys.stderr, flush=True)
            self._event(found_at, event, tb_prefix="events/rollback/")

    # ------------------------------------------------------------------ loss spikes
    def guard_spike(self, record: dict) -> bool:
        """A loss or gradient-norm spike (the same on every rank: both are reduced) rolls the run
        back to the last checkpoint before it, skipping the batches that led into it; a second
        spike before a newer checkpoint stops the run. True if it rolled back."""
        tr = self.trainer
        norm = tr.engine.get_global_grad_norm()
        reason = self.spikes.check(record["losses"]["lm"], float(norm) if norm is not None else None)  # host sync
        if reason is None:
            return False
        spiked = tr.step
        if self.rolled_back_to is not None and not (tr.out_dir / "checkpoints" /
                                                    f"step_{self.rolled_back_to}").is_dir():
            self.rolled_back_to = None  # pruned: a newer checkpoint came after the last rollback
        found = self._find(spiked - 2)
        if self.rolled_back_to is not None and (found is None or checkpoint.step_of(found) <= self.rolled_back_to):
            raise TrainingHalted(f"stopped at step {spiked}: {reason}, again after rolling back to step "
                                 f"{self.rolled_back_to}; the last good state is "
                                 f"{found if found is not None else 'not in a checkpoint'}.")
        if found is None:  # nothing to go back to (train.checkpoint_every 0, or none written yet): say so
            if self.is_logger:
                print(f"warning: loss spike at step {spiked}: {reason}; no checkpoint from before it to roll back "
                      f"to, training on", file=sys.stderr, flush=True)
                self._event(spiked, {"event": "spike", "reason": reason, "action": "none: no checkpoint"})
            return False
        skip_from = checkpoint.step_of(found) + 1
        tr.step = checkpoint.load(found, tr)  # restores data_offset as it was then
        tr.data_offset += spiked - tr.step  # and skips the batches of steps skip_from..spiked
        self.rolled_back_to = tr.step
        self.spikes.reset()
        event = {"event": "rollback", "to": tr.step, "skipped_steps": [skip_from, spiked], "reason": reason}
        if self.is_logger:
            print(f"loss spike at step {spiked}: {reason}; rolled back to {found} and skipping the batches of "
                  f"steps {skip_from}-{spiked}", file=sys.stderr, flush=True)
            self._event(spiked, event, tb_prefix="events/rollback/")
        return True

    # ------------------------------------------------------------------ stragglers
    def name_stragglers(self, r: dict) -> None:
        """Every rank's own compute time this step, gathered at log steps; ranks far above the median
        are named. Its own: loading its batches and its forward passes, less the time it spent inside
        the forward's collectives (the expert all-to-alls), where a rank waits for its slowest peer,
        so that at ep > 1 a straggler's EP peers do not look slow too. The backward is left out: ZeRO's
        bucketed gradient reduction runs inside it, where every rank waits for the slowest."""
        tr = self.trainer
        times = r["times"]
        seconds = r["comm"].get("seconds", {})
        # overlapped (parallel.overlap=a2a): a transfer's span runs from its issue to its completion,
        # beside the other micro-batch's compute; what the forward waited is a2a_wait_forward
        waits = seconds.get("a2a_wait_forward", 0.0) + sum(
            s for kind, s in seconds.items()
            if not kind.endswith("_grad") and not kind.startswith(("pp_", "overlapped_", "a2a_wait")))
        # compiled at ep > 1 the waits are inside graphs, untimed: the forward is left out on every rank
        forward = times.forward - waits if forward_waits_timed(tr.cfg) else 0.0
        mine = torch.tensor([max(times.data + forward, 0.0)], device=tr.device)
        every = torch.empty(self.layout.world, device=tr.device)
        dist.all_gather_into_tensor(every, mine)
        if not self.is_logger:
            return
        seconds = every.tolist()  # host sync, at log steps only
        sink = tr.observers.sink
        if sink and sink.tb is not None and self.layout.world <= 64:
            for rank, t in enumerate(seconds):
                sink.tb.add_scalar(f"rank_time/{rank}", t, tr.step)
        for event in straggler_events(seconds, tr.step, self.cfg.train.straggler_factor):
            print(f"straggler at step {tr.step}: rank {event['rank']} computed {event['ratio']}x the median "
                  f"rank's time", file=sys.stderr, flush=True)
            self._event(tr.step, {k: v for k, v in event.items() if k != "step"}, tb_prefix="events/straggler/")

