"""etcd with three members, its leader killed (issue 16 item 5).

The store gets every member in its URL (``etcd://h1,h2,h3``) and moves to the next one when
its member stops answering. etcd's leases live in the raft log: a new leader keeps them
(and renews every lease by its TTL, so none ends during the election), revisions keep
increasing, so no token repeats.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tests.failover import leader_kill_keeps_every_lease
from tests.servers import ServerUnavailable
from tests.servers import etcd as etcd_servers

pytestmark = pytest.mark.skipif(
    "etcd" not in os.environ.get("LATCHKEY_TEST_STORES", "etcd").split(","),
    reason="etcd not selected by LATCHKEY_TEST_STORES",
)


def test_a_killed_leader_loses_no_lease_and_no_token(tmp_path: Path) -> None:
    try:
        members = etcd_servers.start_etcd_cluster(tmp_path / "etcd", 3)
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no etcd here: {exc}")
    try:
        hosts = ",".join(f"127.0.0.1:{m.port}" for m in members)
        url = f"etcd://{hosts}?timeout=2s"
        leader_kill_keeps_every_lease(url, lambda: etcd_servers.leader_of(members), "etcd")
    finally:
        for member in members:
            with contextlib.suppress(Exception):
                member.stop()
