"""MariaDB's bells: a release wakes a waiting process at once, instead of its next poll, and
hands the lease to that process's first waiter in its own commit.

MariaDB has no server push (no LISTEN/NOTIFY), but one session can end another's statement:
``KILL QUERY <connection id>`` ends a ``SELECT SLEEP(n)`` at once with error 1317. A process
that waits for a name keeps one *bell*, a connection of its own that sleeps in the server
(:mod:`latchkey.stores.io.mysql_bell`), and puts it in the ``{t}_bells`` table (a MEMORY
table: no disk write, emptied by a restart, as the connection ids are) once per name, in the
order processes came; it also marks the live lease ``waited``. A release of a lease so
marked takes the first bell of its name out of the table and KILLs its query.

**Hand-over.** The bell names its *heir*: the owner, JSON and TTL of its process's first
waiter of the name (a mutex waiter's; others are only rung: ``heir_of``). The release that
rings the bell takes its live lease over for the heir in the same transaction
(:data:`HAND_OVER`), so a hand-off is one commit, not two: the woken waiter's attempt waits
for the release's row lock and finds its own live lease. When the process's first waiter
leaves, the bell names the next one, or leaves.

How no wake-up and no lease is lost, and why the uncontended path costs nothing:

- A release is one prepared compound statement (:data:`RELEASE`) whose first step is the
  plain ``DELETE … AND waited = 0``: a lease no one waited for ends as before. A holder that
  took its lease over marked (the acquire's answer says) skips that step.
- A waiter marks the live lease *after* putting its bell in, and the core tries again after
  that (``wait_in_line``): a release before the mark is seen by that attempt; one after it
  finds the mark and rings.
- A marked lease is not deleted while a bell waits: it is handed to the heir, or (no heir)
  made expired and kept with its mark for the woken waiter's upsert; either way its release
  rings the next bell. The last release, with no bell left, deletes the row.
- A bell taken out of the table by a ring is put back (at the end of the line) by its
  process before it sleeps again (``Bell.register``), and its waiter tries once more.
- An heir whose wait ends without the lease may have been handed it: once its bell no longer
  names it, its lease is released, which passes it on, and again after each ring for a while
  (:attr:`Bells.orphans`: a release that read the heir just before may still hand over). An
  heir that won the name by its own attempt is unnamed by its release (``heir`` flag).
- A hand-over whose KILL finds the bell's connection gone (1094: its process died) is undone
  in the same transaction, and the next bell is rung.

The ring is only a wake-up, and the hand-over only saves a commit: correctness never depends
on either. A lost ring (a bell between two sleeps, a user not allowed to KILL another's
query, expiry, a batch release, a purge) leaves the waiter to the core's polls, capped by
the holder's remaining lease; a lease handed to a process that stops before taking it ends
by its TTL. Bells name the server (``@@server_id``): after a failover a replicated row never
rings a connection of another server. MySQL keeps polling (its ``SLEEP`` ends with 1).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from latchkey.stores.io import Steps
from latchkey.stores.io.mysql_session import NotPermitted, Refused, ThreadGone
from latchkey.stores.mysql_tables import INFO_MAX, micros
from latchkey.stores.sql import Query

# MariaDB's release, prepared per connection (a compound statement: parsed once), one round
# trip in every case. ``quiet``: first the plain DELETE of our live lease if no one waits
# (``waited = 0``); if it ended it, that is all (no result set). Otherwise, in one
# transaction: no bell waits for the name: our live lease is deleted. Else the first bell
# is taken out of the line and its sleep KILLed before the COMMIT, and:
# - if it names an heir (its process's first waiter: owner, JSON, TTL), our live lease is
#   handed to the heir by one upsert (HAND_OVER): a new fencing token (its AUTO_INCREMENT
#   draw, as an acquire's), the heir's TTL. The grant is this one commit: the woken
#   waiter's attempt waits for our row lock, then finds its own live lease (no write). If
#   the KILL finds the bell's connection gone (its process died), the handed lease is made
#   expired again (free) and the caller rings the next bell;
# - else (or if our lease is not slot 0's) our live lease is made expired, kept with its
#   mark for the woken waiter's upsert to take over.
# Our own bell (``me``) is not KILLed: the caller rings this process's line. ``heir``: a bell
# of ours may name us as its heir (we barged while it named us): it stops. In (?): name,
# owner, me, heir, quiet. Out: none (the quiet DELETE ended our lease), or one row: how many
# leases we ended (0 or 1), the bell taken out (or NULL), 1 if its connection is gone, 2 if
# the KILL was refused (another user's), else 0; and 1 if the heir got the lease.
RELEASE = """BEGIN NOT ATOMIC
  DECLARE p_name VARBINARY(255) DEFAULT ?;
  DECLARE p_owner CHAR(32) DEFAULT ?;
  DECLARE p_me BIGINT UNSIGNED DEFAULT ?;
  DECLARE p_heir TINYINT DEFAULT ?;
  DECLARE p_quiet TINYINT DEFAULT ?;
  DECLARE lk_w BIGINT UNSIGNED DEFAULT NULL;
  DECLARE lk_h CHAR(32) DEFAULT NULL;
  DECLARE lk_i VARBINARY(4096) DEFAULT NULL;
  DECLARE lk_t, lk_n, lk_gone, lk_given BIGINT DEFAULT 0;
  DECLARE CONTINUE HANDLER FOR NOT FOUND SET lk_w = NULL;  -- no bell: no row to read
  IF p_quiet THEN
    DELETE FROM {t} WHERE name = p_name AND owner = p_owner
       AND expires_at > UTC_TIMESTAMP(6) AND waited = 0;
    SET lk_n = ROW_COUNT();
  END IF;
  IF lk_n = 0 THEN
  START TRANSACTION;
  SELECT conn, heir, info, ttl INTO lk_w, lk_h, lk_i, lk_t FROM {t}_bells
   WHERE name = p_name AND server = @@server_id ORDER BY since, conn LIMIT 1;
  IF lk_w IS NULL THEN
    DELETE FROM {t}
     WHERE name = p_name AND owner = p_owner AND expires_at > UTC_TIMESTAMP(6);
    SET lk_n = ROW_COUNT();
  ELSE
    IF lk_h <> p_owner THEN
      SET @lk_c = 0;
      {hand};
      SET lk_given = ROW_COUNT() = 2, lk_n = lk_given;
    END IF;
    IF NOT lk_given THEN
      UPDATE {t} SET expires_at = UTC_TIMESTAMP(6)
       WHERE name = p_name AND owner = p_owner AND expires_at > UTC_TIMESTAMP(6);
      SET lk_n = ROW_COUNT();
    END IF;
    IF lk_n > 0 AND lk_w <> p_me THEN
      BEGIN
        DECLARE CONTINUE HANDLER FOR 1094 SET lk_gone = 1;
        DECLARE CONTINUE HANDLER FOR SQLEXCEPTION SET lk_gone = 2;
        KILL QUERY lk_w;
      END;
    END IF;
    IF lk_n > 0 THEN
      DELETE FROM {t}_bells WHERE name = p_name AND server = @@server_id AND conn = lk_w;
    END IF;
    IF lk_given AND lk_gone = 1 THEN
      UPDATE {t} SET expires_at = UTC_TIMESTAMP(6)
       WHERE name = p_name AND slot = 0 AND owner = lk_h;
      SET lk_given = 0;
    END IF;
    IF p_heir THEN
      UPDATE {t}_bells SET heir = NULL
       WHERE name = p_name AND server = @@server_id AND heir = p_owner;
    END IF;
  END IF;
  COMMIT;
  SELECT lk_n, IF(lk_n > 0, lk_w, NULL), lk_gone, lk_given;
  END IF;
