"""A bandwidth-shaped link for the benchmark (``python -m examples.bench --netns [--link-mbit M]``).

Two network namespaces joined by a veth pair (``examples.two_node.launch.Netns``: CTX in ``a``, GEN
and the load client in ``b``), and, with ``link_mbit``, a token-bucket filter (``tc qdisc ... tbf``)
on *both* ends of the pair capping each direction's egress at that rate. UCX is told to use TCP on the
veth (``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES``): shared memory between the two processes would
bypass the link. Root only; both namespaces (and so the veth pair and its qdiscs) are deleted on exit.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

from examples.two_node.launch import Netns


def veth_in(ns: str) -> str:
    """The name of the (one) veth device in namespace ``ns``."""
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "type", "veth"], check=True, capture_output=True,
                         text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.strip()]
    if len(names) != 1:
        raise RuntimeError(f"expected one veth device in {ns}, found {names}")
    return names[0]


def burst_bytes(mbit: float) -> int:
    """The token bucket of a link capped at ``mbit``: >= rate / HZ, so that the bucket can reach the
    rate (the replay of a shaped run models it: ``SimParams.link_burst_bytes``)."""
    return max(16 * 1024, int(mbit * 1e6 / 8 / 250))


def shape(ns: str, dev: str, mbit: float) -> None:
    """Cap ``dev``'s egress at ``mbit`` Mbit/s (tbf; a deep queue, so TCP sees delay, not loss)."""
    burst = burst_bytes(mbit)
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                    "burst", str(burst), "latency", "2s"], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def shaped_netns(link_mbit: float | None) -> Iterator[tuple[Netns, dict[str, str]]]:
    """The namespaces, with this process's own sockets inside ``b`` (where GEN and the client live)
    for the duration; yields (the Netns, each namespace's veth device name)."""
    if why := Netns.unavailable():
        raise RuntimeError(f"--netns: {why}")
    with Netns() as ns:
        devs = {ns.a: veth_in(ns.a), ns.b: veth_in(ns.b)}
        if link_mbit:
            for name, dev in devs.items():
                shape(name, dev, link_mbit)
        with ns.entered(ns.b):
            yield ns, devs


def node_netns_env(env: dict[str, str], devs: dict[str, str], ns: str) -> dict[str, str]:
    """``env`` for a node in ``ns``: UCX over TCP on that namespace's veth."""
    return {**env, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": devs[ns]}
