"""MongoDB through PyMongo's sync client (``MongoClient``): the driver of ``mongodb://``.

PyMongo already does what the I/O layer does for the other drivers — a connection pool,
server monitoring, fork warnings, a timeout on server selection, connect and every socket
read (all set from the URL's ``timeout``) — so this driver is small: it turns each request of
the store (:class:`Call`, :class:`Scan`) into a method call on a collection, and maps
``PyMongoError`` to StoreUnavailable (through :class:`~latchkey.stores.io.Driver`). Errors
the store gives a meaning to (``DuplicateKeyError``, ``BulkWriteError``) are thrown into its
generator first. The asyncio twin is :mod:`latchkey.stores.io.pymongo_async`.

A borrowed client (``latchkey.connect(client=MongoClient(…))`` or a ``Database``): its pool,
monitoring, AUTH and TLS are used as they are — latchkey opens no client of its own and never
closes the application's. What latchkey's own client is given at creation is set where it can
be without touching the application's: the collections and the admin database latchkey uses
are taken with their own codec options (``tz_aware``, UTC), read preference (primary) and
write concern (``majority``, as latchkey's URL default) — see :func:`borrowed_targets`.

Every primitive, over latchkey's own client or a borrowed one, runs inside one
``pymongo.timeout(store timeout)`` (client-side operation timeout, :meth:`MongoDriver.run`):
one deadline for all its requests — an acquire's index set-up on first use, a claim's bulk
write and its read, a purge's read and delete — each server selection, connection checkout,
connect and operation, and pymongo's retry of a write. With the per-step timeouts alone, a
release took up to two timeouts in a chaos run with server restarts (3.6 to 4.6 s against
2 s, the likely cause being pymongo's retry of the write through a new server selection); with
one ``pymongo.timeout`` per request, a primitive of two requests whose round trips were each
within the timeout took longer than it in all (``tests/contract/test_mongodb_specific.py``).
The client's own timeouts and retry settings apply within that bound. Known slack, pymongo's
(4.20): server selection looks at the deadline between waits of up to half a second
(``MIN_HEARTBEAT_INTERVAL``), so a call that ends there may end up to 0.5 s past it; and a
new connection's handshake (``hello``, authentication) is not a client command, so the
deadline does not reach it: its socket keeps ``socketTimeoutMS`` (the store timeout), and a
connection opened just before the deadline can hold a call up to that much longer.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import timezone
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar
from urllib.parse import quote_plus

import pymongo
from bson.codec_options import CodecOptions
from pymongo import MongoClient, ReadPreference, WriteConcern, uri_parser
from pymongo.errors import BulkWriteError, ConfigurationError, PyMongoError

from latchkey._url import DriverOptions, StoreURL
from latchkey.errors import ConfigError
from latchkey.stores.io import Driver, Steps

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

Document = dict[str, Any]
T = TypeVar("T")
DUPLICATE_KEY = 11000
_DATABASE = re.compile(r"^[A-Za-z0-9_-]{1,63}$")

#: MongoDB connection-string options passed through to pymongo as given.
#: Client settings the store's code depends on: not to be changed from the URL.
OURS = frozenset({"connect", "tz_aware", "datetime_conversion", "uuidrepresentation"})


def pymongo_option(key: str, text: str) -> str:
    """A ``DriverOptions.check`` by pymongo's own URI parser (``uri_parser.parse_uri``): any
    URI option it knows (``serverSelectionTimeoutMS``, ``readPreference``…) with a value it
    accepts."""
    if key.lower() in OURS:
        raise KeyError(key)
    try:
        uri_parser.parse_uri(f"mongodb://localhost/?{key}={quote_plus(text, safe=':,/')}",
                             warn=False)  # fmt: skip
    except ConfigurationError as exc:
        if "unknown option" in str(exc).lower():
            raise KeyError(key) from None
        raise ValueError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    return text


#: Any other MongoDB connection-string option goes to pymongo as given.
PYMONGO = DriverOptions(
    pymongo_option,
    "any MongoDB connection-string option pymongo knows "
    "(https://www.mongodb.com/docs/manual/reference/connection-string-options/)",
)


class Call(NamedTuple):
    """``<target>.<method>(*args, **kwargs)``; target: ``"locks"``, ``"records"`` or
    ``"admin"`` (the admin database). ``grants``: the call may grant leases (see the asyncio
    driver: it is never abandoned half-way)."""

    target: str
    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = {}
    grants: bool = False


class Scan(NamedTuple):
    """The documents of ``<target>.<method>(*args)`` (a cursor: ``find``, ``aggregate``), in
    order, up to the first one for which ``stop(doc)`` is true (not included)."""

    target: str
    method: str
    args: tuple[Any, ...]
    stop: Callable[[Document], bool] | None = None


def database_of(backend: BackendBase) -> str:
    """The database a ``mongodb://`` store uses: the URL's (default ``latchkey``), or the one
    a borrowed client or Database stands for; checked now, not at first use."""
    url = backend.url
    if not url.hosts and backend.client is None:
        raise ConfigError(f"{url.scheme} store: the URL names no host")
    if backend.client is not None:  # a borrowed client or Database: the one it stands for
        from latchkey.stores.clients import mongo_database

        database = mongo_database(backend.client)
    else:
        database = url.path.strip("/") or "latchkey"
    if not _DATABASE.match(database):
        raise ConfigError(
            f"{url.scheme} store: database {database!r} must be letters, digits, _ and -"
        )
    return database


def only_duplicate_keys(exc: BulkWriteError) -> bool:
    """True if a bulk write failed only on duplicate keys (no other write error, no write
    concern error)."""
    errors = exc.details.get("writeErrors", [])
    return not exc.details.get("writeConcernErrors") and all(
        e.get("code") == DUPLICATE_KEY for e in errors
    )


def client_settings(
    url: StoreURL, config: Mapping[str, Any], database: str
) -> tuple[str, dict[str, Any]]:
    """The connection string and client keyword arguments for ``url``: the same for the sync
    and the asyncio client."""
    timeout: float = config["timeout"]
    netloc = url.raw.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    given: dict[str, str] = dict(config["driver"])
    lower = {k.lower() for k in given}
    # pymongo unquotes values (unquote_plus), except authMechanismProperties' "K:V,K:V".
    query = "&".join(f"{k}={quote_plus(v, safe=':,/')}" for k, v in given.items())
    path = f"/{database}" if url.path.strip("/") else "/"
    uri = f"{url.scheme}://{netloc}{path}" + (f"?{query}" if query else "")
    ms = max(1, round(timeout * 1000))
    kwargs: dict[str, Any] = {"connect": False, "tz_aware": True}
    for option in ("serverSelectionTimeoutMS", "connectTimeoutMS", "socketTimeoutMS"):
        if option.lower() not in lower:  # the URL's own wins over ?timeout=
            kwargs[option] = ms
    if "retryreads" not in lower:
        # A read that timed out is not tried again: on a frozen server pymongo's retry (and
        # the server selection before it) took three timeouts to fail. (Each request is also
        # bounded as a whole, by pymongo.timeout: see the module docstring.)
        kwargs["retryReads"] = False
    if "w" not in lower:
        kwargs["w"] = "majority"
    if "appname" not in lower:
        kwargs["appname"] = "latchkey"
    return uri, kwargs


#: A borrowed client's database settings, whatever the application's client defaults to:
#: the store reads dates as aware UTC datetimes, and its writes are majority-acknowledged.
BORROWED: dict[str, Any] = {
    "codec_options": CodecOptions(tz_aware=True, tzinfo=timezone.utc),
    "read_preference": ReadPreference.PRIMARY,
    "write_concern": WriteConcern("majority"),
}


def borrowed_targets(root: Any, database: str, collection: str) -> dict[str, Any]:
    """The store's targets (see :class:`Call`) over a borrowed client ``root`` (a MongoClient
    or AsyncMongoClient, never a Database), with latchkey's settings (:data:`BORROWED`)."""
    db = root.get_database(database, **BORROWED)
    return {
        "locks": db[collection],
        "records": db[f"{collection}_records"],
        "admin": root.get_database("admin", **BORROWED),
    }


