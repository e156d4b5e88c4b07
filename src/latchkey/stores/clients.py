"""Bring your own client: which store a client the application already holds belongs to.

``latchkey.connect(client=…)`` and ``connect_async(client=…)`` look the client's class up in
:data:`KINDS` by its qualified name along its MRO (so a subclass is recognised too, and no
driver is imported to tell: a client of a library means the library is loaded already). The
kind gives the store's URL scheme, whether the client is a sync or an asyncio one, and how to
read where it points (host, port, user, database) into a :class:`~latchkey._url.StoreURL`
that the store reads like a parsed URL. Its ``raw`` text, the one shown in ``repr(store)``,
``store.url`` and every error, is made here with the password replaced by ``***``; the
password itself rides in ``StoreURL.password`` only so that error texts are scrubbed of it.

The store's backend keeps the client (``backend.client``); its driver borrows from it and
never closes it (each driver's docstring says how it borrows).

``locks=`` picks the kind of lock a PostgreSQL or MySQL/MariaDB client gives
(:func:`locks_scheme`): ``"lease"`` (the default: the lease table, ``postgresql://`` /
``mysql://``) or ``"session"`` (the server's session locks, ``postgresql+advisory://`` /
``mysql+getlock://``). A keyword rather than a scheme because the client already names the
database: the same word then means the same choice for both, and it reads as what it changes
(what a lock is tied to: a lease row with a TTL and a fencing token, or a connection). The
session locks hold a connection per lock for the lock's life, so they need a client that
lends connections — a pool or an engine (:attr:`ClientKind.lends`); a single connection is
a ConfigError naming what to pass instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any
from urllib.parse import quote, urlencode

from latchkey._url import StoreURL, _secret
from latchkey.errors import ConfigError

__all__ = [
    "KINDS",
    "ClientKind",
    "Endpoint",
    "client_url",
    "identify",
    "locks_scheme",
    "option_text",
    "sentinel_db",
    "service_path",
    "tells_database",
]


@dataclass(frozen=True)
class Endpoint:
    """Where a client points, as far as it says."""

    host: str | None = None
    port: int | None = None
    username: str | None = None
    password: str | None = None
    path: str = ""
    #: Every node, where the client knows several (a cluster's startup nodes).
    nodes: tuple[tuple[str, int | None], ...] = ()


@dataclass(frozen=True)
class ClientKind:
    """One accepted client class: ``qualname`` (module and class, as in its MRO), the name
    shown to users, the store scheme (or a function of the client that picks it), whether it
    is an asyncio client, and how to read its :class:`Endpoint`. ``service``: the client
    serves several masters by name (a Sentinel), so ``connect()`` takes ``service=`` too."""

    qualname: str
    shown: str
    scheme: str | Callable[[Any], str]
    asyncio: bool
    endpoint: Callable[[Any], Endpoint]
    #: Whether :attr:`endpoint` can tell the database (False: the client's connection
    #: arguments are not public; the store finds out from the server at its first call).
    tells_database: bool = True
    service: bool = False
    #: A pool or an engine: it lends connections that latchkey may keep for a while (what
    #: the session locks need: ``locks="session"``).
    lends: bool = False


def _redis(client: Any) -> Endpoint:
    kwargs = client.connection_pool.connection_kwargs
    return Endpoint(
        kwargs.get("host", "localhost"),
        kwargs.get("port", 6379),
        kwargs.get("username"),
        kwargs.get("password"),
        f"/{kwargs.get('db', 0)}",
    )


def _redis_scheme(client: Any) -> str:
    ssl = "SSL" in client.connection_pool.connection_class.__name__
    return "rediss" if ssl else "redis"


def _redis_cluster(client: Any) -> Endpoint:
    manager = client.nodes_manager
    kwargs = manager.connection_kwargs
    nodes = tuple((n.host, n.port) for n in manager.startup_nodes.values())
    first = nodes[0] if nodes else (None, None)
    user, password = kwargs.get("username"), kwargs.get("password")
    return Endpoint(first[0], first[1], user, password, "", nodes)


def _redis_cluster_scheme(client: Any) -> str:
    """``rediss+cluster`` for a cluster client whose node connections use TLS (sync: ``ssl``;
    asyncio: an SSLConnection class): the store follows its TLS settings
    (:func:`latchkey.stores.io.redis_cluster.borrowed_tls`)."""
    kwargs = client.nodes_manager.connection_kwargs
    ssl = kwargs.get("ssl") or "SSL" in getattr(kwargs.get("connection_class"), "__name__", "")
    return "rediss+cluster" if ssl else "redis+cluster"


def _sentinel_scheme(client: Any) -> str:
    """``rediss+sentinel`` for a Sentinel whose master connections use TLS (``ssl=True``):
    the store follows its settings, TLS ones too (:mod:`latchkey.stores.io.redis_sentinel`)."""
    return "rediss+sentinel" if client.connection_kwargs.get("ssl") else "redis+sentinel"


def _sentinel(client: Any) -> Endpoint:
    """A redis-py Sentinel (sync or asyncio): its sentinels, and the master connections' AUTH."""
    nodes = tuple(
        (
            str(sentinel.connection_pool.connection_kwargs.get("host", "localhost")),
            int(sentinel.connection_pool.connection_kwargs.get("port", 26379)),
        )
        for sentinel in client.sentinels
    )
    if not nodes:
        raise ConfigError(f"latchkey cannot use a {_qualnames(client)[0]} without sentinels")
    kwargs = client.connection_kwargs
    return Endpoint(
        nodes[0][0], nodes[0][1], kwargs.get("username"), kwargs.get("password"), nodes=nodes
    )


