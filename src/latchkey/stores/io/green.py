"""Green threads: whether gevent or eventlet has monkey-patched this process.

Under ``gevent.monkey.patch_all()`` or ``eventlet.monkey_patch()`` (Celery's ``-P gevent`` and
``-P eventlet`` workers) threads are greenlets on one OS thread, and only waits that go through
the patched modules (sockets, ``select``, ``time.sleep``, ``threading``) let the others run.
A driver asks :func:`patched` when it opens a connection, to wait the patched way where its
usual way would not (libpq's blocking calls: :mod:`latchkey.stores.io.psycopg_green`; the
kernel's socket timeouts, which a patched socket never sees: the memcached driver)."""

from __future__ import annotations

import sys


def patched() -> bool:
    """Whether gevent or eventlet has monkey-patched ``select`` in this process (asked without
    importing either)."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("select"):
        return True
    patcher = sys.modules.get("eventlet.patcher")
    return patcher is not None and bool(patcher.is_monkey_patched("select"))
