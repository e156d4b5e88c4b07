"""The watchdog that bounds blocking calls whose driver has no deadline (psycopg's sync API)."""

from __future__ import annotations

import socket
import threading
import time

from latchkey.stores.io.watchdog import CUT, Watchdog


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


def test_a_disarm_while_the_thread_cuts_waits_for_the_cut_and_learns_of_it() -> None:
    # The thread's side, step by step as Watchdog._run takes it: under its lock it raises
    # `cutting`, finds the call's entry still armed and is about to cut it. A disarm taking
    # the entry out now must not return "not cut" before the cut is done.
    watchdog = Watchdog()
    watchdog.arm("call", 3600, lambda: -1)  # (the thread, started by arm, sleeps an hour)
    answers: list[bool] = []
    with watchdog.lock:
        watchdog.cutting = True
        entry = watchdog.armed["call"]
        disarming = threading.Thread(target=lambda: answers.append(watchdog.disarm("call")))
        disarming.start()
        # It takes the entry out without the lock, then waits for the lock (a disarm that
        # takes the lock first waits here without taking it out: then after 1 s, go on).
        until = time.monotonic() + 1
        while "call" in watchdog.armed and time.monotonic() < until:
            time.sleep(0.001)
        assert entry is not None and not answers  # not answered while the cut is under way
        watchdog.armed["call"] = CUT  # the thread's cut, decided before the entry went
        watchdog.cutting = False
    disarming.join(5)
    assert answers == [True]
    assert "call" not in watchdog.armed
