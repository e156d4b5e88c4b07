"""redis-py's own connection options in a ``redis://``, ``redis+sentinel://`` or
``redis+cluster://`` URL and their TLS twins (``rediss://``, ``rediss+sentinel://``,
``rediss+cluster://``): which pass through to redis-py, how each value reads, and which are
refused and why.

redis-py's ``from_url`` passes any query parameter to its connections, typed by its own
table (``redis.connection.URL_QUERY_ARGUMENT_PARSERS``) or as text. latchkey passes the ones
that keep its connections working as it needs them (:data:`PASSED`), typed here so that a bad
value is a ``ConfigError`` naming it at ``connect()`` rather than an error at the first call;
it refuses, with the reason, those that would break them (:data:`REFUSED`: replies as bytes
or RESP3, which its reply parsing does not read; retries, which are the core's to decide;
socket timeouts other than the store's ``timeout``; redis-py's pool, which latchkey does not
use). Anything else is unknown, and the message lists the ones passed.

Plain data and parsers, no redis-py import: the store modules read these tables to validate
a URL; the drivers (:mod:`latchkey.stores.io.redis` and the Sentinel and Cluster ones) merge
the values into their connections' settings.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from latchkey._url import DriverOptions, boolean


@dataclass(frozen=True)
class Passed:
    """One option passed to redis-py: how its text reads, what it does, and where it applies
    (``tls``: only over TLS, a ``rediss`` scheme; ``cluster``: also on a cluster, whose client
    takes it)."""

    parse: Callable[[str], Any]
    help: str
    tls: bool = False
    cluster: bool = True


def _client_name(text: str) -> str:
    if not text or not all(c.isprintable() and not c.isspace() for c in text):
        raise ValueError("must be printable, without spaces (Redis refuses others)")
    return text


def _whole_seconds(text: str) -> int:
    if not text.isdigit():
        raise ValueError("must be a whole number of seconds ≥ 0")
    return int(text)


def _bytes(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise ValueError("must be a number of bytes > 0")
    return int(text)


def _cert_reqs(text: str) -> str:
    if text.lower() not in ("required", "optional", "none"):
        raise ValueError("must be one of required, optional, none")
    return text.lower()


def _tls_version(text: str) -> ssl.TLSVersion:
    """``TLSv1_2``, ``TLSv1_3`` (ssl.TLSVersion names, any case), or redis-py's number."""
    versions = [v for v in ssl.TLSVersion if v.name.startswith("TLSv1")]
    for version in versions:
        if text.lower().replace(".", "_") == version.name.lower() or text == str(version.value):
            return version
    raise ValueError(f"must be a TLS version: {', '.join(v.name for v in versions)}")


def _verify_flags(text: str) -> list[ssl.VerifyFlags]:
    """Comma-separated ssl.VerifyFlags names (``VERIFY_X509_STRICT,VERIFY_X509_PARTIAL_CHAIN``;
    redis-py's brackets allowed)."""
    flags = []
    for name in text.strip("[]").split(","):
        flag = getattr(ssl.VerifyFlags, name.strip(), None)
        if not isinstance(flag, ssl.VerifyFlags):
            raise ValueError(f"{name.strip()!r} is not an ssl.VerifyFlags name (VERIFY_X509_…)")
        flags.append(flag)
    return flags


#: redis-py's options a URL may carry, passed to every connection latchkey makes (the
#: pub/sub listener's too).
PASSED: dict[str, Passed] = {
    "client_name": Passed(_client_name, "CLIENT SETNAME on every connection (CLIENT LIST)"),
    "socket_keepalive": Passed(boolean, "TCP keepalive on (redis-py's default) or off"),
    "socket_read_size": Passed(_bytes, "bytes read from the socket at a time"),
    "health_check_interval": Passed(
        _whole_seconds,
        "PING a connection idle this many seconds before using it (0: never; latchkey "
        "checks idle connections for a close by the server anyway)",
        cluster=False,  # redis-py's sync cluster client drops it
    ),
    "ssl_cert_reqs": Passed(_cert_reqs, "verify the server: required (default), optional, none",
                            tls=True),
    "ssl_ca_certs": Passed(str, "CA bundle file to verify the server with", tls=True),
    "ssl_ca_path": Passed(str, "directory of CA certificates", tls=True),
    "ssl_certfile": Passed(str, "client certificate file (mutual TLS)", tls=True),
    "ssl_keyfile": Passed(str, "client key file", tls=True),
    "ssl_password": Passed(str, "password of the client key (never shown)", tls=True),
    "ssl_check_hostname": Passed(boolean, "match the server's certificate to the host name",
                                 tls=True),
    "ssl_min_version": Passed(_tls_version, "lowest TLS version: TLSv1_2, TLSv1_3", tls=True),
    "ssl_ciphers": Passed(str, "OpenSSL cipher list", tls=True),
    "ssl_include_verify_flags": Passed(_verify_flags, "ssl.VerifyFlags to set, comma-separated",
                                       tls=True),
    "ssl_exclude_verify_flags": Passed(_verify_flags,
                                       "ssl.VerifyFlags to clear, comma-separated", tls=True),
}  # fmt: skip

