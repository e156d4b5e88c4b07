"""The ``latchkey`` command: run a command under a lock, inspect and operate the store.

Exit codes follow sysexits: 0 ok (``run``: the command's own status), 69 store unavailable,
70 internal error, 75 busy, 78 bad URL, option, duration or name; ``run`` exits 79 when the
lease was lost while the command ran (even if the command succeeded: two copies may have
overlapped); a command killed by signal N gives 128+N, a command that cannot be started 127.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import Any, NoReturn

from latchkey import __version__
from latchkey._durations import format_duration, parse_duration, parse_ttl, parse_wait
from latchkey._lock import Lock
from latchkey._store import Store, connect
from latchkey._types import LockInfo, RowState
from latchkey._url import StoreURL, mask_secrets
from latchkey.errors import (
    ConfigError,
    InvalidName,
    InvalidValue,
    LatchkeyError,
    StoreUnavailable,
    Unsupported,
)

EX_OK, EX_USAGE, EX_UNAVAILABLE, EX_SOFTWARE, EX_TEMPFAIL, EX_CONFIG = 0, 64, 69, 70, 75, 78
#: ``run``: the lease was lost while the command ran (not a sysexits code: none means this).
EX_LOST = 79
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line and exit 78 (EX_CONFIG), as for a bad URL."""

    def error(self, message: str) -> NoReturn:
        # argparse echoes what it could not read, a URL with its password included
        message = mask_secrets(message)
        self.exit(EX_CONFIG, f"latchkey: {message} (see latchkey {self._sub()}--help)\n")

    def _sub(self) -> str:
        parts = self.prog.split()[1:]
        return " ".join(parts) + " " if parts else ""


