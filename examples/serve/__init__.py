"""An OpenAI-compatible front for a disaggregated CTX/GEN cluster: ``python -m examples.serve -c cluster.yaml``.

    HTTP client ──/v1/completions, /v1/chat/completions──> front (Starlette on uvicorn)
        ──prefill──> CTX node (least loaded)      first token + KV handle
        ──generate {handoff}──> GEN node (least loaded) ── pulls the KV from that CTX, streams tokens
    /v1/models, /health, /metrics (the front's series and its nodes', labelled ``node``)

``config`` reads the cluster file, ``cluster`` polls and picks nodes (and starts them), ``_api``
validates requests and shapes answers, ``_app`` serves HTTP. Details: docs/serve.md.
"""

from examples.serve._api import ApiError as ApiError
from examples.serve._app import Front as Front
from examples.serve.cluster import Cluster as Cluster
from examples.serve.config import ClusterConfig as ClusterConfig
from examples.serve.config import ConfigError as ConfigError

__all__ = ["ApiError", "Cluster", "ClusterConfig", "ConfigError", "Front"]
