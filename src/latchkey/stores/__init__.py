"""The table of stores: URL scheme → backend classes (sync and asyncio), loaded on first use.

Third-party stores register under the ``latchkey.stores`` entry-point group (sync) and the
``latchkey.async_stores`` group (asyncio) with ``scheme = "module:Class"``; a built-in scheme
cannot be overridden.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from latchkey._url import StoreURL
from latchkey.errors import ConfigError, Unsupported
from latchkey.stores.base import AsyncBackend, AsyncWaiter, Backend, Capabilities, Waiter

__all__ = [
    "BUILTIN",
    "AsyncBackend",
    "AsyncWaiter",
    "Backend",
    "Capabilities",
    "Waiter",
    "async_backend_class",
    "backend_class",
    "open_async_backend",
    "open_backend",
]

_PG, _MY = "latchkey.stores.postgresql", "latchkey.stores.mysql"
_MEM, _LITE = "latchkey.stores.memory", "latchkey.stores.sqlite"
_ADV, _GL = "latchkey.stores.pg_advisory", "latchkey.stores.mysql_getlock"

# scheme: (sync module:class, asyncio module:class or None, the extra that installs its driver)
BUILTIN: dict[str, tuple[str, str | None, str | None]] = {
    "memory": (f"{_MEM}:MemoryBackend", f"{_MEM}:AsyncMemoryBackend", None),
    "sqlite": (f"{_LITE}:SQLiteBackend", f"{_LITE}:AsyncSQLiteBackend", None),
    "postgresql": (f"{_PG}:PostgreSQLBackend", None, "postgresql"),
    "postgres": (f"{_PG}:PostgreSQLBackend", None, "postgresql"),
    "postgresql+advisory": (f"{_ADV}:AdvisoryBackend", None, "postgresql"),
    "mysql": (f"{_MY}:MySQLBackend", None, "mysql"),
    "mariadb": (f"{_MY}:MySQLBackend", None, "mysql"),
    "mysql+getlock": (f"{_GL}:GetLockBackend", None, "mysql"),
    "redis": ("latchkey.stores.redis:RedisBackend", None, "redis"),
    "rediss": ("latchkey.stores.redis:RedisBackend", None, "redis"),
    "memcached": ("latchkey.stores.memcached:MemcachedBackend", None, "memcached"),
    "mongodb": ("latchkey.stores.mongodb:MongoDBBackend",
                "latchkey.stores.mongodb_async:AsyncMongoDBBackend", "mongodb"),
    "mongodb+srv": ("latchkey.stores.mongodb:MongoDBBackend",
                    "latchkey.stores.mongodb_async:AsyncMongoDBBackend", "mongodb"),
}  # fmt: skip


def _load(target: str, scheme: str, extra: str | None, base: type) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if extra and exc.name and not exc.name.startswith("latchkey"):
            raise ConfigError(
                f"the {scheme}:// store needs the {exc.name} driver: "
                f"pip install 'latchkey[{extra}]'"
            ) from None
        if exc.name and exc.name.startswith("latchkey"):
            raise ConfigError(f"the {scheme}:// store is not available in this version") from None
        raise
    cls = getattr(module, attr)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{target} (store {scheme}://) is not a latchkey {base.__name__}")
    return cls


def _unknown(scheme: str) -> ConfigError:
    known = ", ".join(sorted(BUILTIN))
    return ConfigError(f"unknown store URL scheme {scheme!r} (known: {known})")


def backend_class(scheme: str) -> type[Backend]:
    """The sync backend class for ``scheme``, importing its module (and driver) on first use."""
    if scheme in BUILTIN:
        target, _, extra = BUILTIN[scheme]
        cls: type[Backend] = _load(target, scheme, extra, Backend)
        return cls
    for ep in entry_points(group="latchkey.stores"):
        if ep.name == scheme:
            found: type[Backend] = _load(ep.value, scheme, None, Backend)
            return found
    raise _unknown(scheme)


def async_backend_class(scheme: str) -> type[AsyncBackend]:
    """The asyncio backend class for ``scheme``."""
    if scheme in BUILTIN:
        _, target, extra = BUILTIN[scheme]
        if target is None:
            raise Unsupported(f"the {scheme}:// store has no asyncio backend yet")
        cls: type[AsyncBackend] = _load(target, scheme, extra, AsyncBackend)
        return cls
    for ep in entry_points(group="latchkey.async_stores"):
        if ep.name == scheme:
            found: type[AsyncBackend] = _load(ep.value, scheme, None, AsyncBackend)
            return found
    for ep in entry_points(group="latchkey.stores"):
        if ep.name == scheme:
            raise Unsupported(f"the {scheme}:// store has no asyncio backend")
    raise _unknown(scheme)


def open_backend(url: str) -> Backend:
    """Parse ``url``, validate its options and create the sync backend (connecting lazily)."""
    parsed = StoreURL.parse(url)
    return backend_class(parsed.scheme)(parsed)


def open_async_backend(url: str) -> AsyncBackend:
    """Parse ``url``, validate its options and create the asyncio backend (connecting on first
    use)."""
    parsed = StoreURL.parse(url)
    return async_backend_class(parsed.scheme)(parsed)