def sentinel_db(client: Any) -> int:
    """The database a Sentinel's master connections use (``Sentinel(…, db=2)``; 0)."""
    return int(client.connection_kwargs.get("db") or 0)


def _libpq(params: Mapping[str, Any]) -> Endpoint:
    host = str(params.get("host") or "") or None
    port = str(params.get("port") or "")
    return Endpoint(
        host.split(",")[0] if host else None,
        int(port.split(",")[0]) if port.split(",")[0].isdigit() else None,
        params.get("user"),
        params.get("password"),
        f"/{params['dbname']}" if params.get("dbname") else "",
    )


def _psycopg_pool(pool: Any) -> Endpoint:
    from psycopg.conninfo import conninfo_to_dict

    return _libpq(conninfo_to_dict(pool.conninfo, **(pool.kwargs or {})))


def _psycopg_connection(conn: Any) -> Endpoint:
    info = conn.info
    return _libpq(
        {"host": info.host, "port": info.port, "user": info.user,
         "password": info.password, "dbname": info.dbname}
    )  # fmt: skip


#: SQLAlchemy dialect+driver → the store over the engine's DB-API connections.
ENGINE_STORES = {
    ("postgresql", "psycopg"): "postgresql",
    ("mysql", "pymysql"): "mysql",
    ("mariadb", "pymysql"): "mysql",
    ("sqlite", "pysqlite"): "sqlite",
}
#: The same for an AsyncEngine (its driver's asyncio connections).
ASYNC_ENGINE_STORES = {
    ("postgresql", "psycopg"): "postgresql",
    ("mysql", "asyncmy"): "mysql",
    ("mysql", "aiomysql"): "mysql",
    ("mariadb", "asyncmy"): "mysql",
    ("mariadb", "aiomysql"): "mysql",
}


def _engine_scheme(engine: Any) -> str:
    dialect = (engine.dialect.name, engine.dialect.driver)
    stores = ASYNC_ENGINE_STORES if hasattr(engine, "sync_engine") else ENGINE_STORES
    scheme = stores.get(dialect)
    if scheme is None:
        shown = "AsyncEngine" if stores is ASYNC_ENGINE_STORES else "engine"
        accepted = ", ".join(f"{n}+{d}" for n, d in stores)
        raise ConfigError(
            f"latchkey cannot use a SQLAlchemy {shown} of {dialect[0]}+{dialect[1]}; "
            f"accepted: {accepted}"
        )
    return scheme


