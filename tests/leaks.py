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
Every other unclosed socket still fails the test.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

#: The function whose sockets may be dropped open: (file name ending, function name).
LEAKER = (os.path.join("pymongo", "pool_shared.py"), "_async_create_connection")

_noted: set[int] = set()  # descriptors of live sockets made by LEAKER
_init = socket.socket.__init__


def _init_noting(self: socket.socket, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    code = sys._getframe(1).f_code
    fd = self.fileno()
    if code.co_name == LEAKER[1] and code.co_filename.endswith(LEAKER[0]):
        _noted.add(fd)
    else:
        _noted.discard(fd)  # a descriptor used again, by a socket of another maker


def known_leak(unraisable: Any) -> bool:
    """Whether an unraisable exception is the ResourceWarning of a socket made by LEAKER."""
    obj = unraisable.object
    if not (isinstance(obj, socket.socket) and unraisable.exc_type is not None):
        return False
    if not issubclass(unraisable.exc_type, ResourceWarning):
        return False
    try:
        fd = obj.fileno()
    except OSError:
        return False
    if fd not in _noted:
        return False
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
        previous(unraisable)

    sys.unraisablehook = hook
