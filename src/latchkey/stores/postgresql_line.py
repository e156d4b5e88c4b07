"""The PostgreSQL store's line: how a release picks who goes next, and how a waiter waits.
Mixed into :class:`latchkey.stores.postgresql.PostgreSQL` as :class:`Line` (kept beside the
store module, as ``postgresql_tables`` and ``postgresql_rows`` are, for length).

A blocked mutex acquire queues its owner in ``<table>_waiters`` (UNLOGGED) and ``LISTEN``s on
one extra connection per backend (the driver's listener), which holds a session advisory lock
on a random 64-bit *listener key* while it lives: a release passes over a queued owner whose
key is free (its process is gone). The oldest live owner in the queue is *first*.

**Turns: a bounded barge.** A release that hands a lease over commits durably (it is a
grant) and its waiter must wake up; a holder that releases and acquires again in a loop pays
neither. So the release of a lease taken less than ``TURN_MS`` ago (a holder in a hurry:
looping, most likely) frees the name (committed asynchronously) and *rings* first — a notice
naming its ticket, ``<name hex>:<ticket>``, which wakes that one waiter, not the others — and
for ``TURN_MS`` anyone may take the free name: the woken waiter by its attempt (which also
takes it out of the queue, in the same statement), or, most often under contention, the
holder looping on it, with no wake-up paid. Releases within the turn ring nobody. The first
release after the turn *hands over*: the lease row goes to first — new owner, fencing token,
its own TTL — first leaves the queue, and the notice ``<name hex>:<ticket>:<token>:<expires
µs>`` gives it the lease with no round trip of its own. The release of a lease held for a
turn or longer hands over at once, and so does any release once first has waited
``STARVED_MS`` in the queue: barging gains nothing there, and the waiter is served without
an attempt of its own. So once a waiter is first in line, it is served by the first release
after one turn, every other process ahead of it having had one turn at most; the process
that held the name goes to the end of the line when it next waits.

With nobody in line, a release notifies ``<name hex>``: every waiter of the name retries
(semaphores, whose waiters are not queued, always). Waiters also retry on their own (capped
backoff): a lost notice or listener only slows them down. A queue row whose waiter left
without removing it (an outage) is rung in vain — the others find the free name at their
next poll — and, if handed the lease, its process's listener gives the lease back
(:meth:`Line.unclaimed`).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from latchkey.stores.io import Steps
from latchkey.stores.io.psycopg import Listen, Prepared
from latchkey.stores.postgresql_tables import TAKE_MUTEX
from latchkey.stores.sql import Query

#: How long a rung waiter may take to win the free name by its own attempt while anyone else
#: may still take it (a looping holder re-takes it in about 1 ms here); the first release
#: after that hands it the lease.
TURN_MS = 10
#: A first waiter queued this long ago is served by hand-over at the next release, turn or
#: not (a bound on its wait however the holders loop; Go's sync.Mutex starvation mode is the
#: same idea, at 1 ms). Under contention a waiter is served well before (8 processes on one
#: name: one turn each, ~100 ms); 10,000 waiters on one name mostly wait longer than this,
#: and gain nothing from barging.
STARVED_MS = 1000
#: The parameter formats of the acquire statements: the name in binary, the rest text.
MUTEX_FORMATS = (1, 0, 0, 0)


class Line:
    """The line's statements (``{t}``, ``{s}``: see the store) and primitives."""

    in_line: dict[tuple[str, str], Any]  # the waiters of owners in the queue, by (name, owner)
    orphans: dict[int, tuple[str, str]]  # tickets of rows a waiter could not remove (outage)
    acquire_queued_pq: bytes

    if TYPE_CHECKING:  # the store's own

        def release(self, name: str, owner: str) -> Steps[bool]: ...

    # In: as ACQUIRE_MUTEX, for an owner queued by its wait (``in_line``): if taken, the
    # owner leaves the queue in the same statement (one round trip fewer before the waiter
    # returns). Out: as ACQUIRE_MUTEX.
    ACQUIRE_QUEUED = f"""WITH taken AS (
{TAKE_MUTEX}
), left_line AS (
    DELETE FROM {{s}}"{{t}}_waiters" AS w
    WHERE w.name = $1 AND w.owner = $2 AND EXISTS (TABLE taken))
SELECT token, expires_at FROM taken"""
    # In: name, owner. Ends owner's lease on ``name`` (live or expired); for a mutex, what
    # comes next is the line's (the module docstring): *first* is the oldest queued waiter
    # whose listener key is held (our try-lock fails). Rung ``TURN_MS`` ago or more, or the
    # lease held that long, or first queued ``STARVED_MS`` ago: the row goes to first
    # (``heir``), which leaves the queue. Else
    # the row is deleted, and first is rung (``rung_at`` set, notified) unless it was
    # already. Queue rows their waiter is removing right now are skipped. Out: (our lease was
    # live, it was handed over); no row if we had none. A release that hands nothing over
    # commits asynchronously (synchronous_commit off for this transaction): lost in a crash,
    # the lease expires by its TTL — a delay, never a second holder. A hand-over is a grant:
    # it commits durably.
    RELEASE = f"""WITH gone AS (
    SELECT name, slot, expires_at > now() AS live,
        acquired_at <= clock_timestamp() - interval '{TURN_MS} milliseconds' AS held_long
    FROM {{s}}"{{t}}" WHERE name = $1 AND owner = $2 FOR UPDATE
), first AS (
    SELECT w.owner, w.owner_info, w.ttl, w.ticket, w.rung_at, w.queued_at
    FROM {{s}}"{{t}}_waiters" AS w JOIN gone USING (name)
    WHERE w.name = $1 AND gone.slot = 0 AND w.owner <> $2 AND w.expires_at > now()
      AND NOT pg_try_advisory_xact_lock(w.listener_key)
    ORDER BY w.queued_at, w.ticket LIMIT 1 FOR UPDATE OF w SKIP LOCKED
), heir AS (
    SELECT first.* FROM first, gone WHERE gone.held_long
        OR first.rung_at <= clock_timestamp() - interval '{TURN_MS} milliseconds'
        OR first.queued_at <= clock_timestamp() - interval '{STARVED_MS} milliseconds'
), rung AS (
    UPDATE {{s}}"{{t}}_waiters" AS w SET rung_at = clock_timestamp() FROM first
    WHERE first.rung_at IS NULL AND NOT EXISTS (TABLE heir)
      AND w.name = $1 AND w.owner = first.owner
    RETURNING first.ticket
), dequeued AS (
    DELETE FROM {{s}}"{{t}}_waiters" AS w USING heir WHERE w.name = $1 AND w.owner = heir.owner
), handed AS (
    UPDATE {{s}}"{{t}}" AS l SET owner = heir.owner, owner_info = heir.owner_info,
        token = nextval('{{s}}"{{t}}_fence"'), acquired_at = now(),
        expires_at = now() + heir.ttl * interval '1 second'
    FROM heir WHERE l.name = $1 AND l.slot = 0 AND l.owner = $2
    RETURNING heir.ticket, l.token, l.expires_at
), deleted AS (
    DELETE FROM {{s}}"{{t}}" AS l WHERE l.name = $1 AND l.owner = $2 AND NOT EXISTS (TABLE heir))
SELECT gone.live, handed.token IS NOT NULL,
       set_config('synchronous_commit', CASE WHEN handed.token IS NULL THEN 'off'
                  ELSE current_setting('synchronous_commit') END, true),
       CASE WHEN handed.token IS NOT NULL OR rung.ticket IS NOT NULL
                 OR NOT EXISTS (TABLE first) THEN
           pg_notify('{{t}}', encode(gone.name, 'hex') || coalesce(
               ':' || handed.ticket || ':' || handed.token || ':'
                   || (extract(epoch FROM handed.expires_at) * 1000000)::bigint,
               ':' || rung.ticket, '')) END
FROM gone LEFT JOIN handed ON true LEFT JOIN rung ON true"""
    # In: name, owner, owner_info, ttl, ticket, listener_key. Queues a blocked mutex acquire
    # (again: the same owner keeps its place, with the new key). The backstop expiry only
    # bounds a row nobody removed; a dead process's rows are skipped by their key.
    ENQUEUE = """INSERT INTO {s}"{t}_waiters"
    (name, owner, owner_info, ttl, ticket, listener_key, queued_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp(), now() + interval '1 hour')
ON CONFLICT (name, owner) DO UPDATE SET ticket = excluded.ticket,
    listener_key = excluded.listener_key, expires_at = excluded.expires_at"""
    # In: name, owner. Leaves the queue. Out: a row if we were still in it (none: a release
    # handed us the lease, or the row is gone with a crash or a purge).
    DEQUEUE = """DELETE FROM {s}"{t}_waiters" WHERE name = $1 AND owner = $2 RETURNING 1"""

    def queued_attempt(self, values: tuple[bytes, ...]) -> Prepared:
        """A queued owner's attempt (ACQUIRE_QUEUED), with ACQUIRE_MUTEX's ``values``."""
        return Prepared(b"latchkey_acquire_queued", self.acquire_queued_pq, values, MUTEX_FORMATS)

    def wait_in_line(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[Any]:
        """Listen for releases of ``name``; for a mutex, queue ``owner`` too."""
        key = name.encode()
        if limit != 1 or not owner:
            return (yield Listen(key.hex(), None, name, owner))
        ticket = secrets.randbits(63)
        waiter = yield Listen(key.hex(), ticket, name, owner)
        try:
            yield Query(self.ENQUEUE, (key, owner, owner_info, float(ttl), ticket,
                                       waiter.listener_key))  # fmt: skip
        except BaseException:
            waiter.unsubscribe()
            raise
        self.in_line[name, owner] = waiter
        return waiter

    def leave_queue(self, name: str, owner: str, waiter: Any) -> Steps[None]:
        """The end of a wait (the waiter's close): leave the queue. If the wait ended without
        the lease (it timed out, or raised) but a release handed it over meanwhile, release
        it: that passes it on. A lease the core returned is never touched."""
        self.in_line.pop((name, owner), None)
        if waiter.handed_over or waiter.left_line:
            return  # the release that handed it over, or our own attempt, left the queue
        try:
            rows, _ = yield Query(self.DEQUEUE, (name.encode(), owner))
            if not rows and not waiter.acquired:  # handed over as we gave up: pass it on
                yield from self.release(name, owner)
        except Exception:
            # The wait's outcome stands. Should a release hand our stale queue row a lease, the
            # listener hears of a ticket nobody waits for, and unclaimed() releases that lease.
            if waiter.ticket is not None:
                self.orphans[waiter.ticket] = (name, owner)
            raise

    def unclaimed(self, ticket: int) -> Steps[None]:
        """A release handed a lease to a queue row whose waiter has left (see leave_queue)."""
        orphan = self.orphans.pop(ticket, None)
        if orphan is not None:
            yield from self.release(*orphan)
