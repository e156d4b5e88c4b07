"""tests/leaks.py drops the ResourceWarning of PyMongo's leaked connect socket, and only it."""

from __future__ import annotations

import os
import socket
import sys
import types

from tests import leaks


def _made_by(filename: str, function: str) -> socket.socket:
    """A socket made by a function of that name, in a file of that name."""
    source = f"def {function}():\n    import socket\n    return socket.socket()\n"
    namespace: dict[str, object] = {}
    exec(compile(source, filename, "exec"), namespace)
    made = namespace[function]()  # type: ignore[operator]
    assert isinstance(made, socket.socket)
    return made


def _unraisable(sock: socket.socket, exc_type: type[BaseException]) -> types.SimpleNamespace:
    return types.SimpleNamespace(object=sock, exc_type=exc_type)


def test_only_the_known_leaker_s_socket_warning_is_dropped_and_it_is_closed() -> None:
    ours = socket.socket()
    theirs = _made_by("/site-packages/pymongo/pool_shared.py", "_async_create_connection")
    elsewhere = _made_by("/site-packages/pymongo/pool_shared.py", "_create_connection")
    try:
        assert leaks.known_leak(_unraisable(ours, ResourceWarning)) is False
        assert leaks.known_leak(_unraisable(elsewhere, ResourceWarning)) is False
        assert leaks.known_leak(_unraisable(theirs, ValueError)) is False  # not a leak
        assert leaks.known_leak(_unraisable(theirs, ResourceWarning)) is True
        assert theirs.fileno() == -1  # closed by the hook
    finally:
        for sock in (ours, theirs, elsewhere):
            sock.close()


def test_a_descriptor_used_again_by_another_maker_is_not_dropped() -> None:
    theirs = _made_by("/site-packages/pymongo/pool_shared.py", "_async_create_connection")
    fd = theirs.fileno()
    spare = socket.socket()
    theirs.close()
    os.dup2(spare.fileno(), fd)  # the descriptor, taken again by a socket of ours
    ours = socket.socket(fileno=fd)
    try:
        assert ours.fileno() == fd
        assert leaks.known_leak(_unraisable(ours, ResourceWarning)) is False
        assert ours.fileno() == fd  # left open: the collector will report it
    finally:
        ours.close()
        spare.close()


def test_the_suite_runs_with_it_installed() -> None:
    """tests/conftest.py installs it after pytest's own hook, which it passes the rest to."""
    assert socket.socket.__init__ is leaks._init_noting
    assert sys.unraisablehook.__qualname__ == "install.<locals>.hook"


def test_another_unclosed_socket_s_warning_says_where_it_was_made() -> None:
    dropped = _made_by("/site-packages/somelib/pool.py", "connect_somewhere")
    try:
        warning = types.SimpleNamespace(
            object=dropped, exc_type=ResourceWarning, exc_value=ResourceWarning("unclosed"),
            exc_traceback=None, err_msg="Exception ignored in",
        )  # fmt: skip
        told = leaks.made_at(warning)
        assert told is warning  # the same exception, its message longer
        made = "unclosed made at somelib/pool.py:3 connect_somewhere"
        assert str(told.exc_value).startswith(made)
        assert "test_leaks.py" in str(told.exc_value)  # and its callers, innermost first
        other = types.SimpleNamespace(object=dropped, exc_type=ValueError, exc_value=None)
        assert leaks.made_at(other) is other and other.exc_value is None  # not a socket's
    finally:
        dropped.close()
