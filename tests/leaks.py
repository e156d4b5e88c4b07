"""One known socket leak of a dependency, told apart from ours by where the socket was made.

The suite turns every warning into an error, ``ResourceWarning`` included, so a socket that
latchkey forgets to close fails the test that was running when the collector found it.
PyMongo's asyncio connect (``pymongo/pool_shared.py``, ``_async_create_connection``, PyMongo
4.20) closes its new socket on ``OSError`` only: when ``AsyncMongoClient.close()`` cancels a
monitor that is connecting — to a frozen server, in the fault tests — the socket is dropped
open, connected or not (upstream: PYTHON-5867). The collector finds it later, in whatever test
runs then on that worker (a rerun, each time, of a test that had done nothing wrong).

Matching the warning's text cannot tell that socket from one of ours, so :func:`install`
notes the descriptor of every socket made by that one function (the caller of
``socket.socket()``), and the unraisable hook drops a ``ResourceWarning`` for a socket whose
descriptor is noted, after closing it. A socket keeps its descriptor until it is closed or
collected, so the newest socket made with a descriptor is the one the warning is about.
Every other unclosed socket still fails the test, and its failure says where the socket was
made (the frames that called ``socket.socket()``; a socket's descriptor names the newest
socket made with it): the collector finds a socket in whatever test runs then, often not
the one that dropped it.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

#: The function whose sockets may be dropped open: (file name ending, function name).
LEAKER = (os.path.join("pymongo", "pool_shared.py"), "_async_create_connection")

_noted: set[int] = set()  # descriptors of live sockets made by LEAKER
#: Where the live socket of each descriptor was made (its makers' frames, innermost first):
#: named in the failure of a test whose collector finds any other socket unclosed.
_made_at: dict[int, str] = {}
_init = socket.socket.__init__
_SKIP = (os.sep + "socket.py", os.sep + "ssl.py", os.sep + "selectors.py")


def _init_noting(self: socket.socket, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    frame = sys._getframe(1)
    code = frame.f_code
    fd = self.fileno()
    if code.co_name == LEAKER[1] and code.co_filename.endswith(LEAKER[0]):
        _noted.add(fd)
    else:
        _noted.discard(fd)  # a descriptor used again, by a socket of another maker
    sites: list[str] = []
    while frame is not None and len(sites) < 4:
        name = frame.f_code.co_filename
        if not name.endswith(_SKIP):
            short = name.rsplit("site-packages" + os.sep, 1)[-1].rsplit("src" + os.sep, 1)[-1]
            sites.append(f"{short}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back  # type: ignore[assignment]
    _made_at[fd] = " < ".join(sites)


def _unclosed_fd(unraisable: Any) -> int | None:
    """The descriptor of the socket an unraisable ResourceWarning is about (None: another
    exception, or not a socket's, or a socket closed since)."""
    obj = unraisable.object
    if not (isinstance(obj, socket.socket) and unraisable.exc_type is not None):
        return None
    if not issubclass(unraisable.exc_type, ResourceWarning):
        return None
    try:
        return obj.fileno()
    except OSError:
        return None


def made_at(unraisable: Any) -> Any:
    """``unraisable``, an unclosed socket's warning given where the socket was made (added to
    its message, which the rerun list shows)."""
    fd = _unclosed_fd(unraisable)
    site = None if fd is None else _made_at.get(fd)
    exc = unraisable.exc_value
    if site is not None and exc is not None and len(exc.args) == 1:
        exc.args = (f"{exc.args[0]} made at {site}",)  # (its traceback kept: pytest shows it)
    return unraisable


def known_leak(unraisable: Any) -> bool:
    """Whether an unraisable exception is the ResourceWarning of a socket made by LEAKER."""
    fd = _unclosed_fd(unraisable)
    if fd is None or fd not in _noted:
        return False
    obj = unraisable.object
    _noted.discard(fd)
    obj.close()
    return True


def install() -> None:
    """Note LEAKER's sockets, and drop their ResourceWarnings (call after pytest has put its
    own unraisable hook in: this one passes every other exception on to it)."""
    socket.socket.__init__ = _init_noting  # type: ignore[method-assign]
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if known_leak(unraisable):
            sys.stderr.write(
                "tests/leaks.py: dropped PyMongo's unclosed connect socket (PYTHON-5867)\n"
            )
            return
        previous(made_at(unraisable))

    sys.unraisablehook = hook