def _sqlite_engine(engine: Any) -> Endpoint:
    """An engine over a SQLite file: the file (latchkey opens its own connections to it)."""
    url = engine.url
    path = url.database or ""
    if path in ("", ":memory:") or url.query.get("uri") or path.startswith("file:"):
        raise ConfigError(
            f"latchkey cannot use a SQLAlchemy engine of sqlite database {path or '(memory)'!r}"
            ": it opens its own connections to the engine's file, so it needs a plain file path"
            " (sqlite:///relative.db or sqlite:////absolute/path.db; no in-memory database, no"
            " URI filename)"
        )
    return Endpoint(path=f"/{path}")


def _engine(engine: Any) -> Endpoint:
    if engine.dialect.name == "sqlite":
        return _sqlite_engine(engine)
    url = engine.url
    path = f"/{url.database}" if url.database else ""
    return Endpoint(url.host, url.port, url.username, url.password, path)


def _mongo_root(client: Any) -> Any:
    """The MongoClient / AsyncMongoClient behind a client or a Database (a client's
    ``__getattr__`` would take ``client.client`` for a database named "client")."""
    databases = {"pymongo.synchronous.database.Database",
                 "pymongo.asynchronous.database.AsyncDatabase"}  # fmt: skip
    return client.client if databases.intersection(_qualnames(client)) else client


def mongo_database(client: Any) -> str:
    """The database a borrowed pymongo client stands for: a Database's own; a client's
    default database (the path of the URI it was made from), else latchkey's default."""
    if _mongo_root(client) is not client:
        return str(client.name)
    return str(client.get_default_database(default="latchkey").name)


def _mongo(client: Any) -> Endpoint:
    root = _mongo_root(client)
    seeds = sorted(root.topology_description.server_descriptions())
    credentials = getattr(root.options.pool_options, "_credentials", None)
    user = getattr(credentials, "username", None)
    password = getattr(credentials, "password", None)
    first = seeds[0] if seeds else (None, None)
    path = f"/{mongo_database(client)}"
    return Endpoint(first[0], first[1], user, password, path, tuple(seeds))


def _memcache(client: Any) -> Endpoint:
    """The servers of a pymemcache Client / PooledClient, or every server of a HashClient
    (latchkey places its keys over them by its own rendezvous hash; see the memcached store).
    A server latchkey cannot reach the way the client does is a ConfigError."""
    shown = _qualnames(client)[0]
    members = list(client.clients.values()) if hasattr(client, "clients") else [client]
    nodes: list[tuple[str, int | None]] = []
    for member in members:
        if getattr(member, "tls_context", None) is not None:
            raise ConfigError(
                f"latchkey cannot use a {shown} with a tls_context: latchkey's memcached store "
                "speaks plain TCP; give it a client without TLS or a memcached:// URL"
            )
        server = member.server
        if not isinstance(server, tuple):
            raise ConfigError(
                f"latchkey cannot use a {shown} of the UNIX socket {server!r}: latchkey's "
                "memcached store connects over TCP (host, port)"
            )
        nodes.append((str(server[0]), int(server[1])))
    if not nodes:
        raise ConfigError(f"latchkey cannot use a {shown} without servers")
    return Endpoint(nodes[0][0], nodes[0][1], nodes=tuple(nodes))


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("latin1")  # (PyMySQL keeps the password as latin-1 bytes)
    return None if value is None else str(value)


def _pymysql(conn: Any) -> Endpoint:
    db = _text(conn.db)
    path = f"/{db}" if db else ""
    return Endpoint(conn.host, conn.port, _text(conn.user), _text(conn.password) or None, path)


