"""Fixtures of the multi-process tests."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ctx = multiprocessing.get_context("spawn")


@pytest.fixture
def spawn() -> Iterator[Callable[..., Any]]:
    """Start a process (spawned: a fresh interpreter, no inherited connections); every one
    still alive at the end of the test is killed."""
    started: list[Any] = []

    def start(target: Callable[..., Any], *args: Any) -> Any:
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)
