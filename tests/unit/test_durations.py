from __future__ import annotations

from datetime import timedelta

import pytest

from latchkey import ConfigError
from latchkey._durations import format_duration, parse_duration, parse_ttl, parse_wait


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("1.5s", 1.5),
        ("30s", 30),
        ("10m", 600),
        ("1h30m", 5400),
        ("2d", 172800),
        (" 7 ", 7),
        ("0", 0),
        (".5s", 0.5),
        (3, 3),
        (2.5, 2.5),
        (timedelta(minutes=2), 120),
        ("1h0m30s", 3630),
        ("1M", 60),
    ],
)
def test_parse(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "soon",
        "10q",
        "5 m",
        "-1",
        "m",
        "1h 30m",
        "nan",
        "inf",
        -3,
        float("nan"),
        True,
        None,
        [1],
    ],
)
def test_rejects_with_the_value_named(bad: object) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_duration(bad, what="--ttl")  # type: ignore[arg-type]
    assert "--ttl" in str(caught.value)


def test_wait_forever_and_ttl_minimum() -> None:
    assert parse_wait(None) is None
    assert parse_wait("forever") is None and parse_wait("Forever") is None
    assert parse_wait("0") == 0
    with pytest.raises(ConfigError, match="shorter than 1ms"):
        parse_ttl(0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.25, "250ms"),
        (4.25, "4.2s"),
        (42, "42s"),
        (599, "9m59s"),
        (7500, "2h05m"),
        (200000, "2d07h"),
    ],
)
def test_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