def _aiomysql(conn: Any) -> Endpoint:
    """An aiomysql connection: PyMySQL's attributes, but the password (not public there; it
    is never shown anyway)."""
    db = _text(conn.db)
    return Endpoint(conn.host, conn.port, _text(conn.user), None, f"/{db}" if db else "")


def _asyncmy(conn: Any) -> Endpoint:
    """An asyncmy connection tells where it is connected (``get_host_info()``: "socket
    host:port") and nothing else publicly: no user, no database (the store finds out at its
    first call whether there is one)."""
    host, sep, port = str(conn.get_host_info()).removeprefix("socket ").rpartition(":")
    if not sep or not port.isdigit() or " " in host:  # not connected, or a UNIX socket
        return Endpoint()
    return Endpoint(host.strip("[]"), int(port))


def _nowhere(pool: Any) -> Endpoint:
    """An asyncmy or aiomysql pool: its connection arguments are not public."""
    return Endpoint()


KINDS: list[ClientKind] = [
    ClientKind("redis.client.Redis", "redis.Redis", _redis_scheme, False, _redis),
    ClientKind("redis.asyncio.client.Redis", "redis.asyncio.Redis", _redis_scheme, True, _redis),
    ClientKind(
        "redis.cluster.RedisCluster", "redis.cluster.RedisCluster", _redis_cluster_scheme,
        False, _redis_cluster,
    ),
    ClientKind(
        "redis.asyncio.cluster.RedisCluster", "redis.asyncio.cluster.RedisCluster",
        _redis_cluster_scheme, True, _redis_cluster,
    ),
    ClientKind(
        "redis.sentinel.Sentinel", "redis.sentinel.Sentinel (with service=…)", _sentinel_scheme,
        False, _sentinel, service=True,
    ),
    ClientKind(
        "redis.asyncio.sentinel.Sentinel", "redis.asyncio.sentinel.Sentinel (with service=…)",
        _sentinel_scheme, True, _sentinel, service=True,
    ),
    ClientKind(
        "psycopg_pool.pool.ConnectionPool", "psycopg_pool.ConnectionPool", "postgresql", False,
        _psycopg_pool, lends=True,
    ),
    ClientKind("psycopg.Connection", "psycopg.Connection", "postgresql", False,
               _psycopg_connection),
    ClientKind(
        "psycopg_pool.pool_async.AsyncConnectionPool", "psycopg_pool.AsyncConnectionPool",
        "postgresql", True, _psycopg_pool, lends=True,
    ),
    ClientKind("psycopg.AsyncConnection", "psycopg.AsyncConnection", "postgresql", True,
               _psycopg_connection),
    ClientKind("sqlalchemy.engine.base.Engine",
               "sqlalchemy.Engine (postgresql+psycopg, mysql+pymysql, mariadb+pymysql, "
               "sqlite+pysqlite)",
               _engine_scheme, False, _engine, lends=True),
    ClientKind("sqlalchemy.ext.asyncio.engine.AsyncEngine",
               "sqlalchemy.ext.asyncio.AsyncEngine (postgresql+psycopg, mysql+asyncmy, "
               "mysql+aiomysql, mariadb+asyncmy, mariadb+aiomysql)", _engine_scheme, True,
               _engine, lends=True),
    ClientKind("pymongo.synchronous.mongo_client.MongoClient", "pymongo.MongoClient", "mongodb",
               False, _mongo),
    ClientKind("pymongo.synchronous.database.Database", "pymongo.database.Database", "mongodb",
               False, _mongo),
    ClientKind("pymongo.asynchronous.mongo_client.AsyncMongoClient", "pymongo.AsyncMongoClient",
               "mongodb", True, _mongo),
    ClientKind("pymongo.asynchronous.database.AsyncDatabase",
               "pymongo.asynchronous.database.AsyncDatabase", "mongodb", True, _mongo),
    ClientKind("pymysql.connections.Connection", "pymysql.connections.Connection", "mysql",
               False, _pymysql),
    ClientKind("asyncmy.connection.Connection", "asyncmy.Connection", "mysql", True, _asyncmy,
               tells_database=False),
    ClientKind("asyncmy.pool.Pool", "asyncmy.Pool", "mysql", True, _nowhere,
               tells_database=False, lends=True),
    ClientKind("aiomysql.connection.Connection", "aiomysql.Connection", "mysql", True,
               _aiomysql),
    ClientKind("aiomysql.pool.Pool", "aiomysql.Pool", "mysql", True, _nowhere,
               tells_database=False, lends=True),
    ClientKind("pymemcache.client.base.Client", "pymemcache.Client", "memcached", False,
               _memcache),
    ClientKind("pymemcache.client.base.PooledClient", "pymemcache.PooledClient", "memcached",
               False, _memcache),
    ClientKind("pymemcache.client.hash.HashClient", "pymemcache.HashClient", "memcached", False,
               _memcache),
]  # fmt: skip


