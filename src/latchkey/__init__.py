"""latchkey: locks, limits and claims for the databases you already run.

>>> import latchkey
>>> store = latchkey.connect("memory://doctest")
>>> with store.lock("digest:42", ttl="10m") as lock:
...     lock.token > 0
True
"""

from __future__ import annotations

from latchkey import errors
from latchkey._claim import Claim
from latchkey._durations import Duration, parse_duration
from latchkey._lock import Lock, Semaphore
from latchkey._owner import Owner
from latchkey._record import Record
from latchkey._store import Health, Store, connect
from latchkey._types import Holder, LockInfo
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

__version__ = "0.1.0.dev0"

__all__ = [
    "Capabilities",
    "Claim",
    "ConfigError",
    "Conflict",
    "Duration",
    "Health",
    "Holder",
    "InvalidName",
    "InvalidValue",
    "LatchkeyError",
    "Lock",
    "LockInfo",
    "LockLost",
    "LockTimeout",
    "Owner",
    "Record",
    "Semaphore",
    "Store",
    "StoreUnavailable",
    "Unsupported",
    "__version__",
    "connect",
    "errors",
    "parse_duration",
]
