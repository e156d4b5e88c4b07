"""MariaDB's bells: a release wakes a waiting process at once, instead of its next poll.

MariaDB has no server push (no LISTEN/NOTIFY), but one session can end another's statement:
``KILL QUERY <connection id>`` ends a ``SELECT SLEEP(n)`` at once with error 1317. A process
that waits for a name keeps one *bell*, a connection of its own that sleeps in the server
(:mod:`latchkey.stores.io.mysql_bell`), and puts it in the ``{t}_bells`` table (a MEMORY
table: no disk write, emptied by a restart, as the connection ids are) once per name, in the
order processes came; it also marks the live lease ``waited``. A release of a lease so
marked takes the first bell of its name out of the table and KILLs its query: one more
round trip, only when someone waits. The woken process's first waiter then tries at once.

How no wake-up is lost, and why the uncontended path costs nothing:

- The plain release is the one prepared ``DELETE``, with ``AND waited = 0``: a lease no one
  waited for ends as before (a statement of the same cost). Only when it ends nothing (the
  lease was marked, or is not ours any more) does :data:`RING_RELEASE` run.
- A waiter marks the live lease *after* putting its bell in, and the core tries again after
  that (``wait_in_line``): a release before the mark is seen by that attempt; one after it
  finds the mark and rings.
- A marked lease is not deleted while a bell waits for its name: its row is made expired
  (free) and keeps ``waited = 1``, so the woken waiter's upsert takes it over marked, and
  its release rings the next bell. The last release, with no bell left, deletes the row.
- The holder learns at acquire whether the row it took over was marked (the acquire's
  answer says), and then releases with :data:`RING_RELEASE` straight away.
- A bell taken out of the table by a ring is put back (at the end of the line) by its
  process before it sleeps again (``Bell.register`` at the next ``wait``), and its waiter
  tries once more after that, as after the first time.

It is only a wake-up: correctness never depends on it. A ring that is lost (a bell between
two sleeps, a process that died with its bell in the table, a user not allowed to KILL
another's query, leases ended by expiry, a batch release or a purge) leaves the waiter to
the core's own polls, capped by the holder's remaining lease. A KILL of a connection that is
gone (error 1094) removes its bells and rings the next. Bells name the server
(``@@server_id``): after a failover a replicated row never rings a connection of another
server. MySQL keeps polling (its ``SLEEP`` ends with 1 instead of an error, untested here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from latchkey.stores.io import Steps
from latchkey.stores.io.mysql_session import NotPermitted, Refused, ThreadGone
from latchkey.stores.sql import Query

# MariaDB's plain release, prepared per connection: ends our live lease only if no one waits
# for it (``waited = 0``). In (?): name, owner. Rowcount 1: ended; 0: RING_RELEASE decides.
RELEASE_QUIET = (
    "DELETE FROM {t} WHERE name = ? AND owner = ? AND expires_at > UTC_TIMESTAMP(6) "
    "AND waited = 0"
)

# A release with (perhaps) a waiter, in one round trip: if a bell waits for the name, our live
# lease is made expired (kept, still marked, for the woken waiter's upsert to take over),
# else deleted; if we ended it, the first bell is taken out of the line and its sleep KILLed
# before the COMMIT, so the woken waiter's upsert is on its way while the commit is flushed
# (it waits for our row lock, then finds the row free). Our own bell (``me``) is not KILLed:
# the caller rings this process's line. In: name, owner, me. Out: one row: how many leases
# we ended (0 or 1), the bell taken out (or NULL), and 1 if its connection is gone, 2 if the
# KILL was refused (another user's), else 0.
RING_RELEASE = """
START TRANSACTION;
SET @lk_w = (SELECT conn FROM {t}_bells WHERE name = %(name)s AND server = @@server_id
              ORDER BY since, conn LIMIT 1);
UPDATE {t} SET expires_at = UTC_TIMESTAMP(6)
 WHERE name = %(name)s AND owner = %(owner)s AND expires_at > UTC_TIMESTAMP(6)
   AND @lk_w IS NOT NULL;
