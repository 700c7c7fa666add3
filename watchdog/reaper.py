"""The clean-up: kill everything the dead parent left behind, and say what was done.

``sweep(entries, token, exclude, grace)`` runs once, after the parent died:

1. **Select.** One ``identity.scan()`` of /proc. Targets are
   - ledger entries whose ``(pid, start)`` still matches ("ledger");
   - members of a ``worker`` entry's process group ("pgid"), unless the group number
     looks reused (its leader pid now has another start time) or is protected (the
     watchdog's or the parent's own group: never ours to kill);
   - with a token: processes of our uid whose environment holds
     ``ORCHESTRATOR_DAEMON_TOKEN=<token>`` ("token"), e.g. orphans that left the group;
   - every descendant of the above, by ppid ("descendant").
   Never the watchdog itself, pid 1, or anything in ``exclude``.
2. **Terminate.** For each target: open a pidfd, verify the start time (see
   ``identity.open_verified``), send SIGCONT (a stopped process cannot act on SIGTERM)
   then SIGTERM through the pidfd. The token rule reads every environment, the slow
   part: it runs (on the same scan) after the other targets were signalled, while they
   die.
3. **Wait, then kill.** Poll all pidfds until every process exited or ``grace`` passed;
   SIGKILL the rest through their pidfds; wait again, bounded by ``kill_wait``.
4. **Stragglers.** Scan again for processes forked meanwhile (same rules, plus members of
   groups that an original target led) and SIGKILL them through verified pidfds.
5. **Report.** A JSON-able dict: timings and one record per process found.

``sweep_cgroups(paths)`` runs first, on the replica cgroups of the ledger: one
``cgroup.kill`` write per cgroup reaches every process in it, whatever it did to its process
group, session or environment; then one bounded wait on their ``cgroup.events`` fds until
none is populated, and each is removed. A path that ``cgroup.refusal`` rejects (not a
normalised path under the cgroup2 mount below an "orchestrator" directory, or the
watchdog's own cgroup or an ancestor of it) is reported and left alone.

Safety rule: a signal is only ever sent through a pidfd opened for that process and
verified against its start time afterwards, so pid reuse cannot redirect it. A zombie has
already exited and counts as gone (its parent or init reaps it).

Speed: the parent is dead, workers are orphaned, so this path is latency-critical. No
psutil, one /proc read per process per scan, environ is read only when a token is given.
"""

from __future__ import annotations

import errno
import math
import os
import select
import signal
import time
from collections.abc import Collection, Iterable
from typing import Any

from . import cgroup
from .identity import ProcStat, open_verified, scan
from .ledger import Entry

__all__ = ["sweep", "sweep_cgroups", "Report", "TOKEN_VARIABLE", "DEFAULT_GRACE", "DEFAULT_KILL_WAIT"]

Report = dict[str, Any]

TOKEN_VARIABLE = "ORCHESTRATOR_DAEMON_TOKEN"
DEFAULT_GRACE = 0.2  # seconds between SIGTERM and SIGKILL
DEFAULT_KILL_WAIT = 1.0  # seconds to wait for SIGKILLed processes to exit
STRAGGLER_ROUNDS = 3  # re-scans at most; each stops early when it finds nothing new


class _Target:
    """A process chosen for clean-up, and what happened to it."""

    __slots__ = ("stat", "found", "entry", "straggler", "state", "action", "outcome")

    def __init__(self, stat: ProcStat, found: str, entry: Entry | None, straggler: bool = False) -> None:
        self.stat = stat
        self.found = found
        self.entry = entry
        self.straggler = straggler
        self.state = _state_name(stat.state)
        self.action = "none"
        self.outcome = ""

    def record(self) -> dict[str, Any]:
        entry = self.entry
        return {
            "pid": self.stat.pid,
            "start": self.stat.start_time,
            "ppid": self.stat.ppid,
            "pgid": self.stat.pgrp,
            "kind": entry.kind if entry else None,
            "label": entry.label if entry else "",
            "found": self.found,
            "straggler": self.straggler,
            "state": self.state,
            "action": self.action,
            "outcome": self.outcome,
        }


def _state_name(letter: str) -> str:
    if letter in ("Z", "X"):
        return "zombie"
    if letter in ("T", "t"):  # t: stopped by a tracer
        return "stopped"
    return "alive"