END"""

# RELEASE's hand-over: one upsert on slot 0 that takes our live lease over for the heir
# (lk_h, lk_i, lk_t: its owner, JSON and TTL): ``@lk_c`` is whether the row is ours and live,
# read before any column changes (the assignments run left to right, owner last). Were the
# row missing, the row it inserts is already expired (free): nobody's. Rowcount 2: handed.
HAND_OVER = """INSERT INTO {t} (name, slot, owner, owner_info, token, acquired_at, expires_at)
      VALUES (p_name, 0, lk_h, lk_i, NULL, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))
      ON DUPLICATE KEY UPDATE
        owner_info  = IF(@lk_c := (owner = p_owner AND expires_at > UTC_TIMESTAMP(6)),
                         VALUES(owner_info), owner_info),
        token       = IF(@lk_c, VALUES(token), token),
        acquired_at = IF(@lk_c, VALUES(acquired_at), acquired_at),
        expires_at  = IF(@lk_c, UTC_TIMESTAMP(6) + INTERVAL lk_t MICROSECOND, expires_at),
        owner       = IF(@lk_c, VALUES(owner), owner)"""
RELEASE = RELEASE.replace("{hand}", HAND_OVER)

# In: name, owner, me, heir, quiet (RELEASE's parameters).
EXECUTE_RELEASE = "EXECUTE latchkey_release USING %s, %s, %s, %s, %s"

# A process's bell joins the line of a name (keeping its place if it is there, naming its
# heir anew), then marks the name's live leases: their releases ring. In: name, conn, heir,
# info, ttl (the heir's; NULL: none).
BELL_IN = """
INSERT INTO {t}_bells (name, server, conn, since, heir, info, ttl)
VALUES (%(name)s, @@server_id, %(conn)s, UTC_TIMESTAMP(6), %(heir)s, %(info)s, %(ttl)s)
ON DUPLICATE KEY UPDATE since = since, heir = VALUES(heir), info = VALUES(info),
    ttl = VALUES(ttl);
