"""A TCP proxy between latchkey's clients and a server, that breaks the network on demand.

Modes (:meth:`Proxy.set`): ``pass`` (forward, optionally with added latency), ``blackhole``
(connections stay open and new ones are accepted, but nothing is forwarded in either
direction and nobody is told: the kernel buffers fill, reads hang — a partition that drops
packets), ``mute`` (requests reach the server, its answers are dropped: a write that happened
but whose reply was lost; or only from a request that holds given bytes on), and
:meth:`Proxy.reset` (every open connection is closed with a TCP reset; new connections pass).
:meth:`Proxy.heal` returns to plain forwarding. Threads, no asyncio, so the test process can
drive it from anywhere.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._mode = "pass"
        self._mute_on: bytes | None = None
        self._latency = 0.0
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    # -- control -------------------------------------------------------------------------------

    def set(self, mode: str, latency: float = 0.0, on: bytes | None = None) -> None:
        """``on`` (``mute`` only): forward until a client sends bytes that contain it, then
        mute, from that request's answer on (the write of a call of several statements)."""
        assert mode in ("pass", "blackhole", "mute"), mode
        assert on is None or mode == "mute", mode
        self._mute_on = on
        self._mode, self._latency = ("pass" if on else mode), latency

    def heal(self) -> None:
        """Forward again. Connections that lost answers while muted are reset first: a byte
        stream with a hole in it is not something TCP delivers (the connection dies instead),
        and a client that kept one would read the next answer as the lost one's."""
        if self._mode == "mute":
            self.reset()
        self.set("pass")  # (and no mute to come)

    def reset(self) -> None:
        """Close every open connection with an RST (SO_LINGER 0); the mode is kept."""
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            _abort(conn)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.reset()

    # -- forwarding ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                _abort(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._conns.update((client, server))
            threading.Thread(
                target=self._pump, args=(client, server), name="proxy-pump", daemon=True
            ).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        try:
            while not self._closed:
                if self._mode == "blackhole":
                    time.sleep(0.01)  # read nothing, send nothing, say nothing
                    with self._lock:
                        if a not in self._conns:
                            return
                    continue
                readable, _, _ = select.select([a, b], [], [], 0.05)
                for sock in readable:
                    if self._mode == "blackhole":
                        break
                    data = sock.recv(65536)
                    if not data:
                        return
                    if self._mode == "mute" and sock is b:
                        continue  # the server's answer, dropped
                    if self._mute_on is not None and sock is a and self._mute_on in data:
                        self._mode, self._mute_on = "mute", None  # before the request goes
                    if self._latency:
                        time.sleep(self._latency)
                    peer[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._conns.discard(a)
                self._conns.discard(b)
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.close()


def _abort(sock: socket.socket) -> None:
    """Close with a TCP reset, not a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class Proxies:
    """A proxy in front of each host of a URL (a primary and its replica: ``h1,h2``), broken
    and healed together: the network between the clients and every server fails at once."""

    def __init__(self, targets: list[tuple[str, int]]) -> None:
        self.proxies = [Proxy(host, port) for host, port in targets]

    def add(self, host: str, port: int) -> Proxy:
        """One more proxy, to ``host:port``, broken and healed with the others."""
        self.proxies.append(Proxy(host, port))
        return self.proxies[-1]

    def set(self, mode: str, latency: float = 0.0, on: bytes | None = None) -> None:
        for proxy in self.proxies:
            proxy.set(mode, latency, on)

    def heal(self) -> None:
        for proxy in self.proxies:
            proxy.heal()

    def reset(self) -> None:
        for proxy in self.proxies:
            proxy.reset()

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()