def borrowed_root(client: Any, database_class: type[Any]) -> Any:
    """The client behind a borrowed MongoClient or Database (of ``database_class``)."""
    return client.client if isinstance(client, database_class) else client


@contextlib.contextmanager
def config_errors(url: StoreURL) -> Iterator[None]:
    """Creating a client: a bad option value (pymongo only warns about some) is ConfigError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            yield
    except (ConfigurationError, ValueError, TypeError, UserWarning) as exc:
        raise ConfigError(
            f"{url.scheme} store at {url.redacted()}: {url.scrub(str(exc))}"
        ) from None


class MongoDriver(Driver):
    errors = (PyMongoError,)

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        #: Ours (closed by close()), or None over a borrowed client (module docstring).
        self.client: MongoClient[Document] | None = None
        if backend.client is not None:
            from pymongo.database import Database

            root = borrowed_root(backend.client, Database)
            self.targets = borrowed_targets(root, store.database, store.collection)
            self.locks, self.records = self.targets["locks"], self.targets["records"]
            return
        uri, kwargs = client_settings(backend.url, backend.config, store.database)
        with config_errors(backend.url):
            self.client = MongoClient(uri, **kwargs)
        db = self.client[store.database]
        self.locks = db[store.collection]
        self.records = db[f"{store.collection}_records"]
        self.targets = {"locks": self.locks, "records": self.records, "admin": self.client.admin}

    def run(self, steps: Steps[T], action: str) -> T:
        """:meth:`Driver.run` inside one ``pymongo.timeout``: the primitive's deadline."""
        with pymongo.timeout(self.backend.timeout):
            return super().run(steps, action)

    def answer(self, request: Any) -> Any:
        if type(request) is Call:
            return getattr(self.targets[request.target], request.method)(
                *request.args, **request.kwargs
            )
        target, method, args, stop = request
        docs = []
        with getattr(self.targets[target], method)(*args) as cursor:
            for doc in cursor:
                if stop is not None and stop(doc):
                    break
                docs.append(doc)
        return docs

    def close(self) -> None:
        if self.client is not None:  # ours, never a borrowed one
            self.client.close()
