"""Names the GET_LOCK store's asyncio backend imports from here (the lease table's asyncio
backend is :class:`latchkey.stores.mysql.AsyncMySQLBackend`, its driver
:mod:`latchkey.stores.io.asyncmy`). To be removed once ``mysql_getlock_async`` imports them
from :mod:`latchkey.stores.io.asyncmy`."""

from latchkey.stores.io.asyncmy import ASYNC_DRIVER_ERRORS, IDLE_PING, async_connect_args, bounded
from latchkey.stores.mysql import AsyncMySQLBackend

__all__ = ["ASYNC_DRIVER_ERRORS", "IDLE_PING", "AsyncMySQLBackend", "async_connect_args", "bounded"]
