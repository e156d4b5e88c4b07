"""latchkey: locks, limits and claims for the databases you already run.

>>> import latchkey
>>> store = latchkey.connect("memory://doctest")
>>> with store.lock("digest:42", ttl="10m") as lock:
...     lock.token > 0
True

The asyncio twin (``connect_async``, ``AsyncStore``, ``AsyncLock``…) is imported on first use,
so that the sync API and the CLI do not load asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from latchkey import errors
from latchkey._claim import Claim
from latchkey._core.store import Health
from latchkey._durations import Duration, parse_duration
from latchkey._lock import Lock, Semaphore
from latchkey._observe import disable_metrics, disable_tracing, enable_metrics, enable_tracing
from latchkey._owner import Owner
from latchkey._record import Record
from latchkey._rows import Completion, LeaseBatch, Rows, TakeBatch
from latchkey._store import Store, connect
from latchkey._types import Holder, LockInfo, RowState
from latchkey.errors import (
    ConfigError,
    Conflict,
    InvalidName,
    InvalidValue,
    LatchkeyError,
    LockLost,
    LockTimeout,
    StoreUnavailable,
    Unsupported,
)
from latchkey.stores.base import Capabilities

if TYPE_CHECKING:
    from latchkey._async.claim import AsyncClaim
    from latchkey._async.lock import AsyncLock, AsyncSemaphore
    from latchkey._async.record import AsyncRecord
    from latchkey._async.rows import (
        AsyncCompletion,
        AsyncLeaseBatch,
        AsyncRows,
        AsyncTakeBatch,
    )
    from latchkey._async.store import AsyncStore, connect_async

__version__ = "0.2.0.dev0"

_ASYNC = {
    "AsyncClaim": "latchkey._async.claim",
    "AsyncCompletion": "latchkey._async.rows",
    "AsyncLock": "latchkey._async.lock",
    "AsyncLeaseBatch": "latchkey._async.rows",
    "AsyncRecord": "latchkey._async.record",
    "AsyncRows": "latchkey._async.rows",
    "AsyncSemaphore": "latchkey._async.lock",
    "AsyncStore": "latchkey._async.store",
    "AsyncTakeBatch": "latchkey._async.rows",
    "connect_async": "latchkey._async.store",
}


def __getattr__(name: str) -> Any:
    if name in _ASYNC:
        import importlib

        value = getattr(importlib.import_module(_ASYNC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'latchkey' has no attribute {name!r}")


__all__ = [
    "AsyncClaim",
    "AsyncCompletion",
    "AsyncLeaseBatch",
    "AsyncLock",
    "AsyncRecord",
    "AsyncRows",
    "AsyncSemaphore",
    "AsyncStore",
    "AsyncTakeBatch",
    "Capabilities",
    "Claim",
    "Completion",
    "ConfigError",
    "Conflict",
    "Duration",
    "Health",
    "Holder",
    "InvalidName",
    "InvalidValue",
    "LatchkeyError",
    "LeaseBatch",
    "Lock",
    "LockInfo",
    "LockLost",
    "LockTimeout",
    "Owner",
    "Record",
    "RowState",
    "Rows",
    "Semaphore",
    "Store",
    "StoreUnavailable",
    "TakeBatch",
    "Unsupported",
    "__version__",
    "connect",
    "connect_async",
    "disable_metrics",
    "disable_tracing",
    "enable_metrics",
    "enable_tracing",
    "errors",
    "parse_duration",
]
