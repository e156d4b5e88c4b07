"""How a ``mysql://`` or ``mysql+getlock://`` URL becomes PyMySQL's and asyncmy's connect()
arguments, with the drivers' own options passed through.

PyMySQL and asyncmy take the same keyword arguments but for TLS: the URL's ``ssl_ca``,
``ssl_cert``, ``ssl_key``, ``ssl_key_password``, ``ssl_verify_cert``, ``ssl_verify_identity``
and ``ssl_disabled`` become one ``ssl`` context for either driver, built by
:func:`tls_context` (a CA given means the server's certificate is verified unless
``ssl_verify_cert=false``; the sync driver adds PyMySQL's preferred mode without options,
:mod:`latchkey.stores.io.pymysql`). Options that would change how latchkey's own
statements read (``charset``, ``sql_mode``, ``autocommit``, ``client_flag``…) are not passed.
Over a borrowed client (``connect(client=…)``) there are none: the client's own settings are
used (:func:`store_connect_args`), and it must stand for a database (:func:`no_database`).

Several hosts (``mysql://user@h1:3306,h2:3307/db``, the lease table only): the drivers take one
host each, so :class:`Hosts` says which to try in which order. A new connection tries them in
the URL's order starting with the last one found writable (after a failover, straight to the
new primary), and keeps the first that answers ``@@read_only = 0`` and
``@@innodb_read_only = 0`` (:data:`WRITABLE`, one round trip per new connection, as libpq's
``target_session_attrs=read-write``); connecting to each (TCP, handshake, check) gets its
share of the time left of the connect timeout, so one host that never answers leaves the
others theirs. When none is writable the error names every host tried and why.
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

from latchkey._url import DriverOptions, StoreURL, host_entries
from latchkey.errors import ConfigError

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a number of seconds > 0")
    return value


#: The drivers' options a URL may carry, and how each value reads.
PASSED: dict[str, Any] = {
    "connect_timeout": _seconds,
    "init_command": str,
    "program_name": str,
    "ssl_ca": str,
    "ssl_cert": str,
    "ssl_key": str,
    "ssl_key_password": str,
    "ssl_verify_cert": _flag,
    "ssl_verify_identity": _flag,
    "ssl_disabled": _flag,
}


def _check(key: str, text: str) -> Any:
    if key not in PASSED:
        raise KeyError(key)
    return PASSED[key](text)


MYSQL_DRIVER = DriverOptions(_check, "PyMySQL's " + ", ".join(sorted(PASSED)))


def connect_args(backend: BackendBase, failover: bool = False) -> dict[str, Any]:
    """PyMySQL's connect() arguments for a store URL (asyncmy's but the read and write
    timeouts and TLS: :func:`async_args`), for its first host; shared with the GET_LOCK
    store. ``failover``: the URL may name several hosts (:func:`hosts_of`)."""
    url, timeout = backend.url, backend.timeout
    hosts = hosts_of(url)
    if len(hosts) > 1 and not failover:
        raise ConfigError(
            f"{url.scheme} store: one host only (got {len(hosts)}): its locks live in one "
            "server's sessions, which no replica has, so a failover ends them all; name the "
            "primary, or use mysql:// (leases in a table) to follow a failover"
        )
    database = url.path.lstrip("/")
    if not database or "/" in database:
        raise ConfigError(
            f"{url.scheme} store URL {url.redacted()!r} names no database "
            f"({url.scheme}://user:password@host:3306/database)"
        )
    (host, port), *_ = hosts
    args = dict(host=host, port=port,
                user=url.username or "root", password=url.password or "", database=database,
                charset="utf8mb4", autocommit=True, connect_timeout=timeout,
                read_timeout=timeout, write_timeout=timeout)  # fmt: skip
    args.update(backend.config.get("driver", {}))
    return args


def store_connect_args(backend: BackendBase) -> dict[str, Any]:
    """The ``mysql://`` store's connect() arguments: :func:`connect_args` for latchkey's own
    connections (a ConfigError now, not at first use); none over a borrowed client, whose own
    settings (its driver's) are used, and which must then stand for a database."""
    if backend.client is None:
        return connect_args(backend, failover=True)  # several hosts: the drivers try them
    from latchkey.stores.clients import tells_database

    # (a client that does not say which database is asked at its first call)
    if not backend.url.path.strip("/") and tells_database(backend.client):
        raise no_database(backend.url.scheme)
    return {}


def no_database(scheme: str) -> ConfigError:
    """A borrowed client without a database: says how to give it one."""
    return ConfigError(
        f"{scheme} store: the client names no database (connect it with database=… — db=… "
        "for aiomysql — or give the engine's URL one)"
    )


def async_args(args: dict[str, Any]) -> dict[str, Any]:
    """asyncmy's arguments from PyMySQL's: no read/write timeouts (asyncio bounds each call),
    TLS as one context."""
    out = {k: v for k, v in args.items() if k not in ("read_timeout", "write_timeout")}
    tls = {k: out.pop(k) for k in list(out) if k.startswith("ssl_")}
    context = async_tls(tls)
    if context is not None:
        out["ssl"] = context
    return out


def async_tls(options: dict[str, Any]) -> ssl.SSLContext | None:
    """asyncmy's context: :func:`tls_context` of the plain class."""
    return tls_context(options)


def tls_context(
    options: dict[str, Any], make: type[ssl.SSLContext] = ssl.SSLContext
) -> ssl.SSLContext | None:
    """An SSL context (of class ``make``) from the URL's TLS options, the same for both
    drivers; None: no TLS asked for. A CA given means the server's certificate is verified
    against it (``ssl_verify_cert=false`` turns that off; ``ssl_verify_cert=true`` without a
    CA verifies against the system's); ``ssl_verify_identity`` checks the host name too.
    (PyMySQL alone verifies only with ``ssl_verify_cert`` or ``ssl_verify_identity`` set.)"""
    if not options or options.get("ssl_disabled"):
        return None
    if not any(k in options for k in ("ssl_ca", "ssl_cert", "ssl_key", "ssl_verify_cert",
                                      "ssl_verify_identity")):  # fmt: skip
        return None
    verify = bool(options.get("ssl_verify_cert", "ssl_ca" in options))
    context = make(ssl.PROTOCOL_TLS_CLIENT)
    if "ssl_ca" in options:
        context.load_verify_locations(cafile=options["ssl_ca"])
    elif verify:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    context.verify_flags &= ~ssl.VERIFY_X509_STRICT  # (MySQL's own certificates fail it)
    context.check_hostname = bool(options.get("ssl_verify_identity", False)) and verify
    context.verify_mode = ssl.CERT_REQUIRED if verify else ssl.CERT_NONE
    if "ssl_cert" in options:
        context.load_cert_chain(
            options["ssl_cert"], options.get("ssl_key"), options.get("ssl_key_password")
        )
    return context


# -- several hosts -------------------------------------------------------------------------

#: Whether the server takes writes, asked once per new connection to a host of a host list:
#: ``read_only`` (a replica; MySQL's ``super_read_only`` sets it too) and ``innodb_read_only``
#: (a server started read-only). Out: one row, two integers, both 0 on a writable server.
WRITABLE = "SELECT @@global.read_only, @@global.innodb_read_only"


def hosts_of(url: StoreURL) -> tuple[tuple[str, int], ...]:
    """The URL's hosts with their ports (3306 by default); a ConfigError for a host list with
    an empty entry, an entry without a host or a host named twice."""
    entries = host_entries(url.raw)
    if len(entries) <= 1:
        return ((url.host or "localhost", url.port or 3306),)
    hosts = tuple((host, port or 3306) for host, port in url.hosts)
    if len(hosts) != len(entries) or not all(host for host, _ in hosts):
        raise ConfigError(
            f"{url.scheme} store URL {url.redacted()!r}: the host list "
            f"{','.join(entries)!r} has an empty entry or one without a host "
            "(write host[:port],host[:port],…)"
        )
    for index, address in enumerate(hosts):
        if address in hosts[:index]:
            raise ConfigError(
                f"{url.scheme} store URL {url.redacted()!r}: {address_text(address)} is "
                "named twice in the host list"
            )
    return hosts


def address_text(address: tuple[str, int]) -> str:
    """``host:port`` (``[v6]:port``)."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_only(row: Any) -> str | None:
    """Why a server whose :data:`WRITABLE` row is ``row`` takes no writes (None: it does)."""
    read_only, innodb_read_only = (int(value or 0) for value in row)
    if read_only:
        return "read-only (@@read_only = 1)"
    if innodb_read_only:
        return "read-only (@@innodb_read_only = 1)"
    return None


def reason(exc: BaseException) -> str:
    """A driver error in one line: the server's or the driver's message, with its number."""
    args = exc.args
    if len(args) == 2 and isinstance(args[0], int):
        text = f"{args[1]} ({args[0]})"
    else:
        text = str(exc) or type(exc).__name__
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class Hosts:
    """The hosts of a multi-host URL and where the next connection starts trying them: the
    last host found writable (shared by a driver's connections; a plain int, so threads that
    race on it at worst try one host more)."""

    def __init__(self, addresses: tuple[tuple[str, int], ...]) -> None:
        self.addresses = addresses
        self.first = 0

    def order(self) -> list[int]:
        """The hosts' indexes in the order to try them."""
        count = len(self.addresses)
        return [(self.first + step) % count for step in range(count)]

    def found(self, index: int) -> None:
        self.first = index

    def missed(self, order: list[int], tried: int) -> None:
        """None of the first ``tried`` hosts of ``order`` would do: the next connection
        starts with the first host this one had no time left for."""
        if tried < len(order):
            self.first = order[tried]

    def none_writable(self, tried: list[str]) -> str:
        """The message of a connect that found no writable host; ``tried``: one
        ``host:port: why`` each."""
        left = len(self.addresses) - len(tried)
        more = f"; {left} more not tried (out of time)" if left else ""
        return f"no writable server among {len(self.addresses)} hosts: {'; '.join(tried)}{more}"
