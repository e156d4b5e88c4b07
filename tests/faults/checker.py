"""The checker: reads a chaos run's history (history.py) and lists every violation of
latchkey's guarantees. Times are the recorder's; see history.py for why the intervals it
reads are conservative.

Definitions, per operation ``op`` (recorder clock): ``op.inv`` is no later than the call
really started, ``op.ret`` no earlier than it really ended. A lease granted by ``op`` started
in the store at some moment in [inv, ret] and lasts its TTL by the store's clock; every
successful extend pushes its end to at least (extend.inv + ttl). So a lease is *surely live*
from its grant's ``ret`` until the earliest of: its end's lower bound (scaled by ``RATE`` for
clock-rate differences, minus ``SLACK``) and the invocation of its owner's release. Two
surely-live leases of one mutex never overlap; at most ``limit`` of a semaphore do.

The rules checked:

1. ``overlap``: no grant while the previous holder's lease could not have ended (mutex:
   surely-live intervals disjoint; semaphore: at most ``limit`` at once).
2. ``token-order``: of two grants of one name where one returned before the other was
   invoked, the later has the larger fencing token.
3. ``stale-action``: a holder never acts (passes ``check()``) after a later grant of its name
   returned — its check began after that grant, so its lease had surely ended.
4. ``lost-update``: every write the register accepted continued the chain (the value the
   writer read under its lock was still the register's value).
5. ``non-holder``: a release or extend of a lease never succeeds once a later grant of the
   name (another owner's) had returned before the call began.
6. ``record``: the record's final value is the number of successful updates (plus at most
   the number whose outcome is unknown).
7. ``slow-call``: every call returned within its wait + the store's bound for one call
   (``call_bound``: its timeout, or what its driver documents) + ``MARGIN``.
8. ``heal-to-grant`` / ``kill-to-grant``: after a fault healed, some name is granted again
   within ``heal_bound``; after a holder was SIGKILLed, its name within ``kill_bound`` of
   when it could first be granted: its lease may have ended (TTL, or the end of a server
   fault that began while it may have been live + TTL: ``RENEWALS``) and another worker
   asked; not counting the time the store was down meanwhile (``OUTAGES``: a server fault
   holds every grant up, not just the killed holder's names').
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.faults.history import History, Op

RATE = 0.99  # a store's second may be 1% shorter than the recorder's
SLACK = 0.005  # seconds
MARGIN = 1.0  # seconds a call may take beyond its wait + the store's timeout
#: Seconds before a loss fault (``losses``: a failover to an asynchronous replica) from which
#: an acknowledged write may still be lost. Redis writes a command's reply to its client and the
#: command to its replica in one pass of its event loop, in no fixed order: a master paused
#: between the two, the client's first (descheduled on a loaded machine), and killed there,
#: has acknowledged a write its replica never gets. Seen in the test command: a record update
#: answered before the kill was recorded, missing after the failover (docs/reliability.md).
LOSS_LEAD = 1.0
#: The faults during which no name can be granted: kill-to-grant does not count them.
OUTAGES = ("blackhole", "freeze", "restart", "kill", "failover")
#: The faults after which a store may give every live lease its full TTL again (a restart,
#: or a new leader: etcd's renews every lease it finds; a stalled leader may be replaced).
RENEWALS = (*OUTAGES, "freeze-leader")


@dataclass
class Report:
    violations: list[str] = field(default_factory=list)
    grants: int = 0
    calls: int = 0
    longest_call: float = 0.0  # seconds beyond the call's own wait
    heal_to_grant: list[float] = field(default_factory=list)
    kill_to_grant: list[float] = field(default_factory=list)
    #: Per failover: from its start (the leader, master or primary killed) to the first grant
    #: of a call invoked after that (so surely granted by the setup as it was after the
    #: kill); only those no other server or network fault interrupted.
    failover_to_grant: list[float] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        failovers = sorted(self.failover_to_grant)
        after_failover = {
            "failover_to_grant_median_s": round(failovers[len(failovers) // 2], 3),
            "failover_to_grant_max_s": round(failovers[-1], 3),
        } if failovers else {}  # fmt: skip
        return {
            "grants": self.grants,
            "calls": self.calls,
            "faults": self.faults,
            "violations": len(self.violations),
            "longest_call_s": round(self.longest_call, 3),
            "heal_to_grant_max_s": round(max(self.heal_to_grant, default=0.0), 3),
            "kill_to_grant_max_s": round(max(self.kill_to_grant, default=0.0), 3),
            **after_failover,
        }


def granted(op: Op) -> bool:
    return op.kind == "acquire" and isinstance(op.result, tuple) and op.result[0] == "granted"


def succeeded(op: Op) -> bool:
    result = op.result
    if op.kind == "release":
        return isinstance(result, tuple) and result[0] == "ok" and result[1] is True
    if op.kind == "stale_release":
        return result is True
    if op.kind in ("extend", "stale_extend"):
        return isinstance(result, tuple) and result[0] == "ok"
    return False


@dataclass
class Lease:
    grant: Op
    worker: int
    token: int | None
    start: float  # grant.ret
    end: float  # surely live until then
    ops: list[Op]
    epoch: int | None = 0  # see check(): how many lease-ending faults came before the grant

    @property
    def lid(self) -> str:
        return str(self.grant.args.get("lid", ""))


def check(
    history: History,
    *,
    timeout: float,
    semaphores: dict[str, int],
    records: list[str],
    record_values: dict[str, int],
    fencing: bool = True,
    heal_bound: float | None = None,
    kill_bound: float | None = None,
    cuts: tuple[str, ...] = (),
    records_cut: bool = False,
    losses: tuple[str, ...] = (),
    ttl_bounded: bool = True,
    closes_end: bool = False,
    call_bound: float | None = None,
) -> Report:
    """``cuts``: the kinds of fault that may end every lease at once, by the store's own
    rules — a restart of a store that keeps nothing on disk, a dropped connection of a
    session-tied store. A lease granted before such a fault is surely live only until the
    fault began, and its holder's later steps and writes are not held against the store
    (it cannot know before its next renewal: the documented limit of those stores).
    ``records_cut``: such a fault also forgets the records (only updates after the last one
    are counted). ``losses``: the kinds of fault that may lose the latest writes without
    forgetting the rest — a failover to a replica of asynchronous replication: leases as
    for ``cuts``; a record update that overlaps such a fault may or may not have survived
    it (counted as unknown), one that returned before it began is counted as sure — the
    window opens ``LOSS_LEAD`` before the fault, for the replica's lag.
    ``ttl_bounded``: False for session-tied locks, which last until released (or their
    session ends), not for a TTL. ``closes_end``: a lease also ends when its holder closes
    its store (ZooKeeper: closing the session deletes its ephemeral nodes at once), so a
    worker's exit ends the leases it abandoned. ``call_bound``: how long one call may take
    by the store's own account, beyond its wait (None: the timeout; PostgreSQL: the timeout
    + the second its watchdog leaves the server's ``statement_timeout`` to answer first)."""
    report = Report()
    # A cut is a window: the store may lose its leases at any moment from the fault's start
    # until its end (a server told to stop goes on serving until it gets round to stopping:
    # Redis shuts down from its next cron tick, up to 100 ms after SIGTERM).
    # A loss window opens LOSS_LEAD before its fault (see LOSS_LEAD).
    lossy = [(f.start - LOSS_LEAD, f.end or f.start) for f in history.faults if f.kind in losses]
    wipes = [(f.start, f.end or f.start) for f in history.faults if f.kind in cuts]
    windows = sorted(
        [(f.start, f.start if f.end is None else f.end) for f in history.faults if f.kind in cuts]
        + lossy
    )
    for fault in history.faults:
        report.faults[fault.kind] = report.faults.get(fault.kind, 0) + 1
    ops = sorted(history.ops, key=lambda op: op.inv)
    report.calls = sum(1 for op in ops if op.ret is not None)
    leases = _leases(ops, ttl_bounded)
    report.grants = sum(len(v) for v in leases.values())
    cut_leases: dict[str, float] = {}  # lease (its Lock object's id) -> when it may have ended
    if not ttl_bounded or closes_end:
        # A session-tied lock also ends when its worker's session does: the worker died or
        # closed its store, or one of its calls failed (the driver drops a session it cannot
        # trust). With ``closes_end``, when its worker closes its store.
        ends: dict[int, list[float]] = defaultdict(list)
        if not ttl_bounded:
            for op in ops:
                if isinstance(op.result, tuple) and op.result[:2] == ("error", "StoreUnavailable"):
                    ends[op.worker].append(op.inv)
            for worker, at in history.kills:
                ends[worker].append(at)
        for worker, at in history.exits:
            ends[worker].append(at)
        for items in leases.values():
            for lease in items:
                gone = [t for t in ends.get(lease.worker, ()) if lease.grant.inv < t < lease.end]
                if gone:
                    lease.end = min(gone)
                    cut_leases[lease.lid] = min(gone)
    for items in leases.values():
        for lease in items:
            # The epoch: how many cut windows ended before the grant began; None if one was
            # open while it was granted (the lease may belong to either side: it is compared
            # with nothing).
            before = sum(1 for _, end in windows if end <= lease.grant.inv)
            during = any(start < lease.start and lease.grant.inv < end for start, end in windows)
            lease.epoch = None if during else before
            # Surely live only until the first window that opened while it lived (from its
            # start, if it was granted inside the window).
            cut = next(
                (max(start, lease.start) for start, end in windows
                 if lease.grant.inv < end and start < lease.end),
                None,
            )  # fmt: skip
            if cut is not None:
                lease.end = min(lease.end, cut)
                cut_leases[lease.lid] = min(cut, cut_leases.get(lease.lid, cut))
    for name, items in leases.items():
        limit = semaphores.get(name, 1)
        _overlaps(report, name, items, limit)
        if fencing and limit == 1:
            _token_order(report, name, items)
    _stale_actions(report, history, leases, semaphores, cut_leases)
    _non_holders(report, ops, leases, semaphores)
    for write in history.writes:
        cut = cut_leases.get(write.lid)
        if cut is not None and write.at > cut:
            continue  # its lease may have vanished with the fault: see ``cuts``
        if write.accepted and not write.chained:
            report.violations.append(
                f"lost-update: {write.name}: worker {write.worker} (token {write.token}) wrote "
                f"{write.new} over a value it had not read (it read {write.prev})"
            )
    # Records forgotten by a cut: count the updates after the last window opened; those that
    # began before it closed may or may not have survived it (counted as unknown), as may
    # those that overlap a loss (see ``losses``).
    last = max(wipes) if records_cut and wipes else (float("-inf"), float("-inf"))
    for name in records:
        updates = [
            op for op in ops
            if op.kind == "update" and op.name == name and (op.ret or op.inv) > last[0]
        ]  # fmt: skip
        sure = [
            op for op in updates
            if op.inv > last[1]
            and not any(op.inv < end and (op.ret or end) > start for start, end in lossy)
        ]  # fmt: skip
        done = sum(1 for op in sure if _ok(op))
        unknown = len(updates) - done
        value = record_values.get(name, 0)
        if not done <= value <= done + unknown:
            report.violations.append(
                f"record: {name} is {value} after {done} successful updates ({unknown} unknown)"
            )
    stopped = [
        (int(f.detail.split()[-1]), f.start, f.end or f.start)
        for f in history.faults
        if f.kind == "worker-stop"
    ]
    for op in ops:
        if op.ret is None or any(
            w == op.worker and start < op.ret and op.inv < end for w, start, end in stopped
        ):  # a worker SIGSTOPped during its call: slow on purpose
            continue
        bound = timeout if call_bound is None else call_bound
        allowed = float(op.args.get("wait") or 0) + bound + MARGIN
        took = op.ret - op.inv
        report.longest_call = max(report.longest_call, took - float(op.args.get("wait") or 0))
        if took > allowed:
            report.violations.append(
                f"slow-call: {op.kind} {op.name} by worker {op.worker} took {took:.2f}s "
                f"(wait {op.args.get('wait') or 0} + bound {bound:g} + {MARGIN}): "
                f"{_outcome(op.result)}"
            )
    grant_times = sorted(lease.start for items in leases.values() for lease in items)
    for fault in history.faults:
        if fault.kind == "failover":
            resumed = [
                lease.start for items in leases.values() for lease in items
                if lease.grant.inv >= fault.start
            ]  # fmt: skip
            # Not measured when another server or network fault began before grants resumed
            # (a restart of the whole cluster right after the failover, say).
            if resumed and not any(
                fault.start < other.start < min(resumed) and not other.kind.startswith("worker")
                for other in history.faults
            ):
                report.failover_to_grant.append(min(resumed) - fault.start)
    if heal_bound is not None:
        for fault in history.faults:
            if fault.end is None or fault.kind.startswith("worker"):
                continue
            later = [t for t in grant_times if t >= fault.end]
            if later:
                delay = later[0] - fault.end
                report.heal_to_grant.append(delay)
                if delay > heal_bound:
                    report.violations.append(
                        f"heal-to-grant: {delay:.2f}s after {fault.kind} healed "
                        f"(bound {heal_bound}s)"
                    )
    if kill_bound is not None:
        _kill_to_grant(report, history, leases, kill_bound)
    return report


