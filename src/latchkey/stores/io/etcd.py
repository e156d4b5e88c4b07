"""etcd v3 over its JSON gateway with ``httpx``: the sync driver of ``etcd://``.

Why this client. The PyPI ``etcd3`` package is unmaintained (no release since 2020) and needs
the pure-Python protobuf implementation with current protobuf; ``etcd3gw`` is sync only. etcd
itself serves its v3 API as JSON on the client port (``/v3/kv/range``, ``/v3/kv/txn``,
``/v3/lease/grant`` …, since 3.4 under ``/v3/``), so one well-kept HTTP client with a sync and
an asyncio flavour — ``httpx``: connection pooling, a timeout on connect, read, write and pool
— carries every unary call with the same request bodies in both APIs. Keys and values travel
base64-encoded and 64-bit integers as decimal strings (protobuf's JSON mapping); fields equal
to zero are left out of replies.

Requests of the store (:mod:`latchkey.stores.etcd`):

- :class:`Post`: one unary call, ``POST <endpoint><path>`` with a JSON body → the reply's JSON
  object. An error reply (``{"error", "code"}``: a gRPC status) is raised as
  :class:`EtcdError`, which the store catches where it gives it a meaning ("requested lease not
  found", "lease already exists": :attr:`EtcdError.not_found`, :attr:`EtcdError.already_exists`)
  and the driver otherwise maps to StoreUnavailable.
- :class:`Watch`: a waiter for DELETE events on a key range, answered with a :class:`Waiter`.

Endpoints: the URL's hosts, tried in turn when one cannot be connected to (a refused or timed
out connect: the request was not sent, so sending it elsewhere is safe); the one that answered
is used first from then on. A request that was sent and got no answer is never sent again:
StoreUnavailable — and the next request starts at the next endpoint, so that a member that
accepts connections and never answers (a hung machine, a stalled process) costs one call its
timeout, not every call until it comes back.

The watch is a plain HTTP/1.1 stream on a socket of its own (:class:`WatchStream`), not an
httpx stream: a waiter needs a deadline per read (``wait(timeout)``) and a ``close`` that
unblocks at once, which a socket's own timeout and ``shutdown`` give without a reader thread.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import httpx

from latchkey.errors import ConfigError
from latchkey.stores.base import Waiter, woken
from latchkey.stores.io import Driver, after_fork

if TYPE_CHECKING:
    from latchkey.stores.base import BackendBase

DEFAULT_PORT = 2379


class EtcdError(Exception):
    """An error reply of etcd's gateway: its gRPC status ``code`` and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd error {code}: {message}")
        self.code = code
        self.message = message

    @property
    def not_found(self) -> bool:
        """etcd's "requested lease not found": the lease has ended (revoked or expired)."""
        return "not found" in self.message

    @property
    def already_exists(self) -> bool:
        """etcd's "lease already exists": a grant of a lease ID that is in use."""
        return "already exists" in self.message


class Post(NamedTuple):
    """Request: ``POST <path>`` (``/v3/kv/txn``…) with the JSON ``body`` → the reply object."""

    path: str
    body: dict[str, Any]


class Watch(NamedTuple):
    """Request: a waiter woken by DELETE events on keys ``[key, range_end)`` (base64), made
    once etcd has confirmed the watch → a :class:`Waiter` (sync) or AsyncWaiter."""

    key: str
    range_end: str


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def endpoints(backend: BackendBase) -> list[str]:
    """``http://host:port`` of each host of the URL (``?tls=true``: https)."""
    url = backend.url
    if not url.hosts:
        raise ConfigError(f"{url.scheme} store: the URL names no host")
    if url.username or url.password:
        raise ConfigError(f"{url.scheme} store: user and password are not supported yet")
    scheme = "https" if backend.config.get("tls") else "http"
    out = []
    for host, port in url.hosts:
        shown = f"[{host}]" if ":" in host else host
        out.append(f"{scheme}://{shown}:{port or DEFAULT_PORT}")
    return out


def reply_of(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of a gateway reply; an error reply raises :class:`EtcdError`."""
    try:
        data = response.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise EtcdError(-1, f"HTTP {response.status_code}: not a JSON object")
    if response.status_code != 200 or "error" in data:
        raise EtcdError(int(data.get("code", -1)), str(data.get("message") or data.get("error")))
    return data


def timeouts(seconds: float) -> httpx.Timeout:
    return httpx.Timeout(seconds)


def left_until(deadline: float) -> float:
    """Seconds left before a primitive's deadline; none left is a timeout."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpx.TimeoutException("no time left within the store's timeout")
    return left


#: Errors after which the request was surely not sent: the next endpoint may be tried.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
#: Errors after which the request may have been sent and got no answer: not sent again, but
#: the next request goes to the next endpoint first.
UNANSWERED = httpx.TransportError
ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError, EtcdError, OSError, ValueError)


