"""An OpenAI-compatible front for a disaggregated CTX/GEN cluster: ``python -m examples.serve -c cluster.yaml``.

    HTTP client ──/v1/completions, /v1/chat/completions──> front (Starlette on uvicorn)
        ──admission (limit, bounded queue)──prefill──> CTX node (router.ctx)   first token + KV handle
        ──generate {handoff}──> GEN node (router.gen) ── pulls the KV from that CTX, streams tokens
        (a prefill / hand-off that fails before any token: another node, up to max_retries)
    /v1/models[/{id}], /version, /health, /metrics (the front's series and its nodes', ``node``),
    POST /admin/drain; nodes from the file, or from etcd (``examples.two_node.membership``)

``config`` reads the cluster file, ``cluster`` polls, routes and (re)starts nodes, ``_admission``
queues requests over the limit, ``_api`` validates requests and shapes answers (sampling fields
included), ``_app`` serves HTTP. Details: docs/serve.md.
"""

from examples.serve._api import ApiError as ApiError
from examples.serve._app import Front as Front
from examples.serve.cluster import Cluster as Cluster
from examples.serve.config import ClusterConfig as ClusterConfig
from examples.serve.config import ConfigError as ConfigError

__all__ = ["ApiError", "Cluster", "ClusterConfig", "ConfigError", "Front"]