def _missing_record(entry: Entry, procs: dict[int, ProcStat]) -> dict[str, Any]:
    """Report line for a ledger entry that is not a target: gone, pid reused, or excluded."""
    st = procs.get(entry.pid)
    state = "gone"
    if st is not None and st.start_time == entry.start:
        state, outcome = _state_name(st.state), "excluded"  # e.g. the parent itself
    elif st is not None:
        outcome = "pid-reused"  # the number now belongs to another process: not touched
    else:
        outcome = "gone"
    return {
        "pid": entry.pid,
        "start": entry.start,
        "ppid": None,
        "pgid": entry.pgid,
        "kind": entry.kind,
        "label": entry.label,
        "found": "ledger",
        "straggler": False,
        "state": state,
        "action": "none",
        "outcome": outcome,
    }


def _has_token(pid: int, needle: bytes, uid: int) -> bool:
    """Does ``pid`` (owned by ``uid``) carry ``needle`` as one of its environment entries?"""
    try:
        if os.stat(f"/proc/{pid}").st_uid != uid:
            return False
        fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False  # gone, or unreadable: skip (other layers cover it)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        os.close(fd)
    return needle in b"".join(chunks).split(b"\0")


def _trusted_groups(
    entries: Iterable[Entry], procs: dict[int, ProcStat], protect: Collection[int]
) -> dict[int, int | None]:
    """Process groups of ``worker`` entries that are safe to kill.

    Returns pgid -> the start time its leader had (None if the leader was already gone),
    so a later scan can tell whether the number was reused in between.
    """
    by_pid = {e.pid: e for e in entries}
    groups: dict[int, int | None] = {}
    for entry in by_pid.values():
        pgid = entry.pgid
        if entry.kind != "worker" or pgid is None or pgid in protect:
            continue
        leader = procs.get(pgid)
        if leader is None:
            # Leader gone. The kernel does not hand out a pid number while a process group
            # of that number still exists, so surviving members are still this group.
            groups[pgid] = None
            continue
        registered = by_pid.get(pgid)
        if registered is not None and registered.start == leader.start_time:
            groups[pgid] = leader.start_time  # the leader is a registered process
            continue
        me = procs.get(entry.pid)
        if me is not None and me.start_time == entry.start and me.pgrp == pgid:
            groups[pgid] = leader.start_time  # our verified worker is in it right now
            continue
        # Otherwise the number belongs to someone else now (reused): leave it alone.
    return groups


def _still_trusted(groups: dict[int, int | None], procs: dict[int, ProcStat]) -> set[int]:
    """The groups whose leader pid has not been reused since they were trusted."""
    result = set()
    for pgid, leader_start in groups.items():
        leader = procs.get(pgid)
        if leader is None or leader.start_time == leader_start:
            result.add(pgid)
    return result


Chosen = dict[int, tuple[ProcStat, str, Entry | None]]  # pid -> (stat, how found, entry)


def _select(
    procs: dict[int, ProcStat],
    entries: Iterable[Entry],
    groups: Collection[int],
    exclude: Collection[int],
    roots: Collection[int] = (),
) -> Chosen:
    """The rules that need nothing but the scan: ledger, process groups, descendants.

    ``roots``: pids whose descendants are wanted too (earlier targets, on a re-scan).
    """
    chosen: Chosen = {}
    for entry in entries:
        st = procs.get(entry.pid)
        if st is not None and st.start_time == entry.start and entry.pid not in exclude:
            chosen[entry.pid] = (st, "ledger", entry)
    if groups:
        for st in procs.values():
            if st.pgrp in groups and st.pid not in chosen and st.pid not in exclude:
                chosen[st.pid] = (st, "pgid", None)
    _add_descendants(procs, chosen, [*chosen, *roots], exclude)
    return chosen


def _select_by_token(procs: dict[int, ProcStat], token: str, exclude: Collection[int], taken: Chosen) -> Chosen:
    """Processes not in ``taken`` that carry the token, and their descendants.

    Reads /proc/PID/environ of every process of our uid: the slow rule, so the sweep runs
    it after the others' targets have been signalled (on the same scan).
    """
    needle = f"{TOKEN_VARIABLE}={token}".encode()
    uid = os.getuid()
    found: Chosen = {}
    for st in procs.values():
        if st.pid not in taken and st.pid not in exclude and _has_token(st.pid, needle, uid):
            found[st.pid] = (st, "token", None)
    _add_descendants(procs, found, list(found), {*exclude, *taken})
    return found


def _add_descendants(procs: dict[int, ProcStat], chosen: Chosen, roots: list[int], exclude: Collection[int]) -> None:
    """Add every descendant (by ppid, in this scan) of ``roots`` to ``chosen``."""
    children: dict[int, list[int]] = {}
    for st in procs.values():
        children.setdefault(st.ppid, []).append(st.pid)
    stack = [pid for pid in roots if pid in procs]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in chosen and child not in exclude:
                chosen[child] = (procs[child], "descendant", None)
                stack.append(child)


