#!/usr/bin/env python3
"""What one network round trip costs through asyncio, against a blocking socket: the floor
under every asyncio store's uncontended figure.

    bench/.venv/bin/python bench/asyncfloor.py PORT    # a memcached on 127.0.0.1:PORT

The same tiny memcached request (``mn``, a no-op) and its reply, 5,000 times per try, five
tries interleaved: a blocking socket; asyncio streams; an asyncio Protocol with one future per
reply; ``loop.sock_sendall``/``loop.sock_recv``. Prints the median round trips per second.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import sys
import time

REQUEST = b"mn\r\n"


def blocking(port: int, n: int) -> float:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    started = time.perf_counter()
    for _ in range(n):
        s.sendall(REQUEST)
        s.recv(64)
    rate = n / (time.perf_counter() - started)
    s.close()
    return rate


async def streams(port: int, n: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.perf_counter()
    for _ in range(n):
        writer.write(REQUEST)
        await reader.readuntil(b"\r\n")
    rate = n / (time.perf_counter() - started)
    writer.close()
    return rate


class _Replies(asyncio.Protocol):
    def __init__(self) -> None:
        self.reply: asyncio.Future[bytes] | None = None

    def data_received(self, data: bytes) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.set_result(data)


async def protocol(port: int, n: int) -> float:
    loop = asyncio.get_running_loop()
    transport, replies = await loop.create_connection(_Replies, "127.0.0.1", port)
    started = time.perf_counter()
    for _ in range(n):
        replies.reply = loop.create_future()
        transport.write(REQUEST)
        await replies.reply
    rate = n / (time.perf_counter() - started)
    transport.close()
    return rate


async def sock_calls(port: int, n: int) -> float:
    loop = asyncio.get_running_loop()
    s = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    started = time.perf_counter()
    for _ in range(n):
        await loop.sock_sendall(s, REQUEST)
        await loop.sock_recv(s, 64)
    rate = n / (time.perf_counter() - started)
    s.close()
    return rate


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 11211
    n = 5000
    loop = asyncio.new_event_loop()
    rates: dict[str, list[float]] = {"blocking socket": [], "asyncio streams": [],
                                     "asyncio Protocol": [], "loop.sock_recv": []}  # fmt: skip
    for _ in range(5):
        rates["blocking socket"].append(blocking(port, n))
        rates["asyncio streams"].append(loop.run_until_complete(streams(port, n)))
        rates["asyncio Protocol"].append(loop.run_until_complete(protocol(port, n)))
        rates["loop.sock_recv"].append(loop.run_until_complete(sock_calls(port, n)))
    base = statistics.median(rates["blocking socket"])
    for kind, values in rates.items():
        rate = statistics.median(values)
        print(f"{kind:18} {rate:9,.0f} round trips/s  {rate / base:.2f}x blocking")


if __name__ == "__main__":
    main()