UPDATE {t} SET waited = 1
 WHERE name = %(name)s AND waited = 0 AND expires_at > UTC_TIMESTAMP(6)"""

# A process's last waiter for a name leaves: its bell leaves the line. With ``pass`` (it was
# rung and leaves without the lease) and the name free, the next bell is taken out and rung
# in its place. In: name, conn, pass. Out: one row: the bell to ring (or NULL). Never one
# statement reading both tables: it would hold the MEMORY table's lock while its (locking)
# read waits for a release's row lock, as that release waits for the MEMORY table.
BELL_OUT = """
DELETE FROM {t}_bells WHERE name = %(name)s AND server = @@server_id AND conn = %(conn)s;
SET @lk_f = %(pass)s AND NOT EXISTS (
        SELECT 1 FROM {t} WHERE name = %(name)s AND expires_at > UTC_TIMESTAMP(6));
SET @lk_w = IF(@lk_f, (SELECT conn FROM {t}_bells WHERE name = %(name)s
    AND server = @@server_id ORDER BY since, conn LIMIT 1), NULL);
DELETE FROM {t}_bells WHERE name = %(name)s AND server = @@server_id AND conn = @lk_w;
SELECT @lk_w"""

# A KILL found no such connection (its process died, or its bell broke): its bells go, and
# the next of the name's line is taken out to be rung instead. In: name, conn. Out: BELL_OUT's.
BELL_GONE = """
DELETE FROM {t}_bells WHERE server = @@server_id AND conn = %(conn)s;
SET @lk_w = (SELECT conn FROM {t}_bells WHERE name = %(name)s AND server = @@server_id
              ORDER BY since, conn LIMIT 1);
