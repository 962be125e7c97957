"""A node's ``--metrics-port``: prometheus' HTTP server, bounded (it takes no secret)."""

from __future__ import annotations

import errno
import socket
import time
import urllib.request

import pytest

from examples import metrics

CTX_STATS = {"role": "ctx", "prefills": 3,
             "store": {"held_requests": 0, "held_blocks": 0, "released": 3, "expired": 0},
             "pool": {"num_blocks": 64, "used_blocks": 0, "peak_used_blocks": 6}}


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_the_metrics_port_refuses_connections_over_its_cap_and_closes_idle_ones() -> None:
    server = metrics.start_metrics_server("ctx", lambda: CTX_STATS, host="127.0.0.1", port=0,
                                          idle_timeout_s=0.5, max_connections=4)
    port = int(server.server_address[1])
    held: list[socket.socket] = []
    try:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]  # idle: they send nothing
        time.sleep(0.2)  # accepted, each on its thread
        extra = socket.create_connection(("127.0.0.1", port))
        held.append(extra)
        assert _closed_by_server(extra, 0.4), "a connection over the cap was kept (a thread of its own)"
        t0 = time.monotonic()
        assert all(_closed_by_server(s, 3.0) for s in held[:4]), "an idle connection was kept past its timeout"
        assert time.monotonic() - t0 < 2.0
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvo_ctx_prefills_total 3.0" in body  # the closed ones were counted out: served again
    finally:
        for s in held:
            s.close()
        server.shutdown()
        server.server_close()


def test_a_connection_that_trickles_bytes_is_shut_at_its_deadline() -> None:
    """One byte every 0.3 s never trips the 0.5 s idle timeout; the connection's deadline shuts it
    (it kept its thread for good before), and the port serves scrapes after."""
    server = metrics.start_metrics_server("ctx", lambda: CTX_STATS, host="127.0.0.1", port=0,
                                          idle_timeout_s=0.5, max_connections=4, connection_deadline_s=1.5)
    port = int(server.server_address[1])
    s = socket.create_connection(("127.0.0.1", port))
    try:
        t0 = time.monotonic()
        shut = False
        for ch in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 40:
            try:
                s.sendall(bytes([ch]))
            except OSError:
                shut = True
                break
            if _closed_by_server(s, 0.3):
                shut = True
                break
        took = time.monotonic() - t0
        assert shut, "a trickling connection was kept past its deadline"
        assert 1.4 < took < 4.0, took  # by the deadline, not the idle timeout
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvo_ctx_prefills_total 3.0" in body
    finally:
        s.close()
        server.shutdown()
        server.server_close()


def test_a_metrics_port_in_use_is_named_in_the_error() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError) as caught:
            metrics.start_metrics_server("ctx", lambda: CTX_STATS, host="127.0.0.1", port=port)
        assert caught.value.errno == errno.EADDRINUSE  # the node's one line: "ctx: cannot start: [Errno 98] ..."
        assert f"metrics on 127.0.0.1:{port}" in str(caught.value), str(caught.value)
    finally:
        taken.close()
