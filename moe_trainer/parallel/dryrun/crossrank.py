"""NCCL's rules that need more than one rank's log, checked once every chosen rank has run.

1. The members of a group enter the same collectives in the same order: per group, every member's
   ordered list of (op, dtype, element count, reduction, root) is the same (an all-to-all: op and
   dtype, its splits may differ). A member that makes one more, or a different one, hangs NCCL or
   silently mixes values (a loss summed with a gradient norm).
2. Point-to-point pairs each send with the peer's receive, in order and bytes (NCCL pairs them by
   order per peer).
3. A group whose first call is batched point-to-point (batch_isend_irecv) has every member make it
   (torch: otherwise "the behavior is undefined").

Ranks of one role (runner.role_of: pipeline stage, tp rank 0 or not) run the same program, so one
simulated rank stands for every rank of its role: `stand_in[r]` is the simulated rank whose log is
read for world rank r (r itself when it ran). A group of kind K is checked by comparing, for each
role among its members, the stand-in's calls on its own group of kind K. With every rank simulated
(`--ranks all`) every stand-in is the rank itself and this is the plain per-group comparison; with
`--ranks roles` it compares the roles that share a group (a dense-only stage against a MoE stage on
the pipeline group). A group with a member whose role did not run is not checked.
"""
from __future__ import annotations

from collections import defaultdict

from .nccl_rules import RuleError


def check_all(logs: dict, stand_in: dict, partitions: dict[str, list[list[int]]], world: int) -> None:
    """logs: simulated rank -> nccl_rules.RankLog; stand_in: world rank -> simulated rank (absent: its
    role did not run); partitions: group kind -> every group of the world (parallel.order.group_ranks)."""
    parts = {**partitions, "world": [list(range(world))]}
    group_of = {kind: {r: tuple(g) for g in lists for r in g} for kind, lists in parts.items()}
    check_sequences(logs, stand_in, parts, group_of)
    check_p2p(logs, stand_in, group_of)
    check_first_calls(logs, stand_in, parts, group_of)


def _roles_of(members, stand_in: dict) -> dict | None:
    """{stand-in: the first member it stands for}, or None when a member's role did not run."""
    seen: dict = {}
    for m in members:
        r = stand_in.get(m)
        if r is None:
            return None
        seen.setdefault(r, m)
    return seen


def check_sequences(logs: dict, stand_in: dict, parts: dict, group_of: dict) -> None:
    seqs: dict = defaultdict(list)  # (simulated rank, kind, its group) -> its calls there, in order
    others: dict = defaultdict(dict)  # groups the mesh does not name: group -> {simulated member: calls}
    for rank, log in logs.items():
        for call in log.calls:
            if call.kind in parts:
                seqs[(rank, call.kind, call.group)].append(call)
            elif call.kind != "self":
                others[call.group].setdefault(rank, []).append(call)
    done: set = set()
    for kind, lists in parts.items():
        for members in lists:
            roles = _roles_of(members, stand_in) if len(members) > 1 else None
            if not roles or len(roles) < 2:
                continue
            (r0, m0), *rest = roles.items()
            a = seqs[(r0, kind, group_of[kind][r0])]
            for r, m in rest:
                if (kind, r0, r) not in done:
                    done.add((kind, r0, r))
                    _compare(kind, members, (m0, r0), a, (m, r), seqs[(r, kind, group_of[kind][r])])
    for group, per_rank in others.items():  # compared between the members that ran
        ran = [r for r in group if r in logs]
        for r in ran[1:]:
            _compare("other", group, (ran[0], ran[0]), per_rank.get(ran[0], []), (r, r), per_rank.get(r, []))


def _who(member: int, rank: int) -> str:
    return f"rank {member}" if member == rank else f"rank {member} (as rank {rank} of its role ran)"


def _compare(kind: str, members, ma: tuple, a: list, mb: tuple, b: list) -> None:
    rule = "NCCL rule broken (the members of a group enter the same collectives in the same order)"
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b):
            (more, who), (other, n) = ((a, ma), (mb, len(b))) if len(a) > len(b) else ((b, mb), (ma, len(a)))
            raise RuleError(f"{rule}: on group {kind} {list(members)} {_who(*who)} enters a collective #{i + 1}, "
                            f"{more[i].describe()}, that {_who(*other)} never enters (it stops after {n})"
                            f"{_parted(a, b, i, ma, mb)}.")
        if a[i].key() != b[i].key():
            raise RuleError(f"{rule}: on group {kind} {list(members)} {_who(*ma)}'s collective #{i + 1} is "
                            f"{a[i].describe()}, {_who(*mb)}'s is {b[i].describe()}{_parted(a, b, i, ma, mb)}.")


