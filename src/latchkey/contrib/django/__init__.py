"""Django: the store from settings or a ``DATABASES`` alias, system checks, and
``manage.py latchkey``.

Add ``"latchkey.contrib.django"`` to ``INSTALLED_APPS``, then one of::

    LATCHKEY_URL = "redis://cache:6379/0"           # any store URL
    LATCHKEY = {"URL": "redis://cache:6379/0"}      # the same
    LATCHKEY = {"DATABASE": "default", "OPTIONS": {"table": "app_locks"}}

With neither URL nor DATABASE, latchkey uses the ``LATCHKEY_URL`` environment variable, else
the ``default`` database. A database alias becomes a store URL built from its ENGINE, NAME,
HOST, PORT, USER and PASSWORD (PostgreSQL, MySQL/MariaDB, SQLite): latchkey opens its *own*
connection to that database, so a lock taken inside ``transaction.atomic()`` is seen by other
processes at once and is not undone by a rollback.

:func:`get_store` gives the sync :class:`~latchkey.Store`, one per process;
:func:`get_async_store` an :class:`~latchkey.AsyncStore` of the same settings, one per event
loop (close it with ``await close_async_store()`` before that loop ends).

.. versionadded:: 0.2
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from latchkey._async.store import AsyncStore, connect_async
from latchkey._store import Store, connect
from latchkey.errors import ConfigError

__all__ = [
    "close_async_store",
    "close_store",
    "database_url",
    "get_async_store",
    "get_store",
    "store_url",
]

#: Django database engines and the store scheme that speaks to the same server.
ENGINES = {
    "django.db.backends.postgresql": "postgresql",
    "django.contrib.gis.db.backends.postgis": "postgresql",
    "django.db.backends.mysql": "mysql",
    "django.contrib.gis.db.backends.mysql": "mysql",
    "django.db.backends.sqlite3": "sqlite",
    "django.contrib.gis.db.backends.spatialite": "sqlite",
}

#: PostgreSQL connection OPTIONS of Django's that are libpq parameters latchkey passes on.
PG_OPTIONS = ("sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword", "application_name")


def database_url(
    settings_dict: Mapping[str, Any], options: Mapping[str, Any] | None = None, alias: str = ""
) -> str:
    """The store URL for a Django database (one entry of ``DATABASES``), with the store
    ``options`` (``table``, ``timeout``…) in its query string.

    Raises :class:`~latchkey.ConfigError` for an engine latchkey has no store for, or a
    database latchkey cannot open a connection of its own to (in-memory SQLite).
    """
    what = f"database {alias!r}" if alias else "database"
    engine = str(settings_dict.get("ENGINE") or "")
    scheme = ENGINES.get(engine)
    if scheme is None:
        raise ConfigError(
            f"{what}: no latchkey store for ENGINE {engine!r} (PostgreSQL, MySQL/MariaDB and "
            "SQLite have one): set LATCHKEY_URL or LATCHKEY['URL'] instead"
        )
    name = str(settings_dict.get("NAME") or "")
    query = {k: str(v) for k, v in (options or {}).items()}
    if scheme == "sqlite":
        if not name or name == ":memory:" or "mode=memory" in name:
            raise ConfigError(
                f"{what}: an in-memory SQLite database cannot be shared with latchkey's own "
                "connection: give the database a file, or set LATCHKEY_URL"
            )
        path = Path(name.removeprefix("file:").split("?", 1)[0]).resolve()
        return f"sqlite:///{path}" + (f"?{urlencode(query)}" if query else "")
    host = str(settings_dict.get("HOST") or "")
    port = str(settings_dict.get("PORT") or "")
    if host.startswith("/") and scheme == "mysql":
        raise ConfigError(
            f"{what}: latchkey reaches MySQL over TCP only, not the socket {host!r}: set "
            "HOST to an address, or set LATCHKEY_URL"
        )
    userinfo = ""
    if user := settings_dict.get("USER"):
        userinfo = quote(str(user), safe="")
        if password := settings_dict.get("PASSWORD"):
            userinfo += ":" + quote(str(password), safe="")
        userinfo += "@"
    netloc = quote(host, safe="") + (f":{port}" if port else "")
    if scheme == "postgresql":
        extra = settings_dict.get("OPTIONS") or {}
        query = {**{k: str(extra[k]) for k in PG_OPTIONS if k in extra}, **query}
    url = f"{scheme}://{userinfo}{netloc}/{quote(name, safe='')}"
    return url + (f"?{urlencode(query)}" if query else "")


def store_url() -> str:
    """The store URL the settings give (see the module): ``LATCHKEY["URL"]`` or
    ``LATCHKEY_URL``; else ``LATCHKEY["DATABASE"]``; else the ``LATCHKEY_URL`` environment
    variable; else the ``default`` database. A database is read from its live connection
    settings, so under Django's test runner it is the test database."""
    from django.conf import settings
    from django.db import connections

    config = getattr(settings, "LATCHKEY", None) or {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"settings.LATCHKEY must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - {"URL", "DATABASE", "OPTIONS"})
    if unknown:
        raise ConfigError(f"settings.LATCHKEY: unknown keys {unknown} (URL, DATABASE, OPTIONS)")
    url = config.get("URL") or getattr(settings, "LATCHKEY_URL", None)
    if url:
        if not isinstance(url, str):
            raise ConfigError(f"the latchkey store URL must be a str, got {type(url).__name__}")
        return url
    alias = config.get("DATABASE")
    if not alias and (env := os.environ.get("LATCHKEY_URL")):
        return env
    alias = alias or "default"
    if alias not in settings.DATABASES:
        raise ConfigError(
            f"settings.LATCHKEY['DATABASE'] is {alias!r}, which is not in DATABASES "
            f"({sorted(settings.DATABASES)})"
        )
    options = config.get("OPTIONS") or {}
    return database_url(connections[alias].settings_dict, options, alias)


_lock = threading.Lock()
_cached: tuple[str, Store] | None = None


def get_store() -> Store:
    """The store of the settings, opened on first use and shared by the process (it is
    thread-safe). Opened again if the settings now give another URL (``override_settings``,
    the test database)."""
    global _cached
    url = store_url()
    with _lock:
        if _cached is not None and _cached[0] == url:
            return _cached[1]
        old, _cached = _cached, (url, connect(url))
        store = _cached[1]
    if old is not None:
        old[1].close()
    return store


def close_store(**_: Any) -> None:
    """Close the store :func:`get_store` opened (it opens again on next use). Connected to
    Django's ``setting_changed`` for the LATCHKEY settings and DATABASES."""
    global _cached
    with _lock:
        old, _cached = _cached, None
    if old is not None:
        old[1].close()


#: The asyncio stores, one per event loop (an AsyncStore's connections belong to one loop).
_async_stores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[str, AsyncStore]] = (
    weakref.WeakKeyDictionary()
)
#: Closes of replaced asyncio stores still running (a task must be referenced until done).
_closing: set[asyncio.Task[None]] = set()


