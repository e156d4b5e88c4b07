"""What latchkey's MySQL and MariaDB sessions are set to, and which server errors mean what:
shared by the drivers of ``mysql://`` (PyMySQL, asyncmy, and both over a borrowed client).

A server error the store gives a meaning to is mapped by its number (:data:`REFUSED`) to a
:class:`Refused` subclass, raised into the primitive (the statement was rolled back and the
connection is fine): the store decides what it means (:mod:`latchkey.stores.mysql`: a lost
race, a row created first by another). :data:`SESSION_ENDING` are the server's errors that
still end the session; the drivers drop that connection.
"""

from __future__ import annotations

DEADLOCK, LOCK_WAIT_TIMEOUT, DUPLICATE_KEY = 1213, 1205, 1062
#: ``KILL QUERY``'s refusals: no such connection; another user's (MariaDB's bells).
UNKNOWN_THREAD, NOT_OWNER = 1094, 1095
#: What a statement ended by ``KILL QUERY`` answers (a bell's sleep: woken).
INTERRUPTED = 1317


class Refused(Exception):
    """The server refused a statement and rolled it back (the connection is fine): raised by
    the driver into the primitive, as ``REFUSED`` maps the error's number; the store decides."""


class Contended(Refused):
    """A deadlock or a lock-wait timeout: a lost race, the core retries."""


class Duplicate(Refused):
    """A duplicate key: the row was created first by another."""


class ThreadGone(Refused):
    """``KILL QUERY`` of a connection that no longer exists."""


class NotPermitted(Refused):
    """``KILL QUERY`` of another user's connection, without the privilege to."""


class Overdue(OSError):
    """A call's deadline passed before its next statement was sent (the drivers bound a whole
    call by one deadline): StoreUnavailable, with the connection or session in a known state."""


REFUSED = {DEADLOCK: Contended, LOCK_WAIT_TIMEOUT: Contended, DUPLICATE_KEY: Duplicate,
           UNKNOWN_THREAD: ThreadGone, NOT_OWNER: NotPermitted}  # fmt: skip
#: The server refused a write because it is read-only (1290: ``--read-only``; 1836: read-only
#: mode): a primary demoted under us. Its connections are dropped; a new one looks for the
#: writable host (several hosts in the URL: the drivers drop the idle ones too).
READ_ONLY = frozenset({1290, 1836})
#: Server errors (below 2000: the server answered) that still end the session: shutdown,
#: killed, interrupted, aborted, read-only. Others are a statement's own (the drivers'
#: ``user_error``).
SESSION_ENDING = frozenset(
    {1053, *range(1077, 1081), *range(1152, 1162), INTERRUPTED, 1927, *READ_ONLY}
)

# Session settings at connect: the clock we read is UTC whatever the server's zone, and a
# row-lock wait (only possible behind a stalled peer's statement) ends before our timeout.
SESSION = "SET time_zone = '+00:00', innodb_lock_wait_timeout = %s"
