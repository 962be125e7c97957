"""The fork server the suite starts its nodes from (examples/two_node/forkserver.py): a forked node
is the same program as a cold one (its argv, environment, folder, session, exit status, signals),
and a start the server cannot serve is started cold."""

from __future__ import annotations

import os
import signal
import subprocess

import anyio
import pytest

from examples.two_node import control, forkserver
from examples.two_node.launch import NodeProcess, node_env


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> forkserver.ForkServer:
    monkeypatch.setattr(forkserver, "_enabled", True)
    s = forkserver.server()
    assert s is not None and s.alive
    return s


def _ping(node: NodeProcess) -> dict:
    return anyio.run(lambda: control.call(node.info["ctrl"], {"op": "ping"}, secret=node.secret))


def test_a_forked_node_serves_with_its_own_secret_session_and_exit_status(server: forkserver.ForkServer) -> None:
    env = node_env()  # a fresh secret: the node only answers it if the environment reached it
    with NodeProcess.start(["ctx", "--num-blocks", "16"], env=env) as ctx:
        assert isinstance(ctx.proc, forkserver.ForkedProcess)
        assert _ping(ctx)["healthy"]
        assert os.getpgid(ctx.proc.pid) == ctx.proc.pid  # a session of its own, as start_new_session
        assert os.readlink(f"/proc/{ctx.proc.pid}/cwd") == str(forkserver.ROOT)
        assert ctx.proc.poll() is None
    assert ctx.proc.returncode == 0  # a node's graceful stop on SIGTERM, its status reported by the server
    assert "ctx_ready" in ctx.log_tail(50)  # its stderr went to its log


def test_a_forked_node_killed_by_its_process_group_reports_the_signal(server: forkserver.ForkServer) -> None:
    with NodeProcess.start(["ctx", "--num-blocks", "16"], env=node_env()) as ctx:
        ctx.kill(signal.SIGKILL)
        assert ctx.proc.returncode == -signal.SIGKILL
        with pytest.raises(ProcessLookupError):
            os.kill(ctx.proc.pid, 0)  # reaped: no zombie left behind


def test_a_forked_node_that_cannot_start_says_why_in_its_log(server: forkserver.ForkServer) -> None:
    with pytest.raises(RuntimeError, match="did not start") as err:
        NodeProcess.start(["ctx", "--num-blocks", "not-a-number"], env=node_env(), timeout=30)
    assert "expected an integer" in str(err.value) and "exit status 2" in str(err.value), err.value


def test_a_start_whose_environment_the_imports_read_differently_is_started_cold(server: forkserver.ForkServer) -> None:
    env = node_env(OMP_NUM_THREADS="1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2")
    assert not server.fits(env)
    with NodeProcess.start(["ctx", "--num-blocks", "16"], env=env) as ctx:
        assert isinstance(ctx.proc, subprocess.Popen)
        assert _ping(ctx)["healthy"]


def test_the_switch_is_not_passed_on_to_a_child_s_environment(server: forkserver.ForkServer) -> None:
    """The demos, benchmarks and fronts a test runs start their nodes cold (their process trees and
    command lines are what a user's are): enabling the server here sets nothing in the environment."""
    assert os.environ.get(forkserver.ENV) != "1" and node_env().get(forkserver.ENV) != "1"


def test_a_dead_server_is_replaced_and_a_start_meanwhile_is_cold(server: forkserver.ForkServer,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    server.proc.kill()
    server.proc.wait()
    with pytest.raises(OSError):
        server.spawn(["ctx"], node_env(), forkserver.ROOT, 1, 2, None)
    monkeypatch.setattr(forkserver, "server", lambda: server)  # the dead one, as if it died just now
    with NodeProcess.start(["ctx", "--num-blocks", "16"], env=node_env()) as ctx:
        assert isinstance(ctx.proc, subprocess.Popen) and _ping(ctx)["healthy"]
    monkeypatch.undo()
    monkeypatch.setattr(forkserver, "_enabled", True)
    again = forkserver.server()
    assert again is not server and again is not None and again.alive