_TIMEOUT = "latchkey's timeout= bounds connecting and every reply (a call must fail within it)"
_RETRY = (
    "latchkey never retries a store call itself: the core decides (a retried release could "
    "report one that happened as one that did not)"
)
_TEXT = "latchkey reads its replies as text and RESP2 on connections of its own; it sets this"

#: redis-py options a URL may not carry, and why.
REFUSED: dict[str, str] = {
    "decode_responses": _TEXT,
    "protocol": _TEXT + " (RESP3 changes the replies its scripts' results are read from)",
    "legacy_responses": _TEXT,
    "encoding": "names and owner records are UTF-8: another encoding would misread them",
    "encoding_errors": "names and owner records are UTF-8: another encoding would misread them",
    "socket_timeout": _TIMEOUT,
    "socket_connect_timeout": _TIMEOUT,
    "retry_on_timeout": _RETRY,
    "retry_on_error": _RETRY,
    "max_connections": (
        "latchkey keeps connections of its own, not redis-py's pool: one per thread calling "
        "at once (asyncio: at most 32 commands in flight) and one pub/sub connection"
    ),
    "db": (
        "the database number is the URL's path (redis://host:6379/2); redis+sentinel:// "
        "takes ?db=, a cluster has only db 0"
    ),
    "host": "it is the URL's host part",
    "port": "it is the URL's port",
    "username": "it is the URL's user part (redis://user:password@host)",
    "password": "it is the URL's password part (redis://user:password@host)",
    "ssl": "use the rediss:// scheme for TLS (rediss+sentinel://, rediss+cluster://)",
    "ssl_validate_ocsp": "OCSP checking is not supported by latchkey's Redis store",
    "ssl_validate_ocsp_stapled": "OCSP checking is not supported by latchkey's Redis store",
    "ssl_ocsp_expected_cert": "OCSP checking is not supported by latchkey's Redis store",
}


def _checker(cluster: bool) -> Callable[[str, str], Any]:
    def check(key: str, text: str) -> Any:
        if key in REFUSED:
            raise ValueError(f"not accepted: {REFUSED[key]}")
        option = PASSED.get(key)
        if option is None:
            raise KeyError(key)
        if cluster and not option.cluster:
            raise ValueError("not accepted on a cluster: redis-py's cluster client drops it")
        return option.parse(text)

    return check


def _listed(cluster: bool) -> str:
    names = [k for k, o in PASSED.items() if not cluster or o.cluster]
    return "redis-py's " + ", ".join(sorted(names)) + " (docs/reference/urls.md)"


#: The driver options of ``redis://``, ``redis+sentinel://`` and their TLS twins (the TLS
#: ones only with TLS: :func:`tls_misused`).
REDIS_OPTIONS = DriverOptions(_checker(cluster=False), _listed(cluster=False))
#: The driver options of ``redis+cluster://`` and ``rediss+cluster://``.
CLUSTER_OPTIONS = DriverOptions(_checker(cluster=True), _listed(cluster=True))


def uses_tls(scheme: str) -> bool:
    """Whether a URL of ``scheme`` connects over TLS: ``rediss``, ``rediss+sentinel``,
    ``rediss+cluster`` (redis-py's ``rediss://``, with the deployment after the ``+``)."""
    return scheme.partition("+")[0] == "rediss"


def tls_scheme(scheme: str) -> str:
    """The TLS twin of a Redis scheme: ``redis+sentinel`` → ``rediss+sentinel``."""
    kind, plus, deployment = scheme.partition("+")
    return f"rediss{plus}{deployment}" if kind == "redis" else scheme


def tls_misused(scheme: str, passed: dict[str, Any]) -> str | None:
    """The first TLS option among ``passed`` if ``scheme`` has no TLS, else None."""
    if uses_tls(scheme):
        return None
    return next((k for k in passed if k in PASSED and PASSED[k].tls), None)


def tls_options(passed: dict[str, Any]) -> dict[str, Any]:
    """The TLS options among ``passed`` (a Sentinel's connections to the sentinels take
    these, and not the others)."""
    return {k: v for k, v in passed.items() if k in PASSED and PASSED[k].tls}
