"""The cluster file: which CTX and GEN nodes the front uses (or starts), transfer knobs, limits.

    model: tiny                       # the name /v1/models lists and requests must name
    listen: {host: 127.0.0.1, port: 8000}
    secret_file: /etc/kvo/secret      # optional; else KVO_SHARED_SECRET (never the secret itself here)
    transfer:                         # passed to the GEN nodes the front starts
      backend: ucx                    # ucx | nixl: --kv-transport of every node the front starts (CTX and GEN)
      max_tokens_in_buffer: 2048      # or transfer_budget_bytes: 1048576
      kv_transfer_timeout_ms: 60000
    limits:
      max_body_bytes: 1048576
      body_timeout_s: 30
      max_prompt_tokens: 1536
      max_tokens: 512                 # most tokens one request may ask for
      default_max_tokens: 16          # when a request does not say
      max_concurrent_requests: 256    # more at once: 429 with Retry-After
      max_model_len: 2048             # prompt + completion; the nodes' --max-seq-len
    routing:
      stats_interval_s: 0.5           # how often each node's control ``stats`` is read (load, health, metrics)
      retry_after_s: 1
      request_timeout_s: 300
    router: {ctx: least_loaded, gen: least_loaded}   # or round_robin, power_of_two (per role)
    queue: {size: 256, timeout_s: 30} # over max_concurrent_requests: wait in a bounded queue, then 429
    max_retries: 2                    # a prefill / GEN hand-off that failed before any token: another node
    etcd:                             # membership: nodes started with --etcd register here (ctx/gen may be empty)
      url: http://127.0.0.1:2379
      prefix: /kvo/tiny/
    ctx:
      - addr: 10.0.0.1:9000           # a node already running
    gen:
      - launch: {mode: orchestrated, step: model, tensor_parallel_size: 2, args: ["--num-blocks", "4096"]}

A node is either ``addr`` (running; its transfer knobs are its own command line's) or ``launch``
(the front starts it as a child process with ``examples.two_node.launch.NodeProcess`` and stops it
on exit): ``host`` (127.0.0.1), ``mode``, ``step`` and ``tensor_parallel_size`` (``--tp``, CTX or GEN),
``metrics_port`` (the node's own ``--metrics-port``), and ``args`` (more command-line flags, verbatim).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from examples.two_node.control import parse_addr

POLICIES = ("round_robin", "least_loaded", "power_of_two")

BACKENDS = ("ucx", "nixl")  # OrchestratorConfig.kv_transport's names (docs/transport.md: ucx is the default)


class ConfigError(ValueError):
    """The cluster file is invalid; the message names the field."""


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    role: str
    """``ctx`` or ``gen``."""
    addr: str | None = None
    """Control address of a running node (None: the front launches it)."""
    host: str = "127.0.0.1"
    mode: str = "orchestrated"
    step: str = "model"
    metrics_port: int | None = None
    tensor_parallel_size: int = 1
    """GEN only: ranks of the node's TP group (``--tp``)."""
    args: tuple[str, ...] = ()

    @property
    def launched(self) -> bool:
        return self.addr is None


@dataclasses.dataclass(frozen=True)
class Transfer:
    backend: str = "ucx"
    max_tokens_in_buffer: int | None = None
    transfer_budget_bytes: int | None = None
    kv_transfer_timeout_ms: int = 60_000


@dataclasses.dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0
    """The whole request body must arrive within this (else 408): a client trickling its body
    holds a connection and its buffer no longer than this."""
    max_prompt_tokens: int = 1536
    max_tokens: int = 512
    default_max_tokens: int = 16
    max_concurrent_requests: int = 256
    max_stop_strings: int = 4
    max_stop_chars: int = 64
    max_n: int = 8
    """Most choices one request may ask for (``n``)."""
    max_model_len: int = 2048
    """Prompt + completion tokens: the nodes' ``--max-seq-len`` (the tiny model's 2048 by default)."""


@dataclasses.dataclass(frozen=True)
class Routing:
    stats_interval_s: float = 0.5
    retry_after_s: int = 1
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0


