"""How a ``mysql://`` or ``mysql+getlock://`` URL becomes PyMySQL's and asyncmy's connect()
arguments, with the drivers' own options passed through.

PyMySQL and asyncmy take the same keyword arguments but for TLS: PyMySQL reads ``ssl_ca``,
``ssl_cert``, ``ssl_key``, ``ssl_key_password``, ``ssl_verify_cert``, ``ssl_verify_identity``
and ``ssl_disabled`` itself; asyncmy takes one ``ssl`` context, which :func:`async_tls` builds
from the same options the way PyMySQL does (a CA given means the server's certificate is
verified unless ``ssl_verify_cert=false``). Options that would change how latchkey's own
statements read (``charset``, ``sql_mode``, ``autocommit``, ``client_flag``…) are not passed.
Over a borrowed client (``connect(client=…)``) there are none: the client's own settings are
used (:func:`store_connect_args`), and it must stand for a database (:func:`no_database`).
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

from latchkey._url import DriverOptions
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


def connect_args(backend: BackendBase) -> dict[str, Any]:
    """PyMySQL's connect() arguments for a store URL (asyncmy's but the read and write
    timeouts and TLS: :func:`async_args`); shared with the GET_LOCK store."""
    url, timeout = backend.url, backend.timeout
    if len(url.hosts) > 1:
        raise ConfigError(f"{url.scheme} store: one host only, got {len(url.hosts)}")
    database = url.path.lstrip("/")
    if not database or "/" in database:
        raise ConfigError(
            f"{url.scheme} store URL {url.redacted()!r} names no database "
            f"({url.scheme}://user:password@host:3306/database)"
        )
    args = dict(host=url.host or "localhost", port=url.port or 3306,
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
        return connect_args(backend)
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
    """An SSL context from PyMySQL's TLS options, with PyMySQL's meaning; None: no TLS."""
    if not options or options.get("ssl_disabled"):
        return None
    if not any(k in options for k in ("ssl_ca", "ssl_cert", "ssl_key", "ssl_verify_cert",
                                      "ssl_verify_identity")):  # fmt: skip
        return None
    context = ssl.create_default_context(cafile=options.get("ssl_ca"))
    verify = options.get("ssl_verify_cert", "ssl_ca" in options)
    context.check_hostname = bool(options.get("ssl_verify_identity", False)) and verify
    context.verify_mode = ssl.CERT_REQUIRED if verify else ssl.CERT_NONE
    if "ssl_cert" in options:
        context.load_cert_chain(
            options["ssl_cert"], options.get("ssl_key"), options.get("ssl_key_password")
        )
    return context
