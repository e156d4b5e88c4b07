"""Compatibility only: what ``pg_advisory_async`` imports from here until it moves onto the
shared I/O layer. The ``postgresql://`` store's asyncio backend is
:class:`latchkey.stores.postgresql.AsyncPostgreSQLBackend`; its I/O is
:mod:`latchkey.stores.io.psycopg_async`. Delete this module with ``pg_advisory_async.py``.
"""

from latchkey.stores.io.psycopg_async import NET_ERRORS, AsyncSession, guarded
from latchkey.stores.postgresql import AsyncPostgreSQLBackend

__all__ = ["NET_ERRORS", "AsyncPostgreSQLBackend", "AsyncSession", "guarded"]
