"""The ``latchkey`` command as a user runs it, on the embedded SQLite store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import eventually

EXE = Path(sys.executable).parent / "latchkey"
LATCHKEY = [str(EXE)] if EXE.exists() else [sys.executable, "-m", "latchkey"]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "LATCHKEY_URL": f"sqlite:///{tmp_path}/locks.db"}


def latchkey(
    env: dict[str, str], *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LATCHKEY, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def holder(env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """``latchkey run nightly`` holding the lock until the file ``stop`` appears."""
    script = f"touch {tmp_path}/started; while [ ! -e {tmp_path}/stop ]; do sleep 0.02; done"
    proc = subprocess.Popen(
        [*LATCHKEY, "run", "nightly", "--ttl", "1m", "--", "sh", "-c", script],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    eventually(lambda: (tmp_path / "started").exists(), timeout=30, what="holder started")
    yield proc
    (tmp_path / "stop").touch()
    proc.wait(timeout=30)


def test_run_passes_name_token_and_status(env: dict[str, str]) -> None:
    result = latchkey(
        env, "run", "job", "--", "sh", "-c", 'echo "$LATCHKEY_NAME $LATCHKEY_TOKEN"; exit 3'
    )
    assert result.returncode == 3
    name, token = result.stdout.split()
    assert name == "job" and int(token) > 0


def test_second_run_is_busy_and_names_the_holder(
    env: dict[str, str], holder: subprocess.Popen[str], tmp_path: Path
) -> None:
    busy = latchkey(env, "run", "nightly", "--", "true")
    assert busy.returncode == 75
    assert f"{holder.pid}@" in busy.stderr and "until" in busy.stderr
    assert len(busy.stderr.strip().splitlines()) == 1
    skipped = latchkey(env, "run", "nightly", "--skip-busy", "--", "true")
    assert skipped.returncode == 0 and skipped.stdout == skipped.stderr == ""
    listing = latchkey(env, "ls")
    assert listing.returncode == 0
    assert "nightly" in listing.stdout and f"{holder.pid}@" in listing.stdout
    assert listing.stdout.splitlines()[0].split() == [
        "NAME",
        "TOKEN",
        "OWNER",
        "SINCE",
        "EXPIRES",
        "IN",
        "PROCS",
        "WAITING",
    ]
    assert listing.stdout.splitlines()[1].split()[-1] == "-"  # SQLite cannot tell
    (tmp_path / "stop").touch()
    assert holder.wait(timeout=30) == 0
    assert latchkey(env, "ls").stdout.strip() == "no locks held"
    assert latchkey(env, "run", "nightly", "--", "true").returncode == 0


def test_json_output(env: dict[str, str], holder: subprocess.Popen[str]) -> None:
    listed = json.loads(latchkey(env, "ls", "--json").stdout)
    assert [item["name"] for item in listed] == ["nightly"]
    assert listed[0]["holders"][0]["owner"]["pid"] == holder.pid
    assert listed[0]["holders"][0]["expires_in"] > 0
    assert listed[0]["waiting_processes"] is None  # SQLite cannot tell
    shown = json.loads(latchkey(env, "show", "nightly", "--json").stdout)
    assert (
        shown["free"] is False and shown["holders"][0]["token"] == listed[0]["holders"][0]["token"]
    )
    assert json.loads(latchkey(env, "show", "other", "--json").stdout)["free"] is True


def test_wait_then_run(env: dict[str, str], holder: subprocess.Popen[str], tmp_path: Path) -> None:
    waiter = subprocess.Popen(
        [*LATCHKEY, "run", "nightly", "--wait", "60s", "--", "true"], env=env, text=True
    )
    eventually(lambda: latchkey(env, "ls").stdout.count("nightly") == 1, what="holder listed")
    (tmp_path / "stop").touch()
    assert waiter.wait(timeout=60) == 0


def test_bad_input_exits_78_with_one_line(env: dict[str, str]) -> None:
    for args, needle in [
        (["--url", "bogus://x", "ls"], "bogus"),
        (["run", "x", "--ttl", "10q", "--", "true"], "10q"),
        (["run", "x", "--wait", "-1", "--", "true"], "-1"),
        (["--url", "sqlite:////no/such/dir/x.db", "ls"], "/no/such/dir"),
        (["--url", "sqlite:///x.db?tabel=y", "ls"], "tabel"),
        (["run", "", "--", "true"], "empty"),
        (["run", "x", "true"], "--"),
        (["run", "x", "--"], "no command"),
    ]:
        result = latchkey(env, *args)
        assert result.returncode == 78, (args, result.stderr)
        assert needle in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)


def test_an_argument_argparse_cannot_read_is_echoed_without_its_password(
    env: dict[str, str],
) -> None:
    for args in (
        ["ls", "--store", "postgresql://app:s3cret@127.0.0.1:1/db?timeout=1"],
        ["ls", "--store", "mongodb://h:27017/db?tls=true&tlsCertificateKeyFilePassword=s3cret"],
        ["show", "x", "y", "redis://:s3cret@127.0.0.1:1/0"],
    ):
        result = latchkey(env, *args)
        assert result.returncode == 78, (args, result.stderr)
        assert "s3cret" not in result.stderr and "***" in result.stderr, result.stderr


def test_unreachable_store_exits_69_without_password(env: dict[str, str]) -> None:
    result = latchkey(env, "ls", "--url", "redis://:s3cr3t-pw@127.0.0.1:1/0?timeout=1s")
    assert result.returncode == 69
    assert "s3cr3t-pw" not in result.stderr + result.stdout
    assert "***" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_url_option_after_the_subcommand(env: dict[str, str], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/other.db"
    assert (
        latchkey(
            env, "run", "elsewhere", "--url", url, "--at-least", "30s", "--", "true"
        ).returncode
        == 0
    )
    assert "elsewhere" in latchkey(env, "--url", url, "ls").stdout
    assert "elsewhere" not in latchkey(env, "ls").stdout


def test_at_least_keeps_the_lock(env: dict[str, str]) -> None:
    assert latchkey(env, "run", "tick", "--at-least", "1m", "--", "true").returncode == 0
    assert latchkey(env, "run", "tick", "--", "true").returncode == 75
    assert latchkey(env, "release", "tick").returncode == 78  # needs --force
    released = latchkey(env, "release", "tick", "--force")
    assert released.returncode == 0 and "released tick" in released.stdout
    assert latchkey(env, "run", "tick", "--", "true").returncode == 0


def test_limit_makes_a_semaphore(env: dict[str, str], tmp_path: Path) -> None:
    script = f"touch {tmp_path}/in.$$; while [ ! -e {tmp_path}/stop ]; do sleep 0.02; done"
    procs = [
        subprocess.Popen(
            [*LATCHKEY, "run", "pool", "--limit", "2", "--", "sh", "-c", script], env=env
        )
        for _ in range(2)
    ]
    eventually(lambda: len(list(tmp_path.glob("in.*"))) == 2, timeout=30, what="two holders")
    busy = latchkey(env, "run", "pool", "--limit", "2", "--", "true")
    assert busy.returncode == 75
    assert "all 2 slots taken; the soonest to end: held by" in busy.stderr, busy.stderr
    (tmp_path / "stop").touch()
    assert [p.wait(timeout=30) for p in procs] == [0, 0]


def test_signals_are_forwarded_and_the_lock_released(env: dict[str, str], tmp_path: Path) -> None:
    script = f'trap "exit 42" TERM; touch {tmp_path}/started; while true; do sleep 0.02; done'
    proc = subprocess.Popen([*LATCHKEY, "run", "sig", "--", "sh", "-c", script], env=env)
    eventually(lambda: (tmp_path / "started").exists(), timeout=30, what="command started")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 42
    assert latchkey(env, "show", "sig").stdout.strip() == "sig is free"


def test_kill_on_lost(env: dict[str, str], tmp_path: Path) -> None:
    script = f"touch {tmp_path}/started; while true; do sleep 0.02; done"
    proc = subprocess.Popen(
        [*LATCHKEY, "run", "lossy", "--ttl", "1s", "--kill-on-lost", "--", "sh", "-c", script],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    eventually(lambda: (tmp_path / "started").exists(), timeout=30, what="command started")
    assert latchkey(env, "release", "lossy", "--force").returncode == 0
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 79  # lost: whatever the command's status (here SIGTERM's)
    assert "lost the lock" in stderr and f"exited {128 + signal.SIGTERM}" in stderr


def test_a_lost_lease_fails_the_run_even_if_the_command_succeeds(
    env: dict[str, str], tmp_path: Path
) -> None:
    script = f"touch {tmp_path}/started; while [ ! -e {tmp_path}/stop ]; do sleep 0.02; done"
    proc = subprocess.Popen(
        [*LATCHKEY, "run", "cronjob", "--ttl", "1s", "--", "sh", "-c", script],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    eventually(lambda: (tmp_path / "started").exists(), timeout=30, what="command started")
    assert latchkey(env, "release", "cronjob", "--force").returncode == 0
    (tmp_path / "stop").touch()
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 79, stderr
    assert "lost the lock 'cronjob'" in stderr and "exited 0" in stderr


def test_kill_after_sigkills_a_command_that_ignores_sigterm(
    env: dict[str, str], tmp_path: Path
) -> None:
    script = f'trap "" TERM; touch {tmp_path}/started; while true; do sleep 0.02; done'
    args = ["--ttl", "1s", "--kill-on-lost", "--kill-after", "500ms"]
    proc = subprocess.Popen(
        [*LATCHKEY, "run", "stubborn", *args, "--", "sh", "-c", script],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    eventually(lambda: (tmp_path / "started").exists(), timeout=30, what="command started")
    assert latchkey(env, "release", "stubborn", "--force").returncode == 0
    _, stderr = proc.communicate(timeout=30)  # ends only because SIGKILL followed SIGTERM
    assert proc.returncode == 79
    assert f"exited {128 + signal.SIGKILL}" in stderr


@pytest.mark.parametrize("option", ["--ttl", "--wait", "--at-least", "--kill-after"])
def test_a_negative_duration_is_named(env: dict[str, str], option: str) -> None:
    result = latchkey(env, "run", "x", option, "-5s", "--", "true")
    assert result.returncode == 78
    assert f"{option}: '-5s' is negative" in result.stderr, result.stderr


def test_check_json_says_unreachable_on_stdout(env: dict[str, str]) -> None:
    url = "postgresql://app:s3cret@127.0.0.1:1/db?timeout=1s"
    result = latchkey({**env, "LATCHKEY_URL": url}, "check", "--json")
    assert result.returncode == 69
    data = json.loads(result.stdout)
    assert data["ok"] is False and "s3cret" not in result.stdout + result.stderr
    assert data["url"] == "postgresql://app:***@127.0.0.1:1/db?timeout=1s"
    assert "unavailable" in data["error"] or "failed" in data["error"]


def test_check_json_says_a_bad_url_on_stdout(env: dict[str, str]) -> None:
    url = "postgresql://app:s3cret@127.0.0.1:1/db?bogus=1"
    result = latchkey({**env, "LATCHKEY_URL": url}, "check", "--json")
    assert result.returncode == 78
    data = json.loads(result.stdout)
    assert data["ok"] is False and "bogus" in data["error"]
    assert "s3cret" not in result.stdout + result.stderr


def test_kill_after_takes_a_duration(env: dict[str, str]) -> None:
    result = latchkey(env, "run", "x", "--kill-after", "soon", "--", "true")
    assert result.returncode == 78 and "--kill-after" in result.stderr


def test_missing_command_exits_127(env: dict[str, str]) -> None:
    result = latchkey(env, "run", "x", "--", "no-such-command-here")
    assert result.returncode == 127 and "no-such-command-here" in result.stderr
    assert latchkey(env, "show", "x").stdout.strip() == "x is free"


def test_check_reports_round_trip_and_clock(env: dict[str, str]) -> None:
    human = latchkey(env, "check")
    assert human.returncode == 0
    assert "round trip" in human.stdout and "clock offset" in human.stdout
    data = json.loads(latchkey(env, "check", "--json").stdout)
    assert data["ok"] is True and data["round_trip_ms"] >= 0
    assert abs(data["clock_offset_ms"]) < 1000  # the same machine's clock


def test_purge_and_init(env: dict[str, str]) -> None:
    assert latchkey(env, "init").returncode == 0
    assert json.loads(latchkey(env, "purge", "--json").stdout) == {"purged": 0}


def test_ls_watch_refreshes_and_sorts(env: dict[str, str], holder: subprocess.Popen[str]) -> None:
    later = latchkey(env, "run", "later", "--ttl", "5s", "--", "true")
    assert later.returncode == 0  # released: only nightly is held
    short = latchkey(env, "run", "short", "--ttl", "30s", "--at-least", "20s", "--", "true")
    assert short.returncode == 0  # its lease stays for 20 s, ending before nightly's minute
    result = latchkey(env, "ls", "--watch", "0.1", "--count", "3", "--json", "--sort", "expires")
    assert result.returncode == 0, result.stderr
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(frames) == 3 and all("at" in f for f in frames)
    names = [[lock["name"] for lock in f["locks"]] for f in frames]
    assert names == [["short", "nightly"]] * 3  # short ends first, though named later
    by_age = latchkey(env, "ls", "--sort", "age", "--json")
    assert [lock["name"] for lock in json.loads(by_age.stdout)] == ["nightly", "short"]
    table = latchkey(env, "ls", "--watch", "0.1", "--count", "2")
    assert table.returncode == 0
    assert table.stdout.count("NAME  ") == 2 and "every 100ms" in table.stdout


def test_ls_watch_goes_on_through_an_outage_and_reports_it(env: dict[str, str]) -> None:
    env = {**env, "LATCHKEY_URL": "redis://:secret@127.0.0.1:1/?timeout=0.2s"}
    result = latchkey(env, "ls", "--watch", "0.05", "--count", "2", "--json")
    assert result.returncode == 69
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(frames) == 2 and all("error" in f for f in frames)
    assert "secret" not in result.stdout + result.stderr


def test_ls_watch_rejects_bad_intervals(env: dict[str, str]) -> None:
    for args, word in (
        (["--watch", "-1s"], "negative"),
        (["--watch", "0"], "positive"),
        (["--count", "2"], "--count"),
        (["--watch", "--count", "0"], "--count"),
    ):
        result = latchkey(env, "ls", *args)
        assert result.returncode == 78, args
        assert word in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_rows_lists_due_rows_free_and_leased(env: dict[str, str], tmp_path: Path) -> None:
    import latchkey as lk
    from tests.appdb import AppDB

    url = env["LATCHKEY_URL"]
    app = AppDB(url)
    table = app.create_events(4)
    app.execute(f"UPDATE {table} SET processed_at = 1 WHERE id = 4")
    store = lk.connect(url)
    queue = store.rows(table, where="processed_at IS NULL", order_by="id")
    with queue.lease(limit=1, ttl="10m", metadata={"job": "digest"}) as batch:
        token = batch.token(batch.rows[0])
        result = latchkey(env, "rows", table, "--where", "processed_at IS NULL", "--order-by", "id")
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].split() == ["ID", "STATE", "TOKEN", "LEASED", "BY", "UNTIL"]
        first = lines[1].split()
        assert first[:3] == ["1", "leased", str(token)] and f"{os.getpid()}@" in lines[1]
        assert lines[2].split()[:2] == ["2", "free"] and lines[3].split()[:2] == ["3", "free"]
        assert "3 due row(s)" in lines[-1] and "1 leased" in lines[-1]
        result = latchkey(env, "rows", table, "--where", "processed_at IS NULL", "--json")
        rows = json.loads(result.stdout)
        assert [r["key"] for r in rows] == [1, 2, 3]
        assert rows[0]["state"] == "leased" and rows[0]["lease"]["token"] == token
        assert rows[0]["lease"]["owner"]["pid"] == os.getpid()
        assert rows[0]["lease"]["owner"]["metadata"] == {"job": "digest"}
        assert rows[1] == {"key": 2, "state": "free", "locked": None, "lease": None}
    store.close()
    app.close()
    result = latchkey(env, "rows", table, "--where", "processed_at IS NOT NULL AND id > 4")
    assert result.returncode == 0 and "no due rows" in result.stdout
    bad = latchkey(env, "rows", "events; DROP TABLE x")
    assert bad.returncode == 78 and "not an identifier" in bad.stderr
    elsewhere = latchkey({**env, "LATCHKEY_URL": "memory://"}, "rows", table)
    assert elsewhere.returncode == 78 and "memory" in elsewhere.stderr


def test_rows_with_a_bad_where_exits_78_with_one_line(env: dict[str, str]) -> None:
    from tests.appdb import AppDB

    app = AppDB(env["LATCHKEY_URL"])
    table = app.create_events(1)
    app.close()
    result = latchkey(env, "rows", table, "--where", "no_such_column = 1")
    assert result.returncode == 78
    assert "no_such_column" in result.stderr and len(result.stderr.splitlines()) == 1
