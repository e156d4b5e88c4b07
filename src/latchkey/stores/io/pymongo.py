"""MongoDB through PyMongo's sync client (``MongoClient``): the driver of ``mongodb://``.

PyMongo already does what the I/O layer does for the other drivers — a connection pool,
server monitoring, fork warnings, a timeout on server selection, connect and every socket
read (all set from the URL's ``timeout``) — so this driver is small: it turns each request of
the store (:class:`Call`, :class:`Scan`) into a method call on a collection, and maps
``PyMongoError`` to StoreUnavailable (through :class:`~latchkey.stores.io.Driver`). Errors
the store gives a meaning to (``DuplicateKeyError``, ``BulkWriteError``) are thrown into its
generator first. The asyncio twin is :mod:`latchkey.stores.io.pymongo_async`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import quote_plus

from pymongo import MongoClient
from pymongo.errors import ConfigurationError, PyMongoError

from latchkey._url import StoreURL
from latchkey.errors import ConfigError
from latchkey.stores.io import Driver

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

Document = dict[str, Any]

#: MongoDB connection-string options passed through to pymongo as given.
PASSTHROUGH = (
    "appName", "authMechanism", "authMechanismProperties", "authSource", "compressors",
    "directConnection", "journal", "loadBalanced", "maxPoolSize", "minPoolSize",
    "readConcernLevel", "readPreference", "replicaSet", "retryReads", "retryWrites", "ssl",
    "tls", "tlsAllowInvalidCertificates", "tlsAllowInvalidHostnames", "tlsCAFile",
    "tlsCertificateKeyFile", "tlsCertificateKeyFilePassword", "tlsInsecure", "w", "wTimeoutMS",
)  # fmt: skip


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


def client_settings(url: StoreURL, timeout: float, database: str) -> tuple[str, dict[str, Any]]:
    """The connection string and client keyword arguments for ``url``: the same for the sync
    and the asyncio client."""
    netloc = url.raw.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    given = {k: v for k, v in url.query.items() if k in PASSTHROUGH}
    # pymongo unquotes values (unquote_plus), except authMechanismProperties' "K:V,K:V".
    query = "&".join(f"{k}={quote_plus(v, safe=':,/')}" for k, v in given.items())
    path = f"/{database}" if url.path.strip("/") else "/"
    uri = f"{url.scheme}://{netloc}{path}" + (f"?{query}" if query else "")
    ms = max(1, round(timeout * 1000))
    kwargs: dict[str, Any] = {
        "connect": False,
        "tz_aware": True,
        "serverSelectionTimeoutMS": ms,
        "connectTimeoutMS": ms,
        "socketTimeoutMS": ms,
    }
    if "retryReads" not in given:
        # A read that timed out is not tried again: on a frozen server pymongo's retry (and
        # the server selection before it) took three timeouts to fail. (timeoutMS would bound
        # the whole operation instead, but then a claim of 1,000 names must fit in one timeout.)
        kwargs["retryReads"] = False
    if "w" not in given:
        kwargs["w"] = "majority"
    if "appName" not in given:
        kwargs["appname"] = "latchkey"
    return uri, kwargs


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
        uri, kwargs = client_settings(backend.url, backend.timeout, store.database)
        with config_errors(backend.url):
            self.client: MongoClient[Document] = MongoClient(uri, **kwargs)
        db = self.client[store.database]
        self.locks = db[store.collection]
        self.records = db[f"{store.collection}_records"]
        self.targets = {"locks": self.locks, "records": self.records, "admin": self.client.admin}

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
        self.client.close()
