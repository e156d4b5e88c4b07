"""Who holds a lease: host, pid, process start time, thread, and the caller's metadata.

The owner *identity* is informative only (shown by ``inspect``/``ls``). What guards release
and extend is a random owner *token* that never leaves the process except to the store.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from latchkey.errors import ConfigError


def new_owner_token() -> str:
    """128 random bits, hex: the secret that proves an acquisition is ours."""
    return os.urandom(16).hex()  # what secrets.token_hex(16) does, minus a call


def _process_start_time() -> float:
    """Unix time this process started (Linux: from /proc; elsewhere: first import)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat", encoding="ascii") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORT_TIME


_IMPORT_TIME = time.time()
_started: dict[int, float] = {}


def process_started() -> float:
    pid = os.getpid()
    if pid not in _started:  # recomputed after fork
        _started[pid] = round(_process_start_time(), 2)
    return _started[pid]


@dataclass(frozen=True)
class Owner:
    """Who acquired a lease. ``metadata`` is the caller's own ``metadata=`` dict."""

    host: str = ""
    pid: int = 0
    started: float = 0.0
    thread: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def current(cls, metadata: Mapping[str, Any] | None = None) -> Owner:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=process_started(),
            thread=threading.current_thread().name,
            metadata=dict(metadata or {}),
        )

    def to_json(self) -> str:
        data = {"host": self.host, "pid": self.pid, "started": self.started, "thread": self.thread}
        if self.metadata:
            data["metadata"] = dict(self.metadata)
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes | None) -> Owner:
        """Parse what :meth:`to_json` wrote; anything unreadable becomes an empty Owner."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
            return cls(
                host=str(data.get("host", "")),
                pid=int(data.get("pid", 0)),
                started=float(data.get("started", 0.0)),
                thread=str(data.get("thread", "")),
                metadata=dict(data.get("metadata") or {}),
            )
        except (ValueError, TypeError, AttributeError):
            return cls()

    def __str__(self) -> str:
        return f"{self.pid}@{self.host}" if self.host or self.pid else "unknown"


_owner_json_cache: dict[tuple[int, str, str], str] = {}


def _forget_owner_json() -> None:
    _owner_json_cache.clear()  # a forked child is another process: another pid and start


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_owner_json)


def current_owner_json(metadata_json: str = "") -> str:
    """``Owner.current(metadata).to_json()``, cached per thread and metadata (the cache is
    emptied in a forked child): it is computed on every acquire. ``metadata_json`` is the
    caller's metadata as canonical JSON."""
    thread = threading.current_thread()
    key = (thread.ident or 0, thread.name, metadata_json)
    text = _owner_json_cache.get(key)
    if text is None:
        if len(_owner_json_cache) > 1024:
            _owner_json_cache.clear()
        metadata = json.loads(metadata_json) if metadata_json else None
        text = _owner_json_cache[key] = Owner.current(metadata).to_json()
    return text


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``metadata=`` dict must be JSON-serialisable; say so clearly when it is not."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata: expected a dict, got {type(metadata).__name__}")
    try:
        json.dumps(dict(metadata))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"metadata: not JSON-serialisable ({exc})") from None
    return dict(metadata)