def _chosen_from_ledger(entry: Entry, chosen: Chosen) -> bool:
    hit = chosen.get(entry.pid)
    return hit is not None and hit[2] is entry


def _send(fd: int, sig: int) -> bool:
    """Signal through a pidfd; False if the process has already exited."""
    try:
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        return False
    return True


def _open(target: _Target) -> int | None:
    """A verified pidfd for the target; None (with the outcome recorded) if there is none."""
    try:
        fd = open_verified(target.stat.pid, target.stat.start_time)
    except OSError as exc:
        # EMFILE/ENFILE: out of file descriptors (hundreds of targets); the straggler scan
        # retries once earlier pidfds are closed. ENOSYS/EPERM: no pidfds here (old kernel,
        # seccomp): without one the identity cannot be pinned, so the process is reported
        # and left alone rather than signalled by a bare pid.
        if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOSYS, errno.EPERM):
            raise
        target.outcome = "error:" + errno.errorcode[exc.errno]
        return None
    if fd is None:
        target.outcome = "gone"
    return fd


def _terminate(targets: list[_Target], waiting: dict[int, _Target]) -> None:
    """SIGCONT + SIGTERM each target through a verified pidfd; add the pidfds to ``waiting``.

    All pidfds are opened and verified first, then signalled in one tight loop: each
    signal wakes a process that may preempt us (on a small machine), so interleaving the
    /proc reads would stretch the release of the last target over the whole loop instead
    of letting them all die in parallel. SIGCONT first: a stopped process cannot act on
    SIGTERM.
    """
    opened: list[tuple[int, _Target]] = []
    for target in targets:
        if target.state == "zombie":
            target.outcome = "gone"  # already exited; its parent or init reaps it
            continue
        fd = _open(target)
        if fd is not None:
            opened.append((fd, target))
    for fd, target in opened:
        target.action = "term"
        if _send(fd, signal.SIGCONT) and _send(fd, signal.SIGTERM):
            waiting[fd] = target
        else:
            os.close(fd)
            target.outcome = "exited"


def _wait(waiting: dict[int, _Target], timeout: float, outcome: str) -> None:
    """Wait until the processes behind the pidfds in ``waiting`` exit, at most ``timeout``.

    Each one that exits gets ``outcome``, its pidfd is closed and it leaves ``waiting``.
    Rather than waking up once per exit (hundreds of wake-ups competing for the CPUs the
    dying processes need), sleep on the most recently signalled process (processes die
    roughly in the order they were signalled), then collect every other exit in one
    non-blocking poll, and repeat until all are gone or the time is up.
    """
    deadline = time.monotonic() + timeout
    while waiting:
        everyone = select.poll()
        for fd in waiting:
            everyone.register(fd, select.POLLIN)
        for fd, _events in everyone.poll(0):
            os.close(fd)
            waiting.pop(fd).outcome = outcome
        remaining = deadline - time.monotonic()
        if not waiting or remaining <= 0:
            return
        latest = select.poll()
        latest.register(next(reversed(waiting)), select.POLLIN)
        latest.poll(math.ceil(remaining * 1000))


def _kill(waiting: dict[int, _Target], kill_wait: float) -> None:
    """SIGKILL everything still in ``waiting``, wait for it, close every pidfd."""
    for fd, target in list(waiting.items()):
        target.action = "kill"
        if not _send(fd, signal.SIGKILL):
            os.close(fd)
            waiting.pop(fd).outcome = "exited"
    _wait(waiting, kill_wait, "killed")
    for fd, target in waiting.items():
        os.close(fd)
        target.outcome = "survived"  # e.g. stuck in uninterruptible sleep (state D)
    waiting.clear()


def sweep_cgroups(paths: Iterable[str], kill_wait: float = DEFAULT_KILL_WAIT) -> list[cgroup.KillRecord]:
    """Kill each registered cgroup whole, wait (bounded) until all are empty, remove them.

    One record per path: ``path``, ``kill`` ("cgroup.kill", "signals", "missing" or
    "refused: <why>" / "error: <why>"), ``populated`` (still, after the wait) and ``removed``.
    """
    paths = list(paths)
    if not paths:
        return []  # no cgroups in use: not even a mountinfo read on this latency-critical path
    records: list[cgroup.KillRecord] = []
    targets: list[str] = []
    mount, own = cgroup.find_mount(), cgroup.own_path()
    for path in paths:
        why = cgroup.refusal(path, mount, own)
        if why is None:
            targets.append(path)
        else:
            records.append({"path": path, "kill": f"refused: {why}", "populated": None, "removed": "none"})
    return cgroup.kill_and_remove(targets, kill_wait) + records


