"""The errors latchkey raises.

Every error is a :class:`LatchkeyError` and also subclasses the built-in exception that
callers already catch::

    LatchkeyError (Exception)
    ├── LockTimeout (TimeoutError)        the wait ran out; says who holds the lock, until when
    ├── LockLost                          the lease ended (expired, taken, connection gone)
    ├── Conflict                          a versioned record changed since it was read
    ├── StoreUnavailable (ConnectionError) the store cannot be reached or answered wrongly
    ├── Unsupported (NotImplementedError) the store lacks a capability (see Capabilities)
    ├── InvalidName (ValueError)          empty, not UTF-8, or longer than 255 bytes
    ├── InvalidValue (ValueError)         a record value that is not JSON
    └── ConfigError (ValueError)          a bad URL, option or duration: says which and why

Messages name the lock and its holder; they never contain a password from a store URL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from latchkey._types import Holder

__all__ = [
    "ConfigError",
    "Conflict",
    "InvalidName",
    "InvalidValue",
    "LatchkeyError",
    "LockLost",
    "LockTimeout",
    "StoreUnavailable",
    "Unsupported",
]


class LatchkeyError(Exception):
    """Base class of every error latchkey raises."""


class LockTimeout(LatchkeyError, TimeoutError):
    """The wait for a lock ran out. ``holder`` is who held it when we gave up, if known."""

    def __init__(self, message: str, *, name: str = "", holder: Holder | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.holder = holder


class LockLost(LatchkeyError):
    """The lease is no longer ours: it expired, was force-released, or its session died."""


class Conflict(LatchkeyError):
    """A versioned record was written by someone else since we read it."""


class StoreUnavailable(LatchkeyError, ConnectionError):
    """The store could not be reached, timed out, or answered something we cannot trust.

    Never means "busy": a busy lock is ``acquire() -> False`` or :class:`LockTimeout`.
    """


class Unsupported(LatchkeyError, NotImplementedError):
    """The store does not provide this operation (see ``store.capabilities``)."""


class InvalidName(LatchkeyError, ValueError):
    """A lock or record name that is empty, not valid UTF-8, or longer than 255 bytes."""


class InvalidValue(LatchkeyError, ValueError):
    """A record value that cannot be stored as JSON."""


class ConfigError(LatchkeyError, ValueError):
    """A bad store URL, option or duration. The message names the value and why."""
