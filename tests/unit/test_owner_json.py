"""The owner JSON sent with every acquire is cached; a forked child must not reuse its parent's."""

from __future__ import annotations

import json
import os

import pytest

from latchkey._owner import current_owner_json


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_describes_itself_not_its_parent() -> None:
    parent = json.loads(current_owner_json())
    assert parent["pid"] == os.getpid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it would send, then leave without pytest's cleanup
        try:
            os.write(write, current_owner_json().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert child["pid"] == pid != parent["pid"]


def test_metadata_and_threads_get_their_own_text() -> None:
    plain, tagged = current_owner_json(), current_owner_json('{"job": "x"}')
    assert json.loads(tagged)["metadata"] == {"job": "x"} and plain != tagged
    assert current_owner_json() is plain  # cached