def sweep(
    entries: Iterable[Entry],
    token: str | None = None,
    exclude: Collection[int] = (),
    grace: float = DEFAULT_GRACE,
    *,
    protect_pgids: Collection[int] = (),
    kill_wait: float = DEFAULT_KILL_WAIT,
) -> Report:
    """Kill every process the ledger ``entries`` (and ``token``) lead to; report what happened.

    ``exclude``: pids never to touch (the watchdog adds itself and pid 1).
    ``protect_pgids``: process groups never to kill as a group (the watchdog's, the
    parent's), even if an entry names one by mistake.
    """
    started_at = time.time()
    t0 = time.monotonic()
    entries = list(entries)
    excluded = {os.getpid(), 0, 1, *exclude}
    protect = {0, 1, os.getpgrp(), *protect_pgids}

    # 1. Select from one scan. Every rule below works on this snapshot, taken before any
    # signal: once a worker dies its children are re-parented and the ppid links are gone.
    procs = scan()
    t_scan = time.monotonic()
    groups = _trusted_groups(entries, procs, protect)
    chosen = _select(procs, entries, groups, excluded)
    targets = [_Target(st, found, entry) for st, found, entry in chosen.values()]
    # Entries that are not targets themselves: gone, pid reused, or excluded.
    records = [_missing_record(e, procs) for e in entries if not _chosen_from_ledger(e, chosen)]
    t_select = time.monotonic()

    # 2. SIGCONT + SIGTERM through verified pidfds.
    waiting: dict[int, _Target] = {}
    _terminate(targets, waiting)
    t_signal = time.monotonic()
    if token:
        # The token rule reads environments: the slow part, done while the rest die.
        by_token = _select_by_token(procs, token, excluded, chosen)
        chosen.update(by_token)
        more = [_Target(st, found, entry) for st, found, entry in by_token.values()]
        _terminate(more, waiting)
        targets += more
    t_token = time.monotonic()

    # 3. Grace period, then SIGKILL.
    _wait(waiting, grace, "exited")
    t_term = time.monotonic()
    _kill(waiting, kill_wait)
    t_kill = time.monotonic()

    # 4. Stragglers: forked meanwhile, or missed for lack of file descriptors.
    done = {(t.stat.pid, t.stat.start_time) for t in targets if not t.outcome.startswith("error:")}
    roots = [t.stat.pid for t in targets]
    for target in targets:
        if target.stat.pgrp == target.stat.pid and target.stat.pgrp not in protect:
            groups.setdefault(target.stat.pgrp, target.stat.start_time)  # a group it led
    stragglers: list[_Target] = []
    for _round in range(STRAGGLER_ROUNDS):
        procs = scan()
        chosen = _select(procs, entries, _still_trusted(groups, procs), excluded, roots)
        if token:
            chosen.update(_select_by_token(procs, token, excluded, chosen))
        fresh = [
            _Target(st, found, entry, straggler=True)
            for st, found, entry in chosen.values()
            if (st.pid, st.start_time) not in done and st.state not in ("Z", "X")
        ]
        if not fresh:
            break
        for target in fresh:
            done.add((target.stat.pid, target.stat.start_time))
            roots.append(target.stat.pid)
            fd = _open(target)
            if fd is not None:
                waiting[fd] = target
        stragglers.extend(fresh)
        _kill(waiting, kill_wait)
    t_end = time.monotonic()

    # A target retried as a straggler is reported once, with its final outcome.
    retried = {(t.stat.pid, t.stat.start_time) for t in stragglers}
    processes = [
        t.record()
        for t in targets
        if not (t.outcome.startswith("error:") and (t.stat.pid, t.stat.start_time) in retried)
    ]
    processes += [t.record() for t in stragglers] + records
    outcomes: dict[str, int] = {}
    for rec in processes:
        outcomes[rec["outcome"]] = outcomes.get(rec["outcome"], 0) + 1
    return {
        "started_at": started_at,
        "duration_s": t_end - t0,
        "grace_s": grace,
        "timings_ms": {
            name: round((end - begin) * 1e3, 3)
            for name, begin, end in (
                ("scan", t0, t_scan),
                ("select", t_scan, t_select),
                ("signal", t_select, t_signal),
                ("token", t_signal, t_token),
                ("term_wait", t_token, t_term),
                ("kill", t_term, t_kill),
                ("stragglers", t_kill, t_end),
            )
        },
        "outcomes": outcomes,
        "processes": processes,
    }
