"""Store URLs: parsing, option validation, and a redacted form that never shows a password."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from latchkey._durations import parse_duration
from latchkey.errors import ConfigError

_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL. ``str()`` and ``repr()`` show it with the password masked."""

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
        netloc, _, tail = rest.partition("/")
        path_and_query = "/" + tail if tail or rest.endswith("/") else ""
        if "?" in netloc:  # e.g. memory://?x=1 or redis://host?db=1
            netloc, _, q = netloc.partition("?")
            path_and_query = "?" + q
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

    def redacted(self) -> str:
        """The URL as given, with any password replaced by ``***``."""
        return _mask_text(self.raw, self.password)

    def __str__(self) -> str:
        return self.redacted()

    def scrub(self, text: str) -> str:
        """Remove this URL's password from ``text`` (driver error messages, say)."""
        if self.password:
            text = text.replace(self.password, "***").replace(quote(self.password), "***")
        return text

    @property
    def host(self) -> str | None:
        return self.hosts[0][0] if self.hosts else None

    @property
    def port(self) -> int | None:
        return self.hosts[0][1] if self.hosts else None


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


def read_options(url: StoreURL, spec: Mapping[str, Option]) -> dict[str, Any]:
    """Validate ``url``'s query against ``spec`` (plus the common options).

    Unknown options and unreadable values raise :class:`ConfigError` naming them.
    """
    allowed = {**COMMON_OPTIONS, **spec}
    values = {name: opt.default for name, opt in allowed.items()}
    for key, text in url.query.items():
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise ConfigError(
                f"{url.scheme} store: unknown URL option {key!r} (known options: {known})"
            )
        try:
            values[key] = allowed[key].parse(text)
        except (ValueError, ConfigError) as exc:
            raise ConfigError(f"{url.scheme} store: option {key}={text!r}: {exc}") from None
    return values