def _parted(a: list, b: list, i: int, ma: tuple, mb: tuple) -> str:
    """Where two sequences that first differ at #i + 1 came apart: calls alike in shape can pair up
    across different code (a loss summed with a gradient norm), so the first call made from different
    sites is named too, when it comes earlier."""
    j = next((j for j in range(min(i, len(a), len(b))) if a[j].site != b[j].site), None)
    if j is None:
        return ""
    return (f"; they part at #{j + 1}, where {_who(*ma)} calls from {a[j].site} and {_who(*mb)} from "
            f"{b[j].site}")


def _counterpart(a: int, q: int, b: int, group_of: dict):
    """The rank that plays a's part for b, as a does for q (b stands for q): a's index in the group
    it shares with q (the pipeline group first), taken in b's group of that kind."""
    for kind in ("pp", "world"):
        mine = group_of[kind].get(a, ())
        if q in mine:
            return group_of[kind][b][mine.index(a)]
    return None


def check_p2p(logs: dict, stand_in: dict, group_of: dict) -> None:
    """Point-to-point under NCCL's pairing: the k-th send from a to b is b's k-th receive from a."""
    sends, recvs = defaultdict(list), defaultdict(list)  # (rank, peer) -> its sends to / receives from peer
    for rank, log in logs.items():
        for direction, peer, nbytes, dtype, site in log.p2p:
            (sends if direction == "send" else recvs)[(rank, peer)].append((nbytes, dtype, site))
    done: set = set()
    for a, q in sorted({(rank, peer) for rank, log in logs.items() for _, peer, _, _, _ in log.p2p}):
        b = stand_in.get(q)  # what q does, b did
        p = _counterpart(a, q, b, group_of) if b is not None else None  # and b's a
        if p is None or stand_in.get(p) != a or (b, p) in done:
            continue
        done.add((a, q))
        _pair(_who(a, a), sends[(a, q)], _who(q, b), recvs[(b, p)])
        _pair(_who(q, b), sends[(b, p)], _who(a, a), recvs[(a, q)])


def _pair(sender: str, a: list, receiver: str, b: list) -> None:
    """a: the sender's sends to the receiver, b: the receiver's receives from the sender."""
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i][:2] != b[i][:2]:
            s = f"send #{i + 1} is {a[i][0]} bytes of {a[i][1]} at {a[i][2]}" if i < len(a) else \
                f"sends only {len(a)} tensors"
            r = f"receive #{i + 1} is {b[i][0]} bytes of {b[i][1]} at {b[i][2]}" if i < len(b) else \
                f"posts only {len(b)} receives"
            raise RuleError(f"NCCL rule broken (point-to-point pairs each send with the peer's receive in order): "
                            f"{sender}'s {s}, {receiver}'s {r} from it.")


def check_first_calls(logs: dict, stand_in: dict, parts: dict, group_of: dict) -> None:
    """Where batched point-to-point is a group's first call on one member, it is on every member."""
    for kind, lists in parts.items():
        for members in lists:
            roles = _roles_of(members, stand_in) if len(members) > 1 else None
            if not roles:
                continue
            firsts = {r: logs[r].first_call.get(group_of[kind][r]) for r in roles}
            batched = [r for r, f in firsts.items() if f and f[0] == "batched p2p"]
            if batched and len(batched) < len(firsts):
                r = batched[0]
                o = next(x for x in firsts if x not in batched)
                theirs = f"a {firsts[o][0]} at {firsts[o][1]}" if firsts[o] else "no call at all"
                raise RuleError(f"NCCL rule broken (a group's first call, if batched point-to-point, is made by "
                                f"every member): on group {kind} {list(members)} {_who(roles[r], r)} makes "
                                f"batch_isend_irecv its first call at {firsts[r][1]}, {_who(roles[o], o)} "
                                f"{theirs}.")