SET @lk_n = ROW_COUNT();
DELETE FROM {t} WHERE name = %(name)s AND owner = %(owner)s AND expires_at > UTC_TIMESTAMP(6);
SET @lk_n = @lk_n + ROW_COUNT(), @lk_gone = 0;
DELETE FROM {t}_bells WHERE name = %(name)s AND server = @@server_id AND conn = @lk_w
   AND @lk_n > 0;
BEGIN NOT ATOMIC
  DECLARE CONTINUE HANDLER FOR 1094 SET @lk_gone = 1;
  DECLARE CONTINUE HANDLER FOR SQLEXCEPTION SET @lk_gone = 2;
  IF @lk_n > 0 AND @lk_w <> %(me)s THEN KILL QUERY @lk_w; END IF;
END;
COMMIT;
SELECT @lk_n, IF(@lk_n > 0, @lk_w, NULL), @lk_gone"""

# A process's bell joins the line of a name (keeping its place if it is there), then marks
# the name's live leases: their releases ring. In: name, conn.
BELL_IN = """
INSERT INTO {t}_bells (name, server, conn, since)
VALUES (%(name)s, @@server_id, %(conn)s, UTC_TIMESTAMP(6)) ON DUPLICATE KEY UPDATE since = since;
UPDATE {t} SET waited = 1
 WHERE name = %(name)s AND waited = 0 AND expires_at > UTC_TIMESTAMP(6)"""

# A process's last waiter for a name leaves: its bell leaves the line. With ``pass`` (it was
# rung and leaves without the lease) and the name free, the next bell is taken out and rung
# in its place. In: name, conn, pass. Out: one row: the bell to ring (or NULL).
BELL_OUT = """
DELETE FROM {t}_bells WHERE name = %(name)s AND server = @@server_id AND conn = %(conn)s;
SET @lk_w = IF(%(pass)s AND NOT EXISTS (
        SELECT 1 FROM {t} WHERE name = %(name)s AND expires_at > UTC_TIMESTAMP(6)),
    (SELECT conn FROM {t}_bells WHERE name = %(name)s AND server = @@server_id
      ORDER BY since, conn LIMIT 1), NULL);
DELETE FROM {t}_bells WHERE name = %(name)s AND server = @@server_id AND conn = @lk_w;
SELECT @lk_w"""

# A KILL found no such connection (its process died, or its bell broke): its bells go, and
# the next of the name's line is taken out to be rung instead. In: name, conn. Out: as
# BELL_OUT.
BELL_GONE = """
DELETE FROM {t}_bells WHERE server = @@server_id AND conn = %(conn)s;
SET @lk_w = (SELECT conn FROM {t}_bells WHERE name = %(name)s AND server = @@server_id
              ORDER BY since, conn LIMIT 1);