def get_async_store() -> AsyncStore:
    """The :class:`~latchkey.AsyncStore` of the settings (the same URL as :func:`get_store`)
    for the running event loop: opened on first use in each loop and shared by its
    coroutines. If the settings now give another URL, a new one is opened and the old one
    closed in a task of the loop.

    Its connections belong to the loop: close it with ``await close_async_store()`` before
    the loop ends (an ASGI server's lifespan shutdown, the end of ``asyncio.run``'s main).
    Where every call gets a loop of its own (async views under WSGI, ``async_to_sync``), use
    :func:`get_store`, or ``async with latchkey.connect_async(store_url())`` per call.

    Raises :class:`~latchkey.ConfigError` outside a running event loop.

    .. versionadded:: 0.2
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigError(
            "get_async_store() needs a running event loop (call it from a coroutine); "
            "use get_store() in sync code"
        ) from None
    url = store_url()
    cached = _async_stores.get(loop)
    if cached is not None and cached[0] == url:
        return cached[1]
    store = connect_async(url)
    _async_stores[loop] = (url, store)
    if cached is not None:
        task = loop.create_task(cached[1].aclose())
        _closing.add(task)
        task.add_done_callback(_closing.discard)
    return store


async def close_async_store() -> None:
    """Close the running loop's store that :func:`get_async_store` opened (it opens again on
    next use), and wait for the closes of stores it replaced.

    .. versionadded:: 0.2
    """
    cached = _async_stores.pop(asyncio.get_running_loop(), None)
    if cached is not None:
        await cached[1].aclose()
    mine = [t for t in _closing if t.get_loop() is asyncio.get_running_loop()]
    if mine:
        await asyncio.gather(*mine, return_exceptions=True)