def _outcome(result: Any) -> str:
    """A call's result for a message: an error's type and the end of its text (the cause)."""
    if isinstance(result, tuple) and result[:1] == ("error",):
        return f"{result[1]} …{str(result[2])[-110:]}"
    return repr(result)


def _ok(op: Op) -> bool:
    return isinstance(op.result, int) or (isinstance(op.result, tuple) and op.result[:1] == ("ok",))


def _leases(ops: list[Op], ttl_bounded: bool) -> dict[str, list[Lease]]:
    """Every granted lease with the interval in which it was surely live. A lease's calls are
    linked to it by the worker's id of its Lock object (``lid``)."""
    by_lid: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        by_lid[op.args.get("lid", f"op{op.id}")].append(op)
    leases: dict[str, list[Lease]] = defaultdict(list)
    for op in ops:
        if not granted(op) or op.ret is None:
            continue
        token = op.result[1]
        ttl = float(op.args["ttl"])
        end = op.inv + ttl * RATE - SLACK if ttl_bounded else float("inf")
        mine = [o for o in by_lid[op.args.get("lid", "")] if o is not op and o.inv > op.inv]
        for o in mine:
            if o.kind in ("extend", "stale_extend") and succeeded(o) and ttl_bounded:
                end = max(end, o.inv + float(o.args.get("ttl", ttl)) * RATE - SLACK)
        releases = [o.inv for o in mine if o.kind in ("release", "stale_release")]
        if releases:
            end = min(end, releases[0])
        leases[op.name].append(Lease(op, op.worker, token, op.ret, end, mine))
    for items in leases.values():
        items.sort(key=lambda lease: lease.start)
    return leases