class Endpoints:
    """The URL's endpoints and which one to try first (the last that answered)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.first = 0

    def order(self) -> list[str]:
        n = len(self.urls)
        return [self.urls[(self.first + i) % n] for i in range(n)]

    def tries(self, left: float) -> Iterator[tuple[str, float]]:
        """Each endpoint in :meth:`order` with the time left for it, while any is left: one
        that failed is followed by the next (the request was not sent, or a watch did not
        open) until all were tried or ``left`` seconds have passed."""
        deadline = time.monotonic() + left
        for base in self.order():
            yield base, left_until(deadline)
            if time.monotonic() >= deadline:
                return

    def answered(self, url: str) -> None:
        self.first = self.urls.index(url)

    def unanswered(self, url: str) -> None:
        """``url`` took a request and gave no answer: the next request starts at the next
        endpoint (unless another request has moved on from it already)."""
        if self.urls[self.first] == url:
            self.first = (self.first + 1) % len(self.urls)


class EtcdDriver(Driver):
    errors = ERRORS

    def __init__(self, backend: BackendBase, store: Any) -> None:
        super().__init__(backend, store)
        self.endpoints = Endpoints(endpoints(backend))
        self.timeout = backend.timeout
        self._client: httpx.Client | None = None
        self._opening = threading.Lock()
        self.hub = WatchHub()
        after_fork(self)

    def forget_after_fork(self) -> None:
        self._client = None  # the parent's sockets: neither used nor closed here
        self._opening = threading.Lock()
        self.hub = WatchHub()

    def client(self) -> httpx.Client:
        client = self._client
        if client is None:
            with self._opening:  # threads racing here would each open a client
                if self._client is None:
                    self._client = httpx.Client(
                        timeout=timeouts(self.timeout), limits=httpx.Limits(max_connections=32)
                    )
                client = self._client
        return client

    def answerer(self) -> Callable[[Any], Any]:
        """A primitive — several requests, some of them — runs within one timeout in all."""
        deadline = time.monotonic() + self.timeout
        return lambda request: self.answer(request, deadline)

    def answer(self, request: Any, deadline: float | None = None) -> Any:
        left = self.timeout if deadline is None else left_until(deadline)
        if type(request) is Post:
            return self.post(request, left)
        return self.watch(request, left)

    def post(self, request: Post, left: float) -> dict[str, Any]:
        client, error = self.client(), None
        for base, time_left in self.endpoints.tries(left):
            try:
                response = client.post(
                    base + request.path, json=request.body, timeout=timeouts(time_left)
                )
            except NOT_SENT as exc:
                error = exc
                continue
            except UNANSWERED:
                self.endpoints.unanswered(base)
                raise
            self.endpoints.answered(base)
            return reply_of(response)
        assert error is not None
        raise error

    def watch(self, request: Watch, left: float) -> Waiter:
        shared = self.hub.get(request)
        if shared is not None:
            return DeleteWaiter(self.hub, request, shared)
        error: BaseException | None = None
        for base, time_left in self.endpoints.tries(left):
            try:
                stream = WatchStream.open(base, request, time_left)
            except OSError as exc:
                error = exc
                self.endpoints.unanswered(base)  # the next request starts elsewhere too
                continue
            return DeleteWaiter(self.hub, request, self.hub.add(request, stream))
        assert error is not None
        raise error

    def close(self) -> None:
        self.hub.close()
        if self._client is not None:
            self._client.close()
            self._client = None


# -- watch: one HTTP/1.1 stream of JSON lines ------------------------------------------------


def watch_request(base: str, request: Watch) -> tuple[str, int, bytes]:
    """Host, port and the bytes of the watch's HTTP request (``filters: NOPUT``: only
    deletions are sent)."""
    if base.startswith("https://"):
        raise OSError("watches over TLS are not supported yet")
    hostport = base.split("://", 1)[1]
    host, _, port = hostport.rpartition(":")
    body = json.dumps(
        {
            "create_request": {
                "key": request.key,
                "range_end": request.range_end,
                "filters": ["NOPUT"],
            }
        }
    ).encode()
    head = (
        f"POST /v3/watch HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return host.strip("[]"), int(port), head + body


class StreamParser:
    """Bytes of a chunked HTTP response in, JSON messages out (one per line)."""

    def __init__(self) -> None:
        self.raw = b""
        self.headers_done = False
        self.body = b""
        self.ended = False

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        if not data:
            self.ended = True
        self.raw += data
        if not self.headers_done:
            head, sep, rest = self.raw.partition(b"\r\n\r\n")
            if not sep:
                return []
            status_line = head.split(b"\r\n", 1)[0]
            if status_line.split()[1:2] != [b"200"]:
                raise OSError(f"watch refused: {status_line.decode(errors='replace')}")
            self.headers_done, self.raw = True, rest
        while True:  # de-chunk what is complete
            size_line, sep, rest = self.raw.partition(b"\r\n")
            if not sep:
                break
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                self.ended = True
                break
            if len(rest) < size + 2:
                break
            self.body += rest[:size]
            self.raw = rest[size + 2 :]
        messages = []
        while b"\n" in self.body:
            line, self.body = self.body.split(b"\n", 1)
            if line.strip():
                messages.append(json.loads(line))
        return messages


def is_created(message: dict[str, Any]) -> bool:
    result = message.get("result") or {}
    if "error" in message:
        raise OSError(f"watch failed: {message.get('error')}")
    return bool(result.get("created"))


def deletions(messages: list[dict[str, Any]]) -> int:
    """How many DELETE events (freed slots) the messages carry; a cancelled watch counts as
    one (its waiters then try again)."""
    count = 0
    for message in messages:
        result = message.get("result") or {}
        if result.get("canceled"):
            count += 1
        count += sum(e.get("type") == "DELETE" for e in result.get("events") or ())
    return count


class WatchStream:
    """One watch on a socket of its own: opened, confirmed (``created``), then read with a
    deadline per read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = StreamParser()

    @classmethod
    def open(cls, base: str, request: Watch, timeout: float) -> WatchStream:
        host, port, payload = watch_request(base, request)
        sock = socket.create_connection((host, port), timeout=timeout)
        stream = cls(sock)
        try:
            sock.sendall(payload)
            deadline = time.monotonic() + timeout
            if not stream.read_until(is_created, deadline):
                raise TimeoutError(f"etcd did not confirm a watch within {timeout:g}s")
        except BaseException:
            stream.close()
            raise
        return stream

    def read_until(self, found: Callable[[dict[str, Any]], bool], deadline: float) -> bool:
        """Read messages until one satisfies ``found`` (True) or the deadline passes (False).
        A closed stream raises OSError."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return False
            messages = self.parser.feed(data)
            if any(found(m) for m in messages):
                return True
            if self.parser.ended:
                raise OSError("etcd closed the watch")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class SharedWatch:
    """One watch on a name's slots, shared by every waiter of that name in this driver, read
    by a thread of its own. Each DELETE event (one freed slot) wakes *one* waiter, the one
    waiting longest that is not woken yet: a release wakes one waiter per process, not every
    waiter (no herd); a waiter whose wake-up came to nothing stays first in line, and the
    others still try again when the core's backoff delay ends (at most a second)."""

    def __init__(self, stream: WatchStream) -> None:
        self.stream = stream
        self.line: list[threading.Event] = []
        self.guard = threading.Lock()
        self.broken = False
        threading.Thread(target=self._read, name="latchkey-etcd-watch", daemon=True).start()

    def _read(self) -> None:
        sock, parser = self.stream.sock, self.stream.parser
        try:
            sock.settimeout(None)
            while not parser.ended:
                self.wake(deletions(parser.feed(sock.recv(65536))))
        except (OSError, ValueError):
            pass
        with self.guard:
            self.broken = True
            for event in self.line:
                event.set()

    def wake(self, count: int) -> None:
        with self.guard:
            for event in self.line:
                if count <= 0:
                    break
                if not event.is_set():
                    event.set()
                    count -= 1

    def join(self) -> threading.Event:
        event = threading.Event()
        with self.guard:
            self.line.append(event)
        return event

    def leave(self, event: threading.Event) -> bool:
        """Leave the line (a wake-up not taken goes to the next); True if it is now empty."""
        with self.guard:
            self.line.remove(event)
            empty = not self.line
        if event.is_set() and not self.broken:
            self.wake(1)
        return empty