@dataclasses.dataclass(frozen=True)
class RouterPolicies:
    ctx: str = "least_loaded"
    gen: str = "least_loaded"


@dataclasses.dataclass(frozen=True)
class Queue:
    size: int = 256
    """Requests that may wait for a slot once ``max_concurrent_requests`` are in flight (more: 429)."""
    timeout_s: float = 30.0
    """How long one may wait there (then 429)."""


@dataclasses.dataclass(frozen=True)
class Etcd:
    url: str
    """The etcd endpoint (its v3 JSON gateway: ``http://host:2379``)."""
    prefix: str = "/kvo/"
    """Nodes register under ``{prefix}{role}/{control address}``."""


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    ctx: tuple[NodeSpec, ...]
    gen: tuple[NodeSpec, ...]
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8000
    secret_file: str | None = None
    insecure: bool = False
    transfer: Transfer = Transfer()
    limits: Limits = Limits()
    routing: Routing = Routing()
    router: RouterPolicies = RouterPolicies()
    queue: Queue = Queue()
    max_retries: int = 2
    etcd: Etcd | None = None

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        return (*self.ctx, *self.gen)


def load(path: str | Path) -> ClusterConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    return parse(raw, base=Path(path).parent)


def parse(raw: Any, *, base: Path = Path(".")) -> ClusterConfig:
    top = _mapping(raw, "the file")
    _known(top, "the file", {"model", "listen", "secret_file", "insecure", "transfer", "limits", "routing", "ctx", "gen",
                             "secret", "router", "queue", "max_retries", "etcd"})
    if "secret" in top:
        raise ConfigError("'secret' does not belong in the file: use secret_file or KVO_SHARED_SECRET")
    listen = _mapping(top.get("listen", {}), "listen")
    _known(listen, "listen", {"host", "port"})
    transfer = _section(top, "transfer", Transfer)
    if transfer.backend not in BACKENDS:
        raise ConfigError(f"transfer.backend: {transfer.backend!r} is not one of {', '.join(BACKENDS)}")
    if transfer.max_tokens_in_buffer is not None and transfer.transfer_budget_bytes is not None:
        raise ConfigError("transfer: give max_tokens_in_buffer or transfer_budget_bytes, not both")
    limits = _section(top, "limits", Limits)
    routing = _section(top, "routing", Routing)
    router = _section(top, "router", RouterPolicies)
    for role in ("ctx", "gen"):
        if getattr(router, role) not in POLICIES:
            raise ConfigError(f"router.{role}: {getattr(router, role)!r} is not one of {', '.join(POLICIES)}")
    queue = _section(top, "queue", Queue)
    max_retries = _typed(top.get("max_retries", 2), int, "max_retries")
    if max_retries < 0:
        raise ConfigError(f"max_retries must be >= 0, got {max_retries}")
    etcd = None
    if top.get("etcd") is not None:
        raw_etcd = _mapping(top["etcd"], "etcd")
        _known(raw_etcd, "etcd", {"url", "prefix"})
        url = _typed(raw_etcd.get("url"), str, "etcd.url")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"etcd.url: {url!r} is not an http:// or https:// URL")
        prefix = _typed(raw_etcd.get("prefix", "/kvo/"), str, "etcd.prefix")
        if not prefix.endswith("/") or "\x00" in prefix:  # "" selects nothing; "/kvo" would also match "/kvo2/..."
            raise ConfigError(f"etcd.prefix: {prefix!r} must be a non-empty key prefix ending in '/' (e.g. /kvo/tiny/)")
        etcd = Etcd(url=url.rstrip("/"), prefix=prefix)
    for name, section in (("transfer", transfer), ("limits", limits), ("routing", routing), ("queue", queue)):
        for f in dataclasses.fields(section):  # NaN passes "<= 0" and every comparison after it; inf never ends
            v = getattr(section, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{name}.{f.name} must be a finite number, got {v}")
    if queue.size < 0 or queue.timeout_s <= 0:
        raise ConfigError("queue: size must be >= 0 (0: no queue) and timeout_s positive")
    for section in (transfer, limits, routing):
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
                raise ConfigError(f"{f.name} must be positive, got {v}")
    if limits.default_max_tokens > limits.max_tokens:
        raise ConfigError("limits.default_max_tokens exceeds limits.max_tokens")
    secret_file = top.get("secret_file")
    if secret_file is not None:
        secret_file = str(base / str(secret_file))
    cfg = ClusterConfig(
        ctx=_nodes(top, "ctx", optional=etcd is not None), gen=_nodes(top, "gen", optional=etcd is not None),
        model=_typed(top.get("model", "tiny"), str, "model"),
        host=_typed(listen.get("host", "127.0.0.1"), str, "listen.host"),
        port=_typed(listen.get("port", 8000), int, "listen.port"),
        secret_file=secret_file, insecure=_typed(top.get("insecure", False), bool, "insecure"),
        transfer=transfer, limits=limits, routing=routing, router=router, queue=queue, max_retries=max_retries,
        etcd=etcd,
    )
    if not 0 <= cfg.port < 65536:
        raise ConfigError(f"listen.port: {cfg.port} is not a port")
    return cfg


def _nodes(top: dict[str, Any], role: str, *, optional: bool = False) -> tuple[NodeSpec, ...]:
    items = top.get(role)
    if optional and items in (None, []):
        return ()  # the nodes come through etcd
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{role}: a list of at least one node is needed (or etcd: nodes that register there)")
    out = []
    for i, item in enumerate(items):
        where = f"{role}[{i}]"
        item = _mapping(item, where)
        _known(item, where, {"addr", "launch"})
        if ("addr" in item) == ("launch" in item):
            raise ConfigError(f"{where}: give exactly one of addr (a running node) or launch (the front starts it)")
        if "addr" in item:
            addr = _typed(item["addr"], str, f"{where}.addr")
            try:
                parse_addr(addr)
            except ValueError as exc:
                raise ConfigError(f"{where}.addr: {exc}") from None
            out.append(NodeSpec(role, addr=addr))
            continue
        launch = _mapping(item["launch"] or {}, f"{where}.launch")
        _known(launch, f"{where}.launch", {"host", "mode", "step", "metrics_port", "tensor_parallel_size", "args"})
        args = launch.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
            raise ConfigError(f"{where}.launch.args: a list of command-line words")
        mode = _typed(launch.get("mode", "orchestrated"), str, f"{where}.launch.mode")
        step = _typed(launch.get("step", "model"), str, f"{where}.launch.step")
        if role == "gen" and mode not in ("orchestrated", "inline", "ideal"):
            raise ConfigError(f"{where}.launch.mode: {mode!r} is not orchestrated, inline or ideal")
        if role == "gen" and step not in ("model", "device"):
            raise ConfigError(f"{where}.launch.step: {step!r} is not model or device")
        port = launch.get("metrics_port")
        tp = _typed(launch.get("tensor_parallel_size", 1), int, f"{where}.launch.tensor_parallel_size")
        if tp not in (1, 2, 4, 8):
            raise ConfigError(f"{where}.launch.tensor_parallel_size: {tp} (1, 2, 4 or 8)")
        out.append(NodeSpec(role, host=_typed(launch.get("host", "127.0.0.1"), str, f"{where}.launch.host"),
                            mode=mode, step=step, metrics_port=None if port is None else _typed(port, int, "metrics_port"),
                            tensor_parallel_size=tp,
                            args=tuple(str(a) for a in args)))
    return tuple(out)


def _section(top: dict[str, Any], name: str, cls: type) -> Any:
    raw = _mapping(top.get(name, {}) or {}, name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _known(raw, name, set(fields))
    values = {}
    for key, value in raw.items():
        default = getattr(cls(), key)
        kind = type(default) if default is not None else int
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        values[key] = _typed(value, kind, f"{name}.{key}")
    return cls(**values)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping")
    return value


def _known(value: dict[str, Any], where: str, allowed: set[str]) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")


def _typed(value: Any, kind: type, where: str) -> Any:
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")
    return value