DELETE FROM {t}_bells WHERE name = %(name)s AND server = @@server_id AND conn = @lk_w;
SELECT @lk_w"""

# Which of some (name, owner) pairs hold a live lease (orphans: Bells.give_back). In: the
# names, then the owners ({names}, {owners}: as many placeholders).
HELD_BY = (
    "SELECT name, owner FROM {t} WHERE name IN ({names}) AND owner IN ({owners}) "
    "AND expires_at > UTC_TIMESTAMP(6)"
)

# Every bell of a name (a force-release rings them all; they stay in line). In: name.
BELLS_OF = "SELECT conn FROM {t}_bells WHERE name = %s AND server = @@server_id"

# Ends the bell's sleep (MariaDB: error 1317 there). In: the connection id (an integer).
KILL = "KILL QUERY %s"

#: A ring tries at most this many bells (each KILL that finds its connection gone moves on).
RING_TRIES = 3
#: Leases this process took over marked (their release rings straight away), at most.
WAITED_KEPT = 4096
#: How long an orphan is kept after its first give-back, in timeouts: longer than any release
#: statement that read its heir before it was unnamed may take to hand over (each is bounded
#: by the timeout).
ORPHAN_GRACE = 2


class Ringer(Protocol):
    """The process's own bell, as the driver shows it to the store: its connection id, a
    wake-up without a KILL for a bell of this very process, and the news that a release of
    this process took it out of a name's line (the release rings the process's line itself:
    ``StoreBackend.release``)."""

    id: int

    def wake(self, name: str | None) -> None: ...

    def taken(self, name: str) -> None: ...


#: What a bell names as its heir: a waiting owner, its JSON, its TTL in microseconds.
Heir = tuple[str, str, int]


class Bells:
    """The bells' steps, mixed into the MySQL store (see the module docstring)."""

    RELEASE_PREPARED: ClassVar[str] = RELEASE
    BELL_IN: ClassVar[str] = BELL_IN
    BELL_OUT: ClassVar[str] = BELL_OUT
    BELL_GONE: ClassVar[str] = BELL_GONE
    BELLS_OF: ClassVar[str] = BELLS_OF
    HELD_BY: ClassVar[str] = HELD_BY
    prepared: bool
    timeout: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: This process's bell, once the driver has started it (None: none yet).
        self.bell: Ringer | None = None
        #: (name, owner) of live leases this process took over marked (see the module).
        self.marked: dict[tuple[str, str], bool] = {}
        #: The owner this process's bell last named as heir, by name (it may have been
        #: handed the lease since: a release by that owner clears it in the server).
        self.heirs: dict[str, str] = {}
        #: Heirs whose wait ended without the lease, by (name, owner): a lease handed to one
        #: is given back (:meth:`give_back`) by this process's bell after each ring (it
        #: listens while there are orphans), and by its next acquire of the name. Kept until
        #: ORPHAN_GRACE times the timeout after the first give-back: a release that read the
        #: heir before it was unnamed may still hand over, and rings when it does. The value:
        #: when it may go (None: not given back yet).
        self.orphans: dict[tuple[str, str], float | None] = {}

    def took_marked(self, name: str, owner: str) -> None:
        """An acquire took over a lease marked ``waited``: its release rings at once."""
        if len(self.marked) >= WAITED_KEPT:
            self.marked.clear()  # (only a shortcut: the plain release finds the mark too)
        self.marked[(name, owner)] = True

    def release_ringing(
        self, name: str, owner: str, quiet: bool = False, unname: bool = False
    ) -> Steps[bool]:
        """:data:`RELEASE` (``quiet``: its plain DELETE first; ``unname``: a bell of ours
        naming ``owner`` as heir stops, whatever ``heirs`` says), and what is left of its
        ring; whether our lease was live."""
        bell = self.bell
        heir = unname or self.heirs.get(name) == owner
        if self.heirs.get(name) == owner:
            del self.heirs[name]  # the statement clears it in the server too
        params = (name.encode(), owner, 0 if bell is None else bell.id, int(heir), int(quiet))
        try:
            rows, _ = yield Query(EXECUTE_RELEASE, params)
        except Refused:  # a statement failed with the transaction open (a lost lock wait)
            yield Query("ROLLBACK")
            raise
        if not rows:
            return True  # quiet: ended by the plain DELETE, no one waited
        ended, conn, gone, _ = rows[0]
        if conn is not None:
            if bell is not None and int(conn) == bell.id:
                bell.taken(name)  # the release rings this process's line itself
            elif int(gone) == 1:  # that bell's connection is gone: ring the next
                yield from self.ring(name, int(conn))
        return bool(int(ended) > 0)

    def orphan(self, name: str, owner: str) -> None:
        """An heir left without the lease: see :attr:`orphans`."""
        self.orphans.setdefault((name, owner), None)

    def give_back(self, name: str | None = None, again: bool = True) -> Steps[bool]:
        """The orphans' (of ``name``; None: of every name) leases released, by a release
        that also stops a bell of ours naming the owner: that passes a handed lease on. The
        first time, one release each; after that (unless not ``again``: the bell's), one read
        finds the few that hold a lease. Safe whoever runs it: an owner is one acquire call's,
        and that call ended without a grant: its live lease is nobody's. Whether one was live."""
        now, found = time.monotonic(), False
        mine = [key for key in list(self.orphans) if name is None or key[0] == name]
        held = [key for key in mine if self.orphans.get(key) is None]
        known = [key for key in mine if again and self.orphans.get(key) is not None]
        if known:
            marks = ", ".join(["%s"] * len(known))
            sql = self.HELD_BY.format(names=marks, owners=marks)
            params = [n.encode() for n, _ in known] + [o for _, o in known]
            rows, _ = yield Query(sql, params)
            live = {(bytes(n).decode(), str(o)) for n, o in rows}
            held += [key for key in known if key in live]
        for key in held:
            found = (yield from self.release_ringing(*key, unname=True)) or found
            self.orphans[key] = self.orphans.get(key) or now + ORPHAN_GRACE * self.timeout
        for key in known:
            until = self.orphans.get(key)
            if until is not None and now >= until:
                self.orphans.pop(key, None)
        return found

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

    def bell_in(
        self, name: str, conn: int, needed: bool = True, heir: Heir | None = None
    ) -> Steps[None]:
        """The bell ``conn`` in ``name``'s line, naming ``heir`` (``needed``: False if it is
        there already, naming the same)."""
        if not needed:
            return
        owner, info, ttl = heir if heir is not None else (None, None, None)
        params = {"name": name.encode(), "conn": conn, "heir": owner, "info": info, "ttl": ttl}
        if owner is not None:
            self.heirs[name] = owner  # before the statement: should it fail, it may name it
        yield Query(self.BELL_IN, params)
        if owner is None:
            self.heirs.pop(name, None)

    def bell_out(self, name: str, conn: int, pass_on: bool) -> Steps[None]:
        params = {"name": name.encode(), "conn": conn, "pass": int(pass_on)}
        rows, _ = yield Query(self.BELL_OUT, params)
        self.heirs.pop(name, None)
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


def heir_of(owner: str, info: str, ttl: float, limit: int) -> Heir | None:
    """What a waiter's bell names as heir: a mutex waiter's owner (a semaphore's waiters,
    and the rows' subscribers, are rung, not handed a lease), unless its JSON is too long
    for the bells' table."""
    if limit != 1 or not owner or len(info.encode()) > INFO_MAX:
        return None
    return owner, info, micros(ttl)


def ours_marked(lease: Sequence[str]) -> bool:
    """Whether our lease, as the acquire answered it ('1', token, expires, µs, waited), was
    taken over marked."""
    return len(lease) > 4 and lease[4] == "1"
