"""The table of stores: URL scheme → backend classes (sync and asyncio), loaded on first use.

Third-party stores register under the ``latchkey.stores`` entry-point group (sync) and the
``latchkey.async_stores`` group (asyncio) with ``scheme = "module:Class"``; a built-in scheme
cannot be overridden.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import replace
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
    "open_client_backend",
]


def _store(
    module: str, sync: str, asyncio: str | None, extra: str | None
) -> tuple[str, str | None, str | None]:
    """A registry row: the sync class in ``latchkey.stores.<module>``, the asyncio class in
    the same module (``asyncio`` given as ``":Class"``, a store written once on the shared
    I/O layer) or in ``latchkey.stores.<module>_async``, the extra that installs the driver."""
    base = f"latchkey.stores.{module}"
    if asyncio and asyncio.startswith(":"):
        return f"{base}:{sync}", f"{base}{asyncio}", extra
    return f"{base}:{sync}", (f"{base}_async:{asyncio}" if asyncio else None), extra


# scheme: (sync module:class, asyncio module:class or None, the extra that installs its driver)
BUILTIN: dict[str, tuple[str, str | None, str | None]] = {
    "memory": _store("memory", "MemoryBackend", "AsyncMemoryBackend", None),
    "sqlite": _store("sqlite", "SQLiteBackend", ":AsyncSQLiteBackend", None),
    "postgresql": _store(
        "postgresql", "PostgreSQLBackend", ":AsyncPostgreSQLBackend", "postgresql"
    ),
    "postgres": _store("postgresql", "PostgreSQLBackend", ":AsyncPostgreSQLBackend", "postgresql"),
    "postgresql+advisory": _store(
        "pg_advisory", "AdvisoryBackend", ":AsyncAdvisoryBackend", "postgresql"
    ),
    "mysql": _store("mysql", "MySQLBackend", ":AsyncMySQLBackend", "mysql"),
    "mariadb": _store("mysql", "MySQLBackend", ":AsyncMySQLBackend", "mysql"),
    "mysql+getlock": _store("mysql_getlock", "GetLockBackend", ":AsyncGetLockBackend", "mysql"),
    "redis": _store("redis", "RedisBackend", ":AsyncRedisBackend", "redis"),
    "rediss": _store("redis", "RedisBackend", ":AsyncRedisBackend", "redis"),
    "redis+cluster": _store(
        "redis_cluster", "RedisClusterBackend", ":AsyncRedisClusterBackend", "redis"
    ),
    "rediss+cluster": _store(
        "redis_cluster", "RedisClusterBackend", ":AsyncRedisClusterBackend", "redis"
    ),
    "redis+sentinel": _store(
        "redis_cluster", "RedisSentinelBackend", ":AsyncRedisSentinelBackend", "redis"
    ),
    "rediss+sentinel": _store(
        "redis_cluster", "RedisSentinelBackend", ":AsyncRedisSentinelBackend", "redis"
    ),
    "memcached": _store("memcached", "MemcachedBackend", ":AsyncMemcachedBackend", "memcached"),
    "mongodb": _store("mongodb", "MongoDBBackend", ":AsyncMongoDBBackend", "mongodb"),
    "mongodb+srv": _store("mongodb", "MongoDBBackend", ":AsyncMongoDBBackend", "mongodb"),
    "etcd": _store("etcd", "EtcdBackend", ":AsyncEtcdBackend", "etcd"),
    "zookeeper": _store("zookeeper", "ZooKeeperBackend", ":AsyncZooKeeperBackend", "zookeeper"),
}


def _load(target: str, scheme: str, extra: str | None, base: type) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        store = getattr(getattr(module, attr, None), "store_class", None)
        if store is not None:  # a store written once: its driver is a module of its own
            driver = store.async_driver if base is AsyncBackend else store.sync_driver
            importlib.import_module(driver.partition(":")[0])
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


def _with_options(parsed: StoreURL, options: Mapping[str, Any]) -> StoreURL:
    """``parsed`` with keyword options added to its query (each given once: ConfigError if a
    keyword repeats an option of the URL's query)."""
    if not options:
        return parsed
    from latchkey.stores.clients import option_text

    query = dict(parsed.query)
    for key, value in options.items():
        if key in query:
            raise ConfigError(f"store option {key!r} is given twice (in the URL and as a keyword)")
        query[key] = option_text(key, value)
    return replace(parsed, query=query)


def _no_client_keywords(options: Mapping[str, Any]) -> None:
    """``locks=`` chooses among a client's stores; a URL's scheme says it already."""
    if "locks" in options:
        raise ConfigError(
            "locks= chooses the store of a client (connect(client=…, locks='session')); with "
            "a URL the scheme chooses: postgresql+advisory:// or mysql+getlock:// for session "
            "locks"
        )


def open_backend(url: str, options: Mapping[str, Any] | None = None) -> Backend:
    """Parse ``url``, validate its options (and the keyword ``options``) and create the sync
    backend (connecting lazily)."""
    _no_client_keywords(options or {})
    parsed = _with_options(StoreURL.parse(url), options or {})
    return backend_class(parsed.scheme)(parsed)


def open_async_backend(url: str, options: Mapping[str, Any] | None = None) -> AsyncBackend:
    """Parse ``url``, validate its options and create the asyncio backend (connecting on first
    use)."""
    _no_client_keywords(options or {})
    parsed = _with_options(StoreURL.parse(url), options or {})
    return async_backend_class(parsed.scheme)(parsed)


def open_client_backend(
    client: Any, options: Mapping[str, Any] | None = None, *, asyncio: bool = False
) -> Any:
    """The backend (asyncio if ``asyncio``) of the store ``client`` belongs to, borrowing
    from it (see :mod:`latchkey.stores.clients`); ``options`` as the URL query would give them,
    but ``service`` (a Sentinel's master name), which becomes the URL's path, and ``locks``
    ("lease" or "session"), which chooses the store of a PostgreSQL or MySQL client.
    """
    from latchkey.stores.clients import (
        client_url,
        identify,
        locks_scheme,
        option_text,
        sentinel_db,
        service_path,
    )

    kind = identify(client, asyncio=asyncio)
    options = dict(options or {})
    path = service_path(client, kind, options.pop("service", None), asyncio)
    scheme = locks_scheme(client, kind, options.pop("locks", None), asyncio)
    if kind.service and "db" not in options and sentinel_db(client):
        options["db"] = sentinel_db(client)  # the Sentinel's own, unless told otherwise
    query = {key: option_text(key, value) for key, value in options.items()}
    url = client_url(client, kind, query, path, scheme)
    cls = async_backend_class(url.scheme) if asyncio else backend_class(url.scheme)
    return cls(url, client)
