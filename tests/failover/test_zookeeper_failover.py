"""ZooKeeper with three servers, its leader killed (issue 16 item 5).

The store's URL names every server; kazoo moves its session to another server when its own
stops answering, and a session outlives a leader election if it reconnects within its
timeout: its ephemeral nodes, the leases, stay. zxids carry the leader's epoch in their high
bits, so tokens given by the new leader are above every earlier one.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tests.failover import leader_kill_keeps_every_lease
from tests.servers import ServerUnavailable
from tests.servers import zookeeper as zk

pytestmark = pytest.mark.skipif(
    "zookeeper" not in os.environ.get("LATCHKEY_TEST_STORES", "zookeeper").split(","),
    reason="zookeeper not selected by LATCHKEY_TEST_STORES",
)


def test_a_killed_leader_loses_no_lease_and_no_token(tmp_path: Path) -> None:
    try:
        servers = zk.start_ensemble(tmp_path / "zk", 3)
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no ZooKeeper here: {exc}")
    try:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
        url = f"zookeeper://{hosts}/failover?session_timeout=20s&timeout=2s"
        leader_kill_keeps_every_lease(url, lambda: zk.leader_of(servers), "zookeeper", patient=True)
    finally:
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()
