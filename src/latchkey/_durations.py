"""Durations: seconds as numbers, ``timedelta``, or strings like ``500ms``, ``1.5s``, ``1h30m``."""

from __future__ import annotations

import math
import re
from datetime import timedelta

from latchkey.errors import ConfigError

Duration = int | float | str | timedelta

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)(ms|s|m|h|d)")
_FOREVER = {"forever", "inf", "infinity", "none"}


def parse_duration(value: Duration, *, what: str = "duration") -> float:
    """Return ``value`` in seconds; raise :class:`ConfigError` naming ``what`` if it is not one.

    Negative, NaN and infinite values are rejected; use ``None`` (or ``"forever"`` via
    :func:`parse_wait`) for "no limit".
    """
    cls = value.__class__
    if cls is float or cls is int:  # the common case, fast (bool is neither: refused below)
        seconds = float(value)  # type: ignore[arg-type]
        if 0 <= seconds < math.inf:
            return seconds
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a duration, got {value!r}")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_text(value, what)
    else:
        raise ConfigError(f"{what}: expected a duration, got {type(value).__name__} {value!r}")
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise ConfigError(f"{what}: {value!r} is not a finite, non-negative duration")
    return seconds


#: Texts already read (a lock made per use parses the same few, e.g. "30s", each time).
_READ: dict[str, float] = {}


def _parse_text(text: str, what: str) -> float:
    seconds = _READ.get(text)
    if seconds is None:
        seconds = _read_text(text, what)
        if len(_READ) < 256:
            _READ[text] = seconds
    return seconds


def _read_text(text: str, what: str) -> float:
    raw = text.strip().lower()
    if not raw:
        raise ConfigError(f"{what}: empty duration")
    if raw.startswith("-"):
        raise ConfigError(f"{what}: {text!r} is negative; a duration is 0 or more (e.g. 5s)")
    try:
        return float(raw)
    except ValueError:
        pass
    pos, total = 0, 0.0
    for match in _PART.finditer(raw):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(raw) or pos == 0:
        raise ConfigError(
            f"{what}: cannot read {text!r} as a duration (try 500ms, 30s, 10m, 1h30m)"
        )
    return total


def parse_wait(value: Duration | None, *, what: str = "wait") -> float | None:
    """Like :func:`parse_duration`, but ``None`` and ``"forever"`` mean no limit (``None``)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in _FOREVER:
        return None
    return parse_duration(value, what=what)


def parse_ttl(value: Duration, *, what: str = "ttl") -> float:
    """A lease length: a duration of at least one millisecond."""
    seconds = parse_duration(value, what=what)
    if seconds < 0.001:
        raise ConfigError(f"{what}: {value!r} is shorter than 1ms")
    return seconds


def format_duration(seconds: float) -> str:
    """A short human form: ``950ms``, ``42s``, ``9m59s``, ``2h05m``."""
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"