def _qualnames(client: Any) -> list[str]:
    return [f"{k.__module__}.{k.__qualname__}" for k in type(client).__mro__]


def identify(client: Any, *, asyncio: bool) -> ClientKind:
    """The kind of ``client`` for :func:`latchkey.connect` (``asyncio`` False) or
    :func:`latchkey.connect_async` (True); ConfigError naming the client's type and what is
    accepted if it is of neither mode's kinds, or of the other mode's."""
    names = _qualnames(client)
    shown = names[0]
    for kind in KINDS:
        if kind.qualname in names:
            if kind.asyncio == asyncio:
                return kind
            if kind.asyncio:
                raise ConfigError(
                    f"latchkey.connect(client=…) got a {shown}, an asyncio client: pass it to "
                    "latchkey.connect_async(client=…), or give connect() a sync client "
                    f"({_accepted(asyncio)})"
                )
            raise ConfigError(
                f"latchkey.connect_async(client=…) got a {shown}, a sync client: pass it to "
                "latchkey.connect(client=…), or give connect_async() an asyncio client "
                f"({_accepted(asyncio)})"
            )
    call = "connect_async" if asyncio else "connect"
    raise ConfigError(
        f"latchkey.{call}(client=…) cannot use a {shown}; accepted: {_accepted(asyncio)}"
    )


def tells_database(client: Any) -> bool:
    """Whether the database of ``client`` shows in its store URL's path (an empty path then
    means the client names none)."""
    names = _qualnames(client)
    return all(kind.tells_database for kind in KINDS if kind.qualname in names)


def _accepted(asyncio: bool) -> str:
    return ", ".join(k.shown for k in KINDS if k.asyncio == asyncio)