class DeleteWaiter(Waiter):
    """A place in a :class:`SharedWatch`'s line."""

    def __init__(self, hub: WatchHub, key: Watch, shared: SharedWatch) -> None:
        self.hub, self.key, self.shared = hub, key, shared
        self.event: threading.Event | None = shared.join()

    def wait(self, timeout: float) -> bool:
        event = self.event
        if event is None or self.shared.broken:
            time.sleep(max(0.0, timeout))  # the watch broke (etcd restarted, say): poll
            return False
        return woken(event, timeout) and not self.shared.broken

    def close(self) -> None:
        event, self.event = self.event, None
        if event is not None:
            self.hub.leave(self.key, self.shared, event)


class WatchHub:
    """The shared watches of one driver, by watched range."""

    def __init__(self) -> None:
        self.watches: dict[Watch, SharedWatch] = {}
        self.guard = threading.Lock()

    def get(self, key: Watch) -> SharedWatch | None:
        shared = self.watches.get(key)
        return None if shared is None or shared.broken else shared

    def add(self, key: Watch, stream: WatchStream) -> SharedWatch:
        with self.guard:
            shared = self.get(key)
            if shared is not None:  # another thread opened one meanwhile
                stream.close()
                return shared
            shared = self.watches[key] = SharedWatch(stream)
            return shared

    def leave(self, key: Watch, shared: SharedWatch, event: threading.Event) -> None:
        with self.guard:
            if shared.leave(event):
                if self.watches.get(key) is shared:
                    del self.watches[key]
                shared.stream.close()

    def close(self) -> None:
        with self.guard:
            watches, self.watches = self.watches, {}
        for shared in watches.values():
            shared.stream.close()
