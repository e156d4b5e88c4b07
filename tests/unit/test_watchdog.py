"""The watchdog that bounds blocking calls whose driver has no deadline (psycopg's sync API)."""

from __future__ import annotations

import socket
import time

from latchkey.stores.io.watchdog import Watchdog


def test_a_call_past_its_deadline_has_its_socket_shut_down() -> None:
    watchdog = Watchdog()
    ours, theirs = socket.socketpair()  # "theirs" never answers: a frozen server
    try:
        started = time.monotonic()
        watchdog.arm("call", 0.2, ours.fileno)
        assert ours.recv(1) == b""  # the blocked read ends: end of file
        assert watchdog.disarm("call") is True  # the caller learns its connection is gone
        assert 0.15 < time.monotonic() - started < 5
    finally:
        ours.close()
        theirs.close()


def test_calls_that_return_in_time_are_left_alone() -> None:
    watchdog = Watchdog()
    ours, theirs = socket.socketpair()
    try:
        for _ in range(200):
            watchdog.arm("call", 0.05, ours.fileno)
            theirs.sendall(b"x")
            assert ours.recv(1) == b"x"
            assert watchdog.disarm("call") is False
        # Long past every deadline armed above: the socket still works both ways.
        time.sleep(0.2)  # (the deadlines' own time: nothing to poll for)
        ours.sendall(b"y")
        assert theirs.recv(1) == b"y"
        theirs.sendall(b"z")
        assert ours.recv(1) == b"z"
    finally:
        ours.close()
        theirs.close()
