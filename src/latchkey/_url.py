"""Store URLs: parsing, option validation, and a redacted form that never shows a password."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from latchkey._durations import parse_duration
from latchkey.errors import ConfigError

_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


@dataclass(frozen=True, repr=False)
class StoreURL:
    """A parsed store URL. ``str()`` shows it with the password (and any query option that
    holds a secret) masked; ``repr()`` shows its parts with the query's keys only: a value
    may be a secret whose option name does not say so."""

    scheme: str
    username: str | None
    password: str | None = field(repr=False)
    hosts: tuple[tuple[str, int | None], ...]
    path: str
    query: Mapping[str, str]
    raw: str = field(repr=False)

    @classmethod
    def parse(cls, url: str) -> StoreURL:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(
                f"store URL {_mask_text(str(url))!r} has no scheme "
                "(expected e.g. sqlite:///path/locks.db, postgresql://…, redis://…)"
            )
        scheme, rest = url.split("://", 1)
        scheme = scheme.lower()
        if not _SCHEME.match(scheme):
            raise ConfigError(f"store URL scheme {scheme!r} is not valid")
        # The authority ends at the first "/" (a path) or "?" (a query without a path, as in
        # memory://?x=1 or redis://host?db=1); a "/" inside the query is the query's.
        netloc, path_and_query = _split_netloc(rest)
        parts = urlsplit("x://h" + path_and_query)
        username = password = None
        hostpart = netloc
        if "@" in netloc:
            userinfo, _, hostpart = netloc.rpartition("@")
            user, sep, pw = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(pw) if sep else None
        hosts = tuple(_parse_host(h, url) for h in hostpart.split(",") if h) if hostpart else ()
        query: dict[str, str] = {}
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key in query:
                raise ConfigError(f"store URL option {key!r} is given twice")
            query[key] = value
        return cls(scheme, username, password, hosts, unquote(parts.path), query, url)

    @property
    def secrets(self) -> tuple[str, ...]:
        """The password and the values of query options that hold one (``sslpassword``,
        ``tlsCertificateKeyFilePassword``…): never shown."""
        found = [v for k, v in self.query.items() if _secret(k) and v]
        return tuple(s for s in (self.password, *found) if s)

    def redacted(self) -> str:
        """The URL as given, with any password replaced by ``***``."""
        masked = _mask_text(self.raw, self.password)
        for secret in self.secrets:
            masked = masked.replace(quote(secret, safe=""), "***").replace(secret, "***")
        return masked

    def __str__(self) -> str:
        return self.redacted()

    def __repr__(self) -> str:
        return (
            f"StoreURL(scheme={self.scheme!r}, username={self.username!r}, "
            f"password={'***' if self.password else None!r}, hosts={self.hosts!r}, "
            f"path={self.path!r}, query keys={sorted(self.query)!r})"
        )

    def scrub(self, text: str) -> str:
        """Remove this URL's passwords from ``text`` (driver error messages, say)."""
        for secret in self.secrets:
            text = text.replace(secret, "***").replace(quote(secret), "***")
        return text

    @property
    def host(self) -> str | None:
        return self.hosts[0][0] if self.hosts else None

    @property
    def port(self) -> int | None:
        return self.hosts[0][1] if self.hosts else None


def _split_netloc(rest: str) -> tuple[str, str]:
    """What follows ``scheme://``, as (authority, path and query)."""
    ends = [i for i in (rest.find("/"), rest.find("?")) if i >= 0]
    cut = min(ends) if ends else len(rest)
    return rest[:cut], rest[cut:]


def host_entries(url: str) -> list[str]:
    """The comma-separated entries of a URL's host list as written, empty ones included
    (:attr:`StoreURL.hosts` skips those): ``[]`` for a URL without hosts."""
    netloc, _ = _split_netloc(url.split("://", 1)[1])
    hostpart = netloc.rpartition("@")[2]
    return hostpart.split(",") if hostpart else []


def _parse_host(text: str, url: str) -> tuple[str, int | None]:
    if text.startswith("["):  # [::1]:6379
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.partition(":")
    if not port_text:
        return unquote(host), None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(
            f"store URL {_mask_text(url)!r}: port {port_text!r} is not a number 1-65535"
        )
    return unquote(host), int(port_text)


_USERINFO = re.compile(r"(://[^/@:]*:)([^/@]*)@")