def build_parser() -> argparse.ArgumentParser:
    url_help = "store URL (default: $LATCHKEY_URL, else SQLite in the user's state directory)"
    common = _Parser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=url_help)
    parser = _Parser(
        prog="latchkey",
        description="Locks, limits and claims for the databases you already run.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"latchkey {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser(
        "run",
        parents=[common],
        help="run a command while holding a lock",
        description="Run CMD only if NAME is free (the cron double-run guard).",
    )
    run.add_argument("name", metavar="NAME")
    run.add_argument("--ttl", default="10m", help="lease length, renewed while CMD runs (10m)")
    run.add_argument("--wait", default="0", help="how long to wait for the lock: 0, 30s, forever")
    run.add_argument("--at-least", default="0", help="keep the lock this long even if CMD ends")
    run.add_argument("--limit", type=int, default=1, help="a semaphore: at most N at once")
    run.add_argument("--skip-busy", action="store_true", help="busy: exit 0 silently (cron)")
    run.add_argument(
        "--kill-on-lost", action="store_true", help="terminate CMD if the lease is lost"
    )
    run.add_argument(
        "--kill-after",
        default="10s",
        help="after terminating CMD (--kill-on-lost), SIGKILL it if still running (10s)",
    )
    run.add_argument("cmd", nargs="*", metavar="-- CMD ARGS", help="the command, after --")

    ls = sub.add_parser("ls", parents=[common], help="list held locks")
    ls.add_argument("--prefix", default="", help="only names starting with this")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument(
        "--sort",
        choices=("name", "age", "expires", "waiting"),
        default="name",
        help="name (default), age (held longest first), expires (ending soonest first), "
        "waiting (most processes waiting first)",
    )
    ls.add_argument(
        "--watch",
        nargs="?",
        const="2s",
        metavar="INTERVAL",
        help="refresh every INTERVAL (2s) until Ctrl-C; with --json, one JSON line each time",
    )
    ls.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N refreshes")

    show = sub.add_parser("show", parents=[common], help="show one lock's holders")
    show.add_argument("name", metavar="NAME")
    show.add_argument("--json", action="store_true", help="machine-readable output")

    release = sub.add_parser("release", parents=[common], help="drop a lock someone holds")
    release.add_argument("name", metavar="NAME")
    release.add_argument("--force", action="store_true", help="required: this ends another's lease")
    release.add_argument("--json", action="store_true", help="machine-readable output")

    purge = sub.add_parser("purge", parents=[common], help="delete expired lease rows")
    purge.add_argument("--json", action="store_true", help="machine-readable output")

    check = sub.add_parser(
        "check",
        parents=[common],
        help="reach, write, read, delete a probe; round trip; clock offset",
    )
    check.add_argument("--json", action="store_true", help="machine-readable output")

    rows = sub.add_parser(
        "rows",
        parents=[common],
        help="the due rows of a table: free, leased (by whom, until) or locked",
        description="What a queue of rows claimed with store.rows(...) looks like right now: "
        "its due rows, each one free, leased (owner, token, until when) or locked by a take's "
        "transaction. SQL stores; the table is in the store's database.",
    )
    rows.add_argument("table", metavar="TABLE")
    rows.add_argument("--key", default="id", help="the key column (id)")
    rows.add_argument("--where", default=None, help="which rows are due (SQL, as the workers')")
    rows.add_argument("--order-by", default=None, help="their order (SQL)")
    rows.add_argument("--limit", type=int, default=50, help="show at most N rows (50)")
    rows.add_argument("--json", action="store_true", help="machine-readable output")

    sub.add_parser("init", parents=[common], help="create the store's tables now")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in words:  # everything after the first -- is the command, options included
        at = words.index("--")
        words, command = words[:at], words[at + 1 :]
    args = parser.parse_args(_glue_values(words))
    if args.command == "run":
        if args.cmd:
            return _fail(
                EX_CONFIG,
                f"run: put -- before the command: latchkey run NAME -- {args.cmd[0]} … "
                "(see latchkey run --help)",
            )
        args.cmd = command
    elif command:
        parser.error(f"{args.command}: unexpected command after --")
    if args.command is None:
        parser.print_help()
        return EX_USAGE
    try:
        with contextlib.closing(connect(getattr(args, "url", None))) as store:
            handler = globals()[f"cmd_{args.command}"]
            return int(handler(args, store))
    except (ConfigError, InvalidName, InvalidValue, Unsupported) as exc:
        # Unsupported: the store chosen by the URL cannot do this, a config matter
        return _fail(EX_CONFIG, str(exc), args)
    except StoreUnavailable as exc:
        return _fail(EX_UNAVAILABLE, str(exc), args)
    except LatchkeyError as exc:
        return _fail(EX_SOFTWARE, str(exc))
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


#: Options whose value may start with "-" (a negative duration gets a message about the
#: duration, not argparse's "expected one argument").
_VALUE_OPTIONS = ("--ttl", "--wait", "--at-least", "--kill-after", "--prefix", "--where")


def _glue_values(words: list[str]) -> list[str]:
    """``--ttl -5s`` → ``--ttl=-5s``, so that the duration parser judges the value."""
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        following = words[i + 1] if i + 1 < len(words) else None
        if (
            following is not None
            and following.startswith("-")
            and (
                word in _VALUE_OPTIONS
                or (word == "--watch" and following[1:2].isdigit())  # its value is optional
            )
        ):
            out.append(f"{word}={following}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def _redacted_url(args: argparse.Namespace) -> str | None:
    url = getattr(args, "url", None) or os.environ.get("LATCHKEY_URL")
    if not url:
        return None
    try:
        return StoreURL.parse(url).redacted()
    except ConfigError:
        return None


def _fail(code: int, message: str, args: argparse.Namespace | None = None) -> int:
    """Say ``message`` on stderr; ``check --json`` says it on stdout too (scripts read it)."""
    if args is not None and args.command == "check" and getattr(args, "json", False):
        print(json.dumps({"url": _redacted_url(args), "ok": False, "error": message}))
    print(f"latchkey: {message}", file=sys.stderr)
    return code


# -- run ---------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace, store: Store) -> int:
    cmd = args.cmd
    if not cmd:
        raise ConfigError("run: no command given (latchkey run NAME -- CMD ARGS…)")
    ttl = parse_ttl(args.ttl, what="--ttl")
    wait = parse_wait(args.wait, what="--wait")
    at_least = parse_duration(args.at_least, what="--at-least")
    kill_after = parse_duration(args.kill_after, what="--kill-after")
    if args.limit < 1:
        raise ConfigError(f"--limit must be ≥ 1, got {args.limit}")
    metadata = {"command": shlex.join(cmd)[:200]}
    lock: Lock
    if args.limit > 1:
        lock = store.semaphore(
            args.name, args.limit, ttl=ttl, wait=wait, renew=True, metadata=metadata
        )
    else:
        lock = store.lock(args.name, ttl=ttl, wait=wait, renew=True, metadata=metadata)
    started = time.monotonic()
    if not lock.acquire():
        if args.skip_busy:
            return EX_OK
        return _fail(EX_TEMPFAIL, f"{args.name!r} is busy: {_holder_text(lock, store)}")
    env = {
        **os.environ,
        "LATCHKEY_NAME": args.name,
        "LATCHKEY_TOKEN": "" if lock.token is None else str(lock.token),
    }
    try:
        child = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        lock.release()
        return _fail(127, f"cannot run {cmd[0]!r}: {exc.strerror or exc}")
    with _forward_signals(child):
        status = _supervise(child, lock, args.kill_on_lost, kill_after)
    lost = lock.lost
    if not _finish(lock, at_least - (time.monotonic() - started)) and not lost:
        lost = True  # the release found the lease already gone: it ended while CMD ran
        print(f"latchkey: the lock {args.name!r} had ended before the command did", file=sys.stderr)
    status = status if status >= 0 else 128 - status
    if lost:
        message = (
            f"lost the lock {args.name!r} while the command ran (the command exited "
            f"{status}); another copy may have run at the same time"
        )
        return _fail(EX_LOST, message)
    return status


def _holder_text(lock: Lock, store: Store) -> str:
    text = lock._busy_text()
    if lock.holder is not None and lock.holder.expires_at is not None:
        with contextlib.suppress(LatchkeyError):
            left = (lock.holder.expires_at - store.now()).total_seconds()
            text += f" (in {format_duration(max(0.0, left))})"
    return text


@contextlib.contextmanager
def _forward_signals(child: subprocess.Popen[bytes]) -> Iterator[None]:
    """Pass our signals on to the command. A terminal's Ctrl-C already reaches the command
    (same foreground process group), so SIGINT is forwarded only when we are not in one."""

    def forward(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and _in_terminal_foreground():
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _in_terminal_foreground() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def _supervise(
    child: subprocess.Popen[bytes], lock: Lock, kill_on_lost: bool, kill_after: float
) -> int:
    """Wait for the command; report a lost lease once (and stop the command if asked: SIGTERM,
    then SIGKILL after ``kill_after`` seconds if it is still running)."""
    reported = False
    killed_at: float | None = None
    while True:
        try:
            return child.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        if lock.lost and not reported:
            reported = True
            action = "terminating the command" if kill_on_lost else "the command keeps running"
            print(
                f"latchkey: lost the lock {lock.name!r} while the command ran; {action}",
                file=sys.stderr,
            )
            if kill_on_lost:
                child.terminate()
                killed_at = time.monotonic()
        if killed_at is not None and time.monotonic() - killed_at >= kill_after:
            child.kill()
            killed_at = None


def _finish(lock: Lock, keep: float) -> bool:
    """Release, or keep the lease for the rest of ``--at-least`` and then let it expire.
    False if the store said the lease had already ended; True otherwise (also when the store
    could not be asked: that is reported, and is not proof of a loss)."""
    try:
        return lock._finish(keep)
    except LatchkeyError as exc:
        print(f"latchkey: could not release {lock.name!r}: {exc}", file=sys.stderr)
        return True


# -- inspection ----------------------------------------------------------------------------------


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat(timespec="milliseconds")


def _info_json(info: LockInfo, now: datetime) -> dict[str, Any]:
    return {
        "name": info.name,
        "waiting_processes": info.waiting_processes,
        "holders": [
            {
                "token": h.token,
                "owner": {
                    "host": h.owner.host,
                    "pid": h.owner.pid,
                    "started": h.owner.started,
                    "thread": h.owner.thread,
                    "metadata": dict(h.owner.metadata),
                },
                "acquired_at": _iso(h.acquired_at),
                "expires_at": _iso(h.expires_at),
                "expires_in": None
                if h.expires_at is None
                else round((h.expires_at - now).total_seconds(), 3),
            }
            for h in info.holders
        ],
    }


#: The columns of ``ls`` and ``show``: one row per holder; PROCS WAITING is the name's (how
#: many processes wait for it, ``-`` where the store cannot tell), on each of its rows.
HEADER = ["NAME", "TOKEN", "OWNER", "SINCE", "EXPIRES IN", "PROCS WAITING"]


def _rows(infos: Sequence[LockInfo], now: datetime) -> list[list[str]]:
    rows = []
    for info in infos:
        waiting = "-" if info.waiting_processes is None else str(info.waiting_processes)
        for h in info.holders:
            since = (
                "-"
                if h.acquired_at is None
                else format_duration(max(0.0, (now - h.acquired_at).total_seconds())) + " ago"
            )
            expires = (
                "-"
                if h.expires_at is None
                else format_duration(max(0.0, (h.expires_at - now).total_seconds()))
            )
            token = "-" if h.token is None else str(h.token)
            rows.append([info.name, token, str(h.owner), since, expires, waiting])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    shown = [[_printable(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in [header, *shown]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *shown]
    ]
    return "\n".join(lines)


def _printable(text: str) -> str:
    """Names may hold control characters; never let them reach the terminal raw."""
    return text if text.isprintable() else repr(text)[1:-1]


_FOREVER = datetime.max.replace(tzinfo=timezone.utc)
_SORT_KEYS = {
    "name": lambda info: info.name,
    "age": lambda info: (info.acquired_at or _FOREVER, info.name),
    "expires": lambda info: (info.expires_at or _FOREVER, info.name),
    "waiting": lambda info: (-(info.waiting_processes or 0), info.name),
}


def cmd_ls(args: argparse.Namespace, store: Store) -> int:
    if args.count is not None and (args.count < 1 or args.watch is None):
        raise ConfigError("--count: a number of refreshes ≥ 1, with --watch")
    if args.watch is None:
        print(_listing(args, store))
        return EX_OK
    interval = parse_duration(args.watch, what="--watch")
    if interval <= 0:
        raise ConfigError(f"--watch: expected a positive interval, got {args.watch!r}")
    return _watch(args, store, interval)


def _listing(args: argparse.Namespace, store: Store) -> str:
    infos = sorted(store.list(prefix=args.prefix), key=_SORT_KEYS[args.sort])
    now = store.now()
    if args.json:
        return json.dumps([_info_json(i, now) for i in infos], ensure_ascii=False)
    if infos:
        return _table(HEADER, _rows(infos, now))
    return "no locks held" + (f" with prefix {args.prefix!r}" if args.prefix else "")


def _watch(args: argparse.Namespace, store: Store, interval: float) -> int:
    """``ls --watch``: the listing again every ``interval``, until Ctrl-C (exit 0) or
    ``--count`` refreshes. An outage is shown in its frame and the watch goes on (an operator
    watches a stalled system); the exit status is that of the last refresh. With ``--json``,
    one line per refresh: ``{"at": …, "locks": [...]}`` or ``{"at": …, "error": "…"}``."""
    tty = sys.stdout.isatty() and not args.json
    head = f"{_redacted_url(args) or 'the default store'}  every {format_duration(interval)}"
    status, shown = EX_OK, 0
    try:
        while args.count is None or shown < args.count:
            stamp = datetime.now().astimezone().isoformat(timespec="seconds")
            try:
                body, status = _listing(args, store), EX_OK
            except StoreUnavailable as exc:
                body, status = str(exc), EX_UNAVAILABLE
            if args.json:
                field = ("locks", json.loads(body)) if status == EX_OK else ("error", body)
                print(json.dumps({"at": stamp, field[0]: field[1]}, ensure_ascii=False))
            else:
                if status != EX_OK:
                    body = f"store unavailable: {body}"
                clear = "\x1b[H\x1b[2J" if tty else ""
                print(f"{clear}{head}  {stamp}\n\n{body}\n")
            sys.stdout.flush()
            shown += 1
            if args.count is None or shown < args.count:
                time.sleep(interval)
    except KeyboardInterrupt:
        return EX_OK  # stopping a watch is how it ends
    return status


def cmd_show(args: argparse.Namespace, store: Store) -> int:
    info = store.inspect(args.name)
    now = store.now()
    if args.json:
        data = _info_json(info, now) if info else {"name": args.name, "holders": []}
        print(json.dumps({**data, "free": info is None}, ensure_ascii=False))
        return EX_OK
    if info is None:
        print(f"{_printable(args.name)} is free")
        return EX_OK
    print(_table(HEADER, _rows([info], now)))
    for h in info.holders:
        details = f"  {h.owner}: started {_iso_or_dash(h.owner.started)} thread {h.owner.thread}"
        if h.owner.metadata:
            details += f" metadata {json.dumps(dict(h.owner.metadata), ensure_ascii=False)}"
        print(details)
    return EX_OK


def _iso_or_dash(started: float) -> str:
    if not started:
        return "-"
    return datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds")


def cmd_release(args: argparse.Namespace, store: Store) -> int:
    if not args.force:
        raise ConfigError(
            f"release {args.name!r}: this ends whoever holds it; add --force to confirm"
        )
    dropped = store.force_release(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "released": dropped}, ensure_ascii=False))
    else:
        print(
            f"released {_printable(args.name)}"
            if dropped
            else f"{_printable(args.name)} was not held"
        )
    return EX_OK


def cmd_purge(args: argparse.Namespace, store: Store) -> int:
    count = store.purge_expired()
    print(json.dumps({"purged": count}) if args.json else f"purged {count} expired lease(s)")
    return EX_OK


def cmd_check(args: argparse.Namespace, store: Store) -> int:
    health = store.check()
    caps = health.capabilities
    flags = {name: getattr(caps, name) for name in caps.__dataclass_fields__}
    if args.json:
        print(
            json.dumps(
                {
                    "url": health.url,
                    "ok": True,
                    "round_trip_ms": round(health.round_trip * 1000, 3),
                    "clock_offset_ms": round(health.clock_offset * 1000, 3),
                    "probe_ms": round(health.probe * 1000, 3),
                    "capabilities": flags,
                }
            )
        )
        return EX_OK
    offset = health.clock_offset * 1000
    side = "ahead of" if offset >= 0 else "behind"
    print(f"store:         {health.url}")
    print("reach:         ok")
    print(f"round trip:    {health.round_trip * 1000:.2f} ms (median of 5 clock reads)")
    print(f"clock offset:  store is {abs(offset):.1f} ms {side} the local clock")
    print(f"probe:         acquire, inspect, release ok in {health.probe * 1000:.2f} ms")
    print(f"guarantees:    {', '.join(k for k, v in flags.items() if v)}")
    missing = [k for k, v in flags.items() if not v]
    if missing:
        print(f"not provided:  {', '.join(missing)}")
    return EX_OK


def cmd_rows(args: argparse.Namespace, store: Store) -> int:
    queue = store.rows(args.table, key=args.key, where=args.where, order_by=args.order_by)
    if args.limit < 1:
        raise ConfigError(f"--limit must be ≥ 1, got {args.limit}")
    try:
        states = queue.status(limit=args.limit)
    except LatchkeyError:
        raise
    except Exception as exc:  # the database refused the query: a bad --where, table or key
        raise ConfigError(f"rows: the database refused the query: {exc}") from exc
    now = store.now()
    if args.json:
        print(json.dumps([_row_json(state, now) for state in states], ensure_ascii=False))
        return EX_OK
    if not states:
        print(f"no due rows in {args.table}" + (f" where {args.where}" if args.where else ""))
        return EX_OK
    table = []
    for state in states:
        lease = state.lease
        until = "-"
        if lease is not None and lease.expires_at is not None:
            until = "in " + format_duration(max(0.0, (lease.expires_at - now).total_seconds()))
        table.append(
            [
                str(state.key),
                state.state,
                "-" if lease is None or lease.token is None else str(lease.token),
                "-" if lease is None else str(lease.owner),
                until,
            ]
        )
    print(_table([args.key.upper(), "STATE", "TOKEN", "LEASED BY", "UNTIL"], table))
    counts = {name: sum(1 for s in states if s.state == name) for name in ("free", "leased")}
    locked = sum(1 for s in states if s.locked)
    more = " (--limit reached)" if len(states) >= args.limit else ""
    print(
        f"{len(states)} due row(s){more}: {counts['free']} free, {counts['leased']} leased, "
        + ("locks unknown (SQLite)" if states[0].locked is None else f"{locked} locked")
    )
    return EX_OK


def _row_json(state: RowState, now: datetime) -> dict[str, Any]:
    lease = state.lease
    return {
        "key": state.key if isinstance(state.key, int | str | float) else str(state.key),
        "state": state.state,
        "locked": state.locked,
        "lease": None
        if lease is None
        else {
            "token": lease.token,
            "owner": {
                "host": lease.owner.host,
                "pid": lease.owner.pid,
                "thread": lease.owner.thread,
                "metadata": dict(lease.owner.metadata),
            },
            "acquired_at": _iso(lease.acquired_at),
            "expires_at": _iso(lease.expires_at),
            "expires_in": None
            if lease.expires_at is None
            else round((lease.expires_at - now).total_seconds(), 3),
        },
    }


def cmd_init(args: argparse.Namespace, store: Store) -> int:
    store.init()
    print(f"initialised {store.url}")
    return EX_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
