"""NCCL's point-to-point rule on gloo ranks, for tests.

gloo buffers sends, so a pipeline whose ranks each send and then receive runs here and deadlocks on
GPUs, where NCCL runs a rank's point-to-point operations in issue order and a large send completes
only once the peer has posted the matching receive. `install()` wraps torch.distributed's isend,
irecv, send, recv and batch_isend_irecv in this process so that gloo obeys that rule:

- a receive is announced to its sender (a key in the job's rendezvous store) when it is posted;
- a send blocks, before it is handed to gloo, until its receive has been announced; every
  operation of one batch_isend_irecv is posted together (its receives announced first), as one
  NCCL group call is.

A schedule that would deadlock under NCCL then fails here within STRICT_P2P_TIMEOUT_S seconds with a
sentence naming the send, instead of passing. It also sets MOE_TRAINER_STRICT_P2P=1, under which the
pipeline's shared-memory transport (kernels/cpu/shm_alltoall.py, `exchange`) holds each send until
its receiver has taken it; an order that deadlocks there fails after parallel.timeout_s. Run as a module, it installs the wrapper and runs
moe_trainer.train with the same arguments (tests/conftest.py's `launch` does this for every
multi-rank job).
"""
from __future__ import annotations

import os
import runpy
import threading
from collections import defaultdict
from datetime import timedelta

TIMEOUT_S = float(os.environ.get("STRICT_P2P_TIMEOUT_S", "60"))


class NcclRuleDeadlock(RuntimeError):
    """A send whose receive was never posted: this order deadlocks under NCCL."""


def install(timeout_s: float = TIMEOUT_S) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d, "_strict_p2p_installed", False):
        return
    # the pipeline's shared-memory transport between CPU ranks (parallel.cpu_p2p=shm) keeps the same
    # rule itself when asked: each send waits until its receiver has taken it
    os.environ["MOE_TRAINER_STRICT_P2P"] = "1"
    orig = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv")}
    sent, posted = defaultdict(int), defaultdict(int)  # (src, dst) -> messages so far
    inside = threading.local()

    def key(src: int, dst: int, n: int) -> str:
        return f"strict_p2p/{src}->{dst}/{n}"

    def announce_recv(src: int) -> None:
        me = dist.get_rank()
        n = posted[(src, me)]
        posted[(src, me)] += 1
        c10d._get_default_store().set(key(src, me, n), "posted")

    def await_recv(dst: int) -> None:
        me = dist.get_rank()
        n = sent[(me, dst)]
        sent[(me, dst)] += 1
        try:
            c10d._get_default_store().wait([key(me, dst, n)], timedelta(seconds=timeout_s))
        except Exception as e:  # the store's timeout
            raise NcclRuleDeadlock(f"rank {me}: send #{n} to rank {dst} found no posted receive within "
                                   f"{timeout_s:.0f} s: under NCCL this point-to-point order deadlocks "
                                   f"({type(e).__name__})") from e

    def global_peer(group, peer, group_peer):
        if peer is not None:
            return peer
        return c10d.get_global_rank(group or c10d._get_default_group(), group_peer)

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        if not getattr(inside, "batch", False):
            await_recv(global_peer(group, dst, group_dst))
        return orig["isend"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        if not getattr(inside, "batch", False):
            announce_recv(global_peer(group, src, group_src))
        return orig["irecv"](tensor, src=src, group=group, tag=tag, group_src=group_src)

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        await_recv(global_peer(group, dst, group_dst))
        return orig["send"](tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        announce_recv(global_peer(group, src, group_src))
        return orig["recv"](tensor, src=src, group=group, tag=tag, group_src=group_src)

    def batch_isend_irecv(p2p_op_list):
        for op in p2p_op_list:  # one group call: its receives are posted before any of its sends waits
            if op.op is irecv:
                announce_recv(op.peer)
        for op in p2p_op_list:
            if op.op is isend:
                await_recv(op.peer)
        inside.batch = True
        try:
            return orig["batch_isend_irecv"](p2p_op_list)
        finally:
            inside.batch = False

    for name, fn in (("isend", isend), ("irecv", irecv), ("send", send), ("recv", recv),
                     ("batch_isend_irecv", batch_isend_irecv)):
        setattr(c10d, name, fn)  # P2POp checks its op against c10d's own isend / irecv
        setattr(dist, name, fn)
    c10d._strict_p2p_installed = True


if __name__ == "__main__":
    install()
    runpy.run_module("moe_trainer.train", run_name="__main__", alter_sys=True)