def _secret(key: str) -> bool:
    """A query option whose value is a secret (``sslpassword``, ``oauth_client_secret``,
    ``auth_token``…)."""
    key = key.lower()
    return (
        any(word in key for word in ("password", "secret", "token"))
        or key.startswith("scram_")
        or key == "authmechanismproperties"  # MongoDB: may carry AWS_SESSION_TOKEN:…
    )


#: A secret query option's value in any text (``sslpassword=…``, ``auth_token=…``).
_SECRET_OPTION = re.compile(r"([?&][^=&\s]*(?:password|secret|token)[^=&\s]*=)[^&\s]+", re.I)


def mask_secrets(text: str) -> str:
    """``text`` with the password of every URL in it, and every secret option's value,
    replaced by ``***`` (for messages that may echo what a user typed, unparsed)."""
    return _SECRET_OPTION.sub(r"\1***", _mask_text(text))


def _mask_text(text: str, password: str | None = None) -> str:
    masked = _USERINFO.sub(r"\1***@", text)
    if password:
        masked = masked.replace(password, "***")
    return masked


# -- option parsers: each takes the option's text and returns its value or raises ValueError --

Parser = Callable[[str], Any]
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_PREFIX = re.compile(r"^[A-Za-z0-9_:.\-]{0,100}$")


def identifier(text: str) -> str:
    """A SQL table/schema or MongoDB collection name: letters, digits, ``_``; ≤ 63 chars."""
    if not _IDENTIFIER.match(text):
        raise ValueError("must be letters, digits and _, not starting with a digit, ≤ 63 chars")
    return text


def key_prefix(text: str) -> str:
    """A key prefix: letters, digits, ``_ : . -``; at most 100 characters."""
    if not _PREFIX.match(text):
        raise ValueError("must be letters, digits and _ : . - only, at most 100 characters")
    return text


def duration(text: str) -> float:
    return parse_duration(text)


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a positive whole number")
    return value


def boolean(text: str) -> bool:
    lowered = text.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("must be true or false")


def choice(*allowed: str) -> Parser:
    def parse(text: str) -> str:
        if text.lower() not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return text.lower()

    return parse


@dataclass(frozen=True)
class Option:
    """One ``?name=value`` a store accepts: how to read it and its default."""

    parse: Parser
    default: Any
    help: str = ""


COMMON_OPTIONS: Mapping[str, Option] = {
    "timeout": Option(duration, 5.0, "connect and operation timeout"),
}


@dataclass(frozen=True)
class DriverOptions:
    """The options a store's driver reads in its own connection strings, passed through to it
    (``?connect_timeout=5&application_name=worker`` for libpq). ``check(key, text)`` is asked
    only for an option latchkey does not know itself: it returns the value to pass, raises
    KeyError if the driver does not know the option either, ValueError if the value is bad.
    ``where`` says where the driver's options are documented. They land in
    ``config["driver"]``."""

    check: Callable[[str, str], Any]
    where: str


def known_to(names: Callable[[], Collection[str]]) -> Callable[[str, str], str]:
    """A ``DriverOptions.check`` for a driver whose options are a list of names."""

    def check(key: str, text: str) -> str:
        if key not in names():
            raise KeyError(key)
        return text

    return check


def read_options(
    url: StoreURL, spec: Mapping[str, Option], driver: DriverOptions | None = None
) -> dict[str, Any]:
    """Validate ``url``'s query against ``spec`` (plus the common options), passing the
    driver's own options through (see :class:`DriverOptions`).

    Unknown options and unreadable values raise :class:`ConfigError` naming them.
    """
    allowed = {**COMMON_OPTIONS, **spec}
    values: dict[str, Any] = {name: opt.default for name, opt in allowed.items()}
    passed: dict[str, Any] = {}
    values["driver"] = passed
    for key, text in url.query.items():
        if key not in allowed and driver is not None:
            try:
                passed[key] = driver.check(key, text)
                continue
            except KeyError:
                pass  # unknown to the driver too: said below
            except (ValueError, ConfigError) as exc:
                shown = "***" if _secret(key) else repr(text)
                raise ConfigError(f"{url.scheme} store: option {key}={shown}: {exc}") from None
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            also = f"; also {driver.where}" if driver is not None else ""
            raise ConfigError(
                f"{url.scheme} store: unknown URL option {key!r} (known options: {known}{also})"
            )
        try:
            values[key] = allowed[key].parse(text)
        except (ValueError, ConfigError) as exc:
            shown = "***" if _secret(key) else repr(text)
            raise ConfigError(f"{url.scheme} store: option {key}={shown}: {exc}") from None
    return values
