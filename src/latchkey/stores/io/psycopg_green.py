"""psycopg under green threads (gevent, eventlet): waiting without stopping every greenlet.

Under green threads (:mod:`latchkey.stores.io.green`) a C call that waits on the network
itself stops every greenlet: libpq's ``PQexecPrepared``, which the sync PostgreSQL drivers
run their hot statements with (``psycopg.Session.run_prepared``, the session locks'
``PsycopgSessions``). Against a frozen server that call never returns, and the watchdog that
would cut it (:mod:`latchkey.stores.io.watchdog`: a greenlet too) never runs: the whole
process hangs. When :func:`~latchkey.stores.io.green.patched` says so, a driver calls
:func:`prepare` and :func:`exec_prepared` instead: they send the statement and wait for its
reply (:func:`reply`) on the patched ``select``, so the hub runs the other greenlets, the
watchdog among them, meanwhile.

psycopg's own ``execute`` waits through ``select`` under gevent (psycopg detects its patching),
but in C under eventlet, unless ``PSYCOPG_WAIT_FUNC=wait_select`` is set before psycopg is
imported: :func:`psycopg_waits_in_c` says so, for the driver's warning.
"""

from __future__ import annotations

import select
from collections.abc import Sequence

import psycopg
from psycopg import waiting

from latchkey.stores.io.green import patched

__all__ = ["exec_prepared", "patched", "prepare", "psycopg_waits_in_c", "reply"]


def psycopg_waits_in_c() -> bool:
    """Whether psycopg's own waits (connect, ``execute``) run in C, unseen by the green hub."""
    return waiting.wait is getattr(waiting, "wait_c", None)


def prepare(pgconn: psycopg.pq.abc.PGconn, name: bytes, query: bytes) -> psycopg.pq.abc.PGresult:
    """``pgconn.prepare(name, query)``, waiting on the hub."""
    pgconn.send_prepare(name, query)
    return reply(pgconn)


def exec_prepared(
    pgconn: psycopg.pq.abc.PGconn, name: bytes, params: Sequence[bytes | None] | None,
    formats: Sequence[int] | None = None, result_format: int = 0,
) -> psycopg.pq.abc.PGresult:  # fmt: skip
    """``pgconn.exec_prepared(name, params, formats, result_format)``, waiting on the hub."""
    pgconn.send_query_prepared(name, params, formats, result_format)
    return reply(pgconn)


def reply(pgconn: psycopg.pq.abc.PGconn) -> psycopg.pq.abc.PGresult:
    """The result of the one statement just sent on ``pgconn`` (psycopg opens connections in
    libpq's nonblocking mode), waiting on the patched ``select``: the sync twin of
    ``psycopg_async.reply``. Raises psycopg's OperationalError if the connection fails (or
    the watchdog shuts its socket down)."""
    fd = pgconn.socket
    while pgconn.flush():  # only if the socket's buffer is full (never for our statements)
        select.select([], [fd], [])
    last: psycopg.pq.abc.PGresult | None = None
    while True:
        while pgconn.is_busy():
            select.select([fd], [], [])
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:  # the end of the reply: the connection is idle again
            assert last is not None
            return last
        last = result
