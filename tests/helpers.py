"""Small test helpers shared by the suites."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def skip_or_fail(store: str, reason: str) -> None:
    """A server the test needs could not be had: fail under CI (where every server must
    run), else skip with the reason printed."""
    if os.environ.get("CI"):
        pytest.fail(f"{store}: server required in CI but unavailable: {reason}")
    pytest.skip(f"{store}: not run: {reason}")


def eventually(probe: Callable[[], T], *, timeout: float = 10.0, what: str = "condition") -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout`` seconds.

    For waiting on a condition (a lease to expire in the store, a thread to block) instead of
    sleeping a guessed amount.
    """
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


HOSTILE_NAMES = [
    "it's; DROP TABLE latchkey_locks; --",
    'double "quoted" \\ backslash',
    "nul\x00inside",
    "percent%and_underscore*glob?[x]",
    "{hash}{tags} and spaces\tand\nnewlines",
    "ünïcødé ✓ 锁",
    "é" * 127,  # 254 bytes of UTF-8
    "x" * 255,  # the longest name allowed
]