def _token_of(op: Op) -> Any:
    return op.args.get("token")


def _overlaps(report: Report, name: str, items: list[Lease], limit: int) -> None:
    events = sorted(
        [(lease.start, 1, lease) for lease in items if lease.end > lease.start]
        + [(lease.end, -1, lease) for lease in items if lease.end > lease.start],
        key=lambda e: (e[0], e[1]),
    )
    live: list[Lease] = []
    for _, delta, lease in events:
        if delta < 0:
            live.remove(lease)
            continue
        live.append(lease)
        if len(live) > limit:
            held = ", ".join(f"worker {x.worker} token {x.token}" for x in live)
            report.violations.append(f"overlap: {name}: {len(live)} > {limit} surely live: {held}")


def _token_order(report: Report, name: str, items: list[Lease]) -> None:
    """Across restarts too: a store that keeps nothing on disk starts its counters again from
    its clock (Redis, memcached), so the order holds whatever the faults."""
    for a in items:
        for b in items:
            if (
                a.grant.ret is not None
                and a.grant.ret < b.grant.inv
                and a.token is not None
                and b.token is not None
                and not b.token > a.token
            ):
                report.violations.append(
                    f"token-order: {name}: token {b.token} granted after {a.token}"
                )


def _stale_actions(
    report: Report,
    history: History,
    leases: dict[str, list[Lease]],
    semaphores: dict[str, int],
    cut_leases: dict[str, float],
) -> None:
    for step in history.steps:
        if not step.ok or step.name in semaphores or step.token is None:
            continue
        cut = cut_leases.get(step.lid)
        if cut is not None and step.at > cut:
            continue
        own = [
            x
            for x in leases.get(step.name, ())
            if x.worker == step.worker and x.token == step.token and x.start <= step.at
        ]
        epoch = own[-1].epoch if own else None
        if epoch is None:
            continue
        for lease in leases.get(step.name, ()):
            if lease.epoch != epoch:
                continue
            if lease.token is not None and lease.token > step.token and lease.start < step.at:
                report.violations.append(
                    f"stale-action: {step.name}: worker {step.worker} acted with token "
                    f"{step.token} after token {lease.token} had been granted"
                )
                break


