"""What both nodes share: model flags, the secret, the KV transport (``--kv-transport ucx|nixl``: its
config, the CTX's server and the GEN's transport), the control server, checksums, READY."""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
import torch

from examples.tiny_model import ModelConfig, TinyModel
from examples.two_node import cli, control
from examples.two_node.control import ControlLimits
from examples.two_node.sigterms import Sigterms
from orchestrator._config import KV_TRANSPORTS
from transports import KVLayout, KVStore
from transports._auth import SECRET_ENV, load_secret
from transports.ucx import UCXConfig

log = structlog.get_logger("examples.two_node")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (both nodes must agree)")
    g.add_argument("--layers", type=cli.positive_int, default=ModelConfig.num_layers)
    g.add_argument("--heads", type=cli.positive_int, default=ModelConfig.num_heads)
    g.add_argument("--kv-heads", type=cli.positive_int, default=ModelConfig.num_kv_heads)
    g.add_argument("--head-dim", type=cli.positive_int, default=ModelConfig.head_dim)
    g.add_argument("--max-seq-len", type=cli.positive_int, default=ModelConfig.max_seq_len)
    g.add_argument("--seed", type=int, default=ModelConfig.seed)
    g.add_argument("--block-size", type=cli.positive_int, default=16, help="tokens per KV block")


def add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--secret-file", help=f"file holding the shared secret (default: env {SECRET_ENV})")
    g.add_argument("--insecure", action="store_true", help="run without peer authentication (logs a warning)")


def add_control_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("control plane")
    g.add_argument("--max-connections", type=cli.positive_int, default=ControlLimits.max_connections,
                   help="control connections open at once; more are closed when accepted")
    g.add_argument("--handshake-timeout-s", type=cli.positive_float, default=ControlLimits.handshake_timeout_s,
                   help="a control connection must authenticate and send its request within this")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
    )


def build_model(args: argparse.Namespace) -> TinyModel:
    """The tiny model; a rank's shard when the node runs tensor-parallel (``--tp``, group joined:
    its model group, on its device)."""
    torch.set_num_threads(1)  # two cores: one for the execution thread, one for the event loop
    tp = None
    if getattr(args, "tp", 1) > 1:
        from examples.tp import TensorParallel

        tp = TensorParallel.from_group(getattr(args, "tp_group", None))
    state = getattr(args, "tp_state", None)
    return TinyModel(model_config(args), state.device if state is not None else "cpu", tp=tp)


def load_secret_or_exit(path: str | None, what: str) -> bytes | None:
    """``load_secret(path=path)``, or ``SystemExit`` with one line saying what is wrong with the
    secret (too short) or with the file ``what`` names (unreadable)."""
    try:
        return load_secret(path=path)
    except ValueError as exc:
        raise SystemExit(f"error: {exc} (from {path or SECRET_ENV})") from None
    except OSError as exc:
        raise SystemExit(f"error: cannot read {what} {path}: {exc.strerror or exc}") from None


def node_secret(args: argparse.Namespace) -> bytes | None:
    """The shared secret (``--secret-file`` or ``KVO_SHARED_SECRET``); None only with ``--insecure``.

    Raises ``SystemExit`` with one line saying what is wrong (too short, unreadable, missing)."""
    secret = load_secret_or_exit(args.secret_file, "--secret-file")
    if secret is None and not args.insecure:
        raise SystemExit(f"error: no shared secret: set {SECRET_ENV} or --secret-file (or pass --insecure)")
    return secret


def ucx_config(args: argparse.Namespace) -> UCXConfig:
    return UCXConfig(secret=node_secret(args), allow_insecure=args.insecure)


def add_transport_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV transport (both nodes must agree)")
    g.add_argument("--kv-transport", choices=KV_TRANSPORTS, default="ucx",
                   help="the KV data plane: ucx (ucxx tag messages; the default, fastest over TCP) or nixl "
                        "(one-sided NIXL READ; for shared memory, cma, RDMA; needs nixl-cu12). docs/transport.md")


def backend(args: argparse.Namespace) -> str:
    """The node's KV transport (``--kv-transport``; ``ucx`` for a namespace built without it)."""
    name = getattr(args, "kv_transport", "ucx")
    if name not in KV_TRANSPORTS:
        raise SystemExit(f"error: --kv-transport {name!r} is not one of {', '.join(KV_TRANSPORTS)}")
    return name