def option_text(name: str, value: Any) -> str:
    """A keyword option as the URL query would carry it (so one parser validates both)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, timedelta):
        return f"{value.total_seconds()!r}s"
    raise ConfigError(f"option {name}: expected text, a number, a bool or a timedelta, got "
                      f"{type(value).__name__}")  # fmt: skip


def _hostport(host: str, port: int | None) -> str:
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port else host


def service_path(client: Any, kind: ClientKind, service: Any, asyncio: bool) -> str | None:
    """The URL path of a client that serves masters by name (``/service``), None for another
    client; ConfigError if a Sentinel comes without ``service=``, or another client with it."""
    call = "connect_async" if asyncio else "connect"
    shown = _qualnames(client)[0]
    if not kind.service:
        if service is not None:
            raise ConfigError(
                f"latchkey.{call}(client=…, service=…): service is the name of the master a "
                f"redis.sentinel.Sentinel watches; a {shown} has none (leave service out)"
            )
        return None
    if service is None:
        raise ConfigError(
            f"latchkey.{call}(client=…) got a {shown}: give service='…' too, the name of the "
            "master its sentinels watch (as in `sentinel monitor <name> …`)"
        )
    if not isinstance(service, str) or not service or "/" in service or not service.isprintable():
        raise ConfigError(
            f"latchkey.{call}(client=…): service must be a master's name (text without /), "
            f"got {service!r}"
        )
    return f"/{service}"


#: The lock kinds of ``locks=`` and the store each gives: the lease table's scheme → the
#: session locks' scheme.
SESSION_SCHEMES = {"postgresql": "postgresql+advisory", "mysql": "mysql+getlock"}
LOCKS = ("lease", "session")
#: What to pass instead of a single connection, for the session locks.
LENDERS = {
    "postgresql": {
        False: "a psycopg_pool.ConnectionPool or a SQLAlchemy Engine (postgresql+psycopg)",
        True: "a psycopg_pool.AsyncConnectionPool or a SQLAlchemy AsyncEngine "
        "(postgresql+psycopg)",
    },
    "mysql": {
        False: "a SQLAlchemy Engine (mysql+pymysql or mariadb+pymysql)",
        True: "an asyncmy.Pool, an aiomysql.Pool or a SQLAlchemy AsyncEngine (mysql+asyncmy, "
        "mysql+aiomysql)",
    },
}


def locks_scheme(client: Any, kind: ClientKind, locks: Any, asyncio: bool) -> str:
    """The store scheme of ``client`` for ``locks`` (None or "lease": the client's own store;
    "session": its database's session locks); ConfigError for another value, for a client
    whose database has no session locks, and for a single connection (which cannot hold a
    connection per lock), naming what to pass instead."""
    scheme = kind.scheme if isinstance(kind.scheme, str) else kind.scheme(client)
    if locks is None or locks == "lease":
        return scheme
    call = "connect_async" if asyncio else "connect"
    if locks != "session":
        raise ConfigError(
            f"latchkey.{call}(client=…, locks=…): locks must be 'lease' (a lease table: TTL, "
            f"fencing tokens) or 'session' (the server's session locks), got {locks!r}"
        )
    shown = _qualnames(client)[0]
    if scheme not in SESSION_SCHEMES:
        raise ConfigError(
            f"latchkey.{call}(client=…, locks='session'): session locks are PostgreSQL's "
            f"advisory locks and MySQL/MariaDB's GET_LOCK; a {shown} gives the {scheme} store "
            "(leave locks out)"
        )
    if not kind.lends:
        raise ConfigError(
            f"latchkey.{call}(client=…, locks='session') got a {shown}, a single connection: "
            "a session lock lives on the connection that took it, so the store keeps a "
            "connection per lock held and needs a pool to take them from; pass "
            f"{LENDERS[scheme][asyncio]} instead"
        )
    return SESSION_SCHEMES[scheme]


def client_url(
    client: Any,
    kind: ClientKind,
    options: Mapping[str, str],
    path: str | None = None,
    scheme: str | None = None,
) -> StoreURL:
    """The StoreURL a store reads for ``client``: its endpoint and the options, shown with the
    password masked; ``path`` (a Sentinel's service, see :func:`service_path`) replaces the
    endpoint's; ``scheme`` (see :func:`locks_scheme`) the client's own store's."""
    if scheme is None:
        scheme = kind.scheme if isinstance(kind.scheme, str) else kind.scheme(client)
    try:  # (the scheme's ConfigError, above, is the caller's)
        point = kind.endpoint(client)
    except ConfigError:  # a client of an accepted type that latchkey cannot use: says why
        raise
    except Exception:  # an unusual client that does not say: shown without an address
        point = Endpoint()
    if path is not None:
        point = replace(point, path=path)
    userinfo = ""
    if point.username or point.password:
        userinfo = quote(point.username or "", safe="")
        userinfo += ":***@" if point.password else "@"
    hosts = point.nodes or (((point.host, point.port),) if point.host else ())
    hostport = ",".join(_hostport(host, port) for host, port in hosts)
    shown = {k: ("***" if _secret(k) else v) for k, v in options.items()}
    query = f"?{urlencode(shown)}" if shown else ""
    raw = f"{scheme}://{userinfo}{hostport}{point.path}{query} (client {_qualnames(client)[0]})"
    return StoreURL(scheme, point.username, point.password, hosts, point.path, options, raw)
