"""The front looks after the nodes it launched: a node that dies is started again (with backoff) and
routed to under its new address; the secret it generated for them is in a file of its own (mode
0600) under its run folder, named in its READY line, removed when it stops."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import anyio
import httpx
import pytest

from examples.serve.cluster import CONTROL_ERRORS
from examples.two_node import control
from tests.test_serve import CLUSTER_YAML, running_front

pytestmark = pytest.mark.integration


def test_killed_node_is_restarted_and_the_secret_file(tmp_path: Path) -> None:
    with running_front(tmp_path, CLUSTER_YAML, own_secret=True) as front:
        path = Path(front["secret_file"])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.parent.name.startswith("kvo-front-")
        secret = path.read_bytes()
        stats = anyio.run(lambda: control.call(front["gen"][0], {"op": "stats"}, secret=secret))
        assert stats["role"] == "gen"  # the file holds what the nodes were started with
        old = front["gen"][0]
        os.kill(next(n["pid"] for n in front["started"] if n["role"] == "gen"), signal.SIGKILL)
        t0 = time.monotonic()
        while True:
            health = httpx.get(front["url"] + "/health").json()
            gens = [n for n in health["nodes"] if n["role"] == "gen"]
            if health["status"] == "ok" and [n["addr"] for n in gens] != [old]:
                break
            assert time.monotonic() - t0 < 60, health
            time.sleep(0.2)
        new = gens[0]["addr"]
        body = {"model": "tiny", "prompt": "back again", "max_tokens": 4, "temperature": 0}
        r = httpx.post(front["url"] + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
    assert not path.parent.exists()  # the run folder went with the front

    async def gone() -> None:  # the restarted node was stopped with the front
        with pytest.raises(CONTROL_ERRORS):
            await control.call(new, {"op": "stats"}, secret=secret, timeout=5)

    anyio.run(gone)
