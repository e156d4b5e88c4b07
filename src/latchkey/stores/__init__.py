"""The table of stores: URL scheme → backend class, loaded on first use.

Third-party stores register under the ``latchkey.stores`` entry-point group with
``scheme = "module:Class"``; a built-in scheme cannot be overridden.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from latchkey._url import StoreURL
from latchkey.errors import ConfigError
from latchkey.stores.base import Backend, Capabilities, Waiter

__all__ = ["BUILTIN", "Backend", "Capabilities", "Waiter", "backend_class", "open_backend"]

# scheme: (module:class, the extra that installs its driver)
BUILTIN: dict[str, tuple[str, str | None]] = {
    "memory": ("latchkey.stores.memory:MemoryBackend", None),
    "sqlite": ("latchkey.stores.sqlite:SQLiteBackend", None),
    "postgresql": ("latchkey.stores.postgresql:PostgreSQLBackend", "postgresql"),
    "postgres": ("latchkey.stores.postgresql:PostgreSQLBackend", "postgresql"),
    "postgresql+advisory": ("latchkey.stores.pg_advisory:AdvisoryBackend", "postgresql"),
    "mysql": ("latchkey.stores.mysql:MySQLBackend", "mysql"),
    "mariadb": ("latchkey.stores.mysql:MySQLBackend", "mysql"),
    "mysql+getlock": ("latchkey.stores.mysql_getlock:GetLockBackend", "mysql"),
    "redis": ("latchkey.stores.redis:RedisBackend", "redis"),
    "rediss": ("latchkey.stores.redis:RedisBackend", "redis"),
    "memcached": ("latchkey.stores.memcached:MemcachedBackend", "memcached"),
    "mongodb": ("latchkey.stores.mongodb:MongoDBBackend", "mongodb"),
    "mongodb+srv": ("latchkey.stores.mongodb:MongoDBBackend", "mongodb"),
}


def _load(target: str, scheme: str, extra: str | None) -> type[Backend]:
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
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"{target} (store {scheme}://) is not a latchkey Backend")
    return cls


def backend_class(scheme: str) -> type[Backend]:
    """The backend class for ``scheme``, importing its module (and driver) on first use."""
    if scheme in BUILTIN:
        target, extra = BUILTIN[scheme]
        return _load(target, scheme, extra)
    for ep in entry_points(group="latchkey.stores"):
        if ep.name == scheme:
            return _load(ep.value, scheme, None)
    known = ", ".join(sorted(BUILTIN))
    raise ConfigError(f"unknown store URL scheme {scheme!r} (known: {known})")


def open_backend(url: str) -> Backend:
    """Parse ``url``, validate its options and create the backend (connecting lazily)."""
    parsed = StoreURL.parse(url)
    return backend_class(parsed.scheme)(parsed)