def nixl_config(args: argparse.Namespace) -> Any:
    try:
        from transports.nixl import NIXLConfig
    except ImportError as exc:
        raise SystemExit(f"error: --kv-transport nixl: {exc}") from None
    return NIXLConfig(secret=node_secret(args), allow_insecure=args.insecure)


def kv_server(args: argparse.Namespace, store: KVStore, *, port: int, lease_s: float, head_start: int = 0,
              total_kv_heads: int | None = None) -> Any:
    """The CTX's KV server for ``--kv-transport`` (an async context manager with ``.port``): a
    ``UCXKVServer`` (listens on every interface) or a ``NIXLKVServer`` (its control port on ``--host``)."""
    if backend(args) == "nixl":
        from transports.nixl import NIXLKVServer

        return NIXLKVServer(store, nixl_config(args), host=args.host, port=port, lease_s=lease_s,
                            head_start=head_start, total_kv_heads=total_kv_heads)
    from transports.ucx import UCXKVServer

    return UCXKVServer(store, ucx_config(args), port=port, lease_s=lease_s, head_start=head_start,
                       total_kv_heads=total_kv_heads)


def kv_transport(args: argparse.Namespace, layout: KVLayout, *, total_kv_heads: int | None = None) -> Any:
    """The GEN's ``transports.Transport`` for ``--kv-transport``: ``UCXTransport`` or ``NIXLTransport``."""
    if backend(args) == "nixl":
        from transports.nixl import NIXLTransport

        return NIXLTransport(nixl_config(args), layout=layout, total_kv_heads=total_kv_heads)
    from transports.ucx import UCXTransport

    return UCXTransport(ucx_config(args), layout=layout, total_kv_heads=total_kv_heads)


def control_server(args: argparse.Namespace, handler: control.Handler, model: ModelConfig) -> control.ControlServer:
    """The node's control server: its secret, and limits sized for a prefill of a whole context."""
    limits = ControlLimits(max_connections=args.max_connections, handshake_timeout_s=args.handshake_timeout_s,
                           max_line=control.max_line_for(model.max_seq_len, model.vocab_size - 1))
    return control.ControlServer(handler, secret=node_secret(args), insecure=args.insecure, limits=limits)


def block_checksums(pool: torch.Tensor, block_ids: torch.Tensor) -> list[int]:
    """CRC32 of each block's bytes, in block-table order (compared end to end CTX -> GEN).

    A debugging aid that the nodes run only when asked (``--kv-checksums``); on a CUDA pool the
    request's blocks are copied to the host once (one gather), then checksummed."""
    blocks = pool.index_select(0, block_ids.to(pool.device)).contiguous().cpu().view(torch.uint8)
    return [zlib.crc32(block.numpy().data) for block in blocks]


def announce_ready(**fields: object) -> None:
    """The one line a parent process waits for."""
    sys.stdout.write("READY " + json.dumps(fields) + "\n")
    sys.stdout.flush()


async def stop_on_sigterm(node: Any, wind_down: Callable[[float], Awaitable[None]], stop: Callable[[], None],
                          work: Callable[[], dict[str, Any]], log: Any, sigterms: Sigterms) -> None:
    """A node without etcd: its first SIGTERM sets ``node.shutting_down`` (it takes no new work) and
    runs ``wind_down(grace)`` (``--graceful-shutdown-timeout-s``: what is live ends or is given up),
    then ``stop()``. A second SIGTERM cuts the wind-down short and sets ``node.exit_status`` to 143,
    which the node's main returns (``gen_tp.run_node``): raised as SystemExit in this task, it left
    the event loop at once and asyncio logged a 40-line "unhandled exception during asyncio.run()
    shutdown". ``work()``: the log fields that say what is live."""
    await sigterms.next()
    node.shutting_down = True
    grace = node.args.graceful_shutdown_timeout_s
    log.info("sigterm_shutting_down", **work(), grace_s=grace)
    async with anyio.create_task_group() as tg:

        async def again() -> None:
            await sigterms.next()
            log.warning("sigterm_again_exiting_now", **work())
            node.exit_status = 143
            tg.cancel_scope.cancel()

        tg.start_soon(again)
        await wind_down(grace)
        tg.cancel_scope.cancel()
    stop()