def _non_holders(
    report: Report, ops: list[Op], leases: dict[str, list[Lease]], semaphores: dict[str, int]
) -> None:
    for op in ops:
        if op.name in semaphores or not succeeded(op) or op.kind not in (
            "release", "stale_release", "extend", "stale_extend"
        ):  # fmt: skip
            continue
        token = _token_of(op)
        own = [
            x
            for x in leases.get(op.name, ())
            if x.worker == op.worker and x.token == token and x.start <= op.inv
        ]
        if not own or own[-1].epoch is None:
            continue
        for lease in leases.get(op.name, ()):
            if lease.epoch != own[-1].epoch:
                continue
            if (
                token is not None
                and lease.token is not None
                and lease.token > token
                and lease.start < op.inv
            ):
                report.violations.append(
                    f"non-holder: {op.kind} of {op.name} by worker {op.worker} (token {token}) "
                    f"succeeded after worker {lease.worker} was granted token {lease.token}"
                )
                break


def _kill_to_grant(
    report: Report, history: History, leases: dict[str, list[Lease]], bound: float
) -> None:
    """After a holder was SIGKILLed, its name must be granted again within ``bound`` of when
    it could first be: the later of the moment its lease may have ended (the grant's or its
    last extend's return plus the TTL; a renewal in the background extends it at most to the
    kill plus the TTL; a server fault (``RENEWALS``) that began before then may renew it to
    the fault's end plus the TTL) and the moment another worker asked for it. A worker asks
    when an acquire of the name is running at that moment or starts later; a try answered
    busy while the lease may still have been live asked too early. The grant is measured from
    then, so a name nobody asked for is not held against the store (the workers pick names
    and calls at random; a stopped or starved worker asks later). Nor is the time a server
    fault (``OUTAGES``) held every grant up meanwhile."""
    ops = sorted(history.ops, key=lambda op: op.inv)
    outages = [(f.start, f.end) for f in history.faults if f.kind in OUTAGES and f.end]
    for worker, at in history.kills:
        for name, items in leases.items():
            held = [x for x in items if x.worker == worker and x.start < at and not _released(x)]
            if not held:
                continue
            lease = held[-1]
            ttl = float(lease.grant.args["ttl"])
            ends = [lease.start + ttl, at + ttl if lease.grant.args.get("renew") else 0.0]
            for o in lease.ops:
                if o.kind == "extend" and o.inv < at:
                    ends.append(min(o.ret if o.ret is not None else at, at) + ttl)
            # Not before the kill: a lease it abandoned long before may have let others in
            # since, whose asks (and grants) say nothing about what the kill held up.
            free = max(*ends, at)
            after = [x.start for x in items if x.worker != worker and x.start > at]
            if not after:
                continue
            # A server fault that began while the lease may still have been live may give it
            # its full TTL again from the fault's end (a restart or a new leader may renew
            # every lease: etcd does), and so on for the next one. One that began after the
            # lease had surely ended cannot bring it back: it only held grants up while it
            # lasted, which the outage discount below leaves out.
            for f in sorted(history.faults, key=lambda f: f.start):
                if (
                    f.kind in RENEWALS and f.end is not None
                    and f.end > at and f.start < min(free, after[0])
                ):  # fmt: skip
                    free = max(free, f.end + ttl)
            asks = [
                max(o.inv, free) for o in ops
                if o.kind == "acquire" and o.name == name and o.worker != worker
                and o.inv < after[0] and (o.ret is None or o.ret >= free)
            ]  # fmt: skip
            since = min(asks, default=free)
            delay = after[0] - since - _overlap(outages, since, after[0])
            report.kill_to_grant.append(max(0.0, delay))
            if delay > bound:
                report.violations.append(
                    f"kill-to-grant: {name} granted {after[0] - at:.2f}s after its holder was "
                    f"killed, {delay:.2f}s after it could first be, outages aside (its lease "
                    f"could end {free - at:.2f}s after the kill or a fault's end since; bound "
                    f"{bound}s)"
                )


def _overlap(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """How long, within [start, end], at least one of ``intervals`` was open."""
    total, reached = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reached), min(b, end)
        if b > a:
            total += b - a
            reached = b
    return total


def _released(lease: Lease) -> bool:
    return any(o.kind == "release" and o.ret is not None for o in lease.ops)