DELETE FROM {t}_bells WHERE name = %(name)s AND server = @@server_id AND conn = @lk_w;
SELECT @lk_w"""

# Every bell of a name (a force-release rings them all; they stay in line). In: name.
BELLS_OF = "SELECT conn FROM {t}_bells WHERE name = %s AND server = @@server_id"

# Ends the bell's sleep (MariaDB: error 1317 there). In: the connection id (an integer).
KILL = "KILL QUERY %s"

#: A ring tries at most this many bells (each KILL that finds its connection gone moves on).
RING_TRIES = 3
#: Leases this process took over marked (their release rings straight away), at most.
WAITED_KEPT = 4096


class Ringer(Protocol):
    """The process's own bell, as the driver shows it to the store: its connection id, a
    wake-up without a KILL for a bell of this very process, and the news that a release of
    this process took it out of a name's line (the release rings the process's line itself:
    ``StoreBackend.release``)."""

    id: int

    def wake(self, name: str | None) -> None: ...

    def taken(self, name: str) -> None: ...


class Bells:
    """The bells' steps, mixed into the MySQL store (see the module docstring)."""

    RING_RELEASE: ClassVar[str] = RING_RELEASE
    BELL_IN: ClassVar[str] = BELL_IN
    BELL_OUT: ClassVar[str] = BELL_OUT
    BELL_GONE: ClassVar[str] = BELL_GONE
    BELLS_OF: ClassVar[str] = BELLS_OF
    prepared: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: This process's bell, once the driver has started it (None: none yet).
        self.bell: Ringer | None = None
        #: (name, owner) of live leases this process took over marked (see the module).
        self.marked: dict[tuple[str, str], bool] = {}

    def took_marked(self, name: str, owner: str) -> None:
        """An acquire took over a lease marked ``waited``: its release rings at once."""
        if len(self.marked) >= WAITED_KEPT:
            self.marked.clear()  # (only a shortcut: the plain release finds the mark too)
        self.marked[(name, owner)] = True

    def release_ringing(self, name: str, owner: str) -> Steps[bool]:
        """:data:`RING_RELEASE`, and what is left of its ring; whether our lease was live."""
        bell = self.bell
        params = {"name": name.encode(), "owner": owner, "me": 0 if bell is None else bell.id}
        try:
            rows, _ = yield Query(self.RING_RELEASE, params)
        except Refused:  # a statement failed with the transaction open (a lost lock wait)
            yield Query("ROLLBACK")
            raise
        ended, conn, gone = rows[0]
        if conn is not None:
            if bell is not None and int(conn) == bell.id:
                bell.taken(name)  # the release rings this process's line itself
            elif int(gone) == 1:  # that bell's connection is gone: ring the next
                yield from self.ring(name, int(conn))
        return bool(int(ended) > 0)

    def ring(self, name: str, conn: int | None) -> Steps[None]:
        """Wake the bell ``conn`` (taken out of ``name``'s line): this process's own without
        a round trip, another's by KILL; one that is gone gives way to the next."""
        for _ in range(RING_TRIES):
            if conn is None:
                return
            bell = self.bell
            if bell is not None and bell.id == conn:
                bell.taken(name)  # the release that took it out rings this process's line
                return
            try:
                yield Query(KILL, (conn,))
                return
            except ThreadGone:
                rows, _ = yield Query(self.BELL_GONE, {"name": name.encode(), "conn": conn})
                conn = None if not rows or rows[0][0] is None else int(rows[0][0])
            except NotPermitted:
                return  # another user's bell: it polls

    def bell_in(self, name: str, conn: int, needed: bool = True) -> Steps[None]:
        """The bell ``conn`` in ``name``'s line (``needed``: False if it is there already)."""
        if needed:
            yield Query(self.BELL_IN, {"name": name.encode(), "conn": conn})

    def bell_out(self, name: str, conn: int, pass_on: bool) -> Steps[None]:
        params = {"name": name.encode(), "conn": conn, "pass": int(pass_on)}
        rows, _ = yield Query(self.BELL_OUT, params)
        if rows and rows[0][0] is not None:
            yield from self.ring(name, int(rows[0][0]))

    def released(self, names: tuple[str, ...], everyone: bool = False) -> Steps[None]:
        """After a force-release: every bell of those names is rung (they keep their place:
        their waiters try, and sleep again)."""
        if everyone and self.prepared:
            for name in names:
                yield from self.ring_all(name)

    def rows_notify(self, spec: Any, wake: str) -> Steps[None]:
        """``rows.notify()`` on MariaDB: every process whose takes or leases wait for due rows
        of the table (their bells are in the line of ``wake``) is rung; the backend wakes
        this process's own. (MySQL: nothing here; the other processes poll.)"""
        if self.prepared:
            yield from self.ring_all(wake)

    def ring_all(self, name: str) -> Steps[None]:
        """Ring every bell in ``name``'s line (each keeps its place)."""
        rows, _ = yield Query(self.BELLS_OF, (name.encode(),))
        for (conn,) in rows:
            bell = self.bell
            if bell is not None and bell.id == int(conn):
                bell.wake(name)
                continue
            with contextlib.suppress(ThreadGone, NotPermitted):
                yield Query(KILL, (int(conn),))


def ours_marked(lease: Sequence[str]) -> bool:
    """Whether our lease, as the acquire answered it ('1', token, expires, µs, waited), was
    taken over marked."""
    return len(lease) > 4 and lease[4] == "1"
