"""Transports that move a request's KV from a CTX node to a GEN node.

The orchestrator depends only on the ``Transport`` protocol; ``inproc`` serves tests, ``ucx``
(imported explicitly, ``transports.ucx``) is the real data plane.
"""

from ._errors import AuthenticationFailed as AuthenticationFailed
from ._errors import PeerClosed as PeerClosed
from ._errors import PeerUnreachable as PeerUnreachable
from ._errors import ProtocolViolation as ProtocolViolation
from ._errors import TransportError as TransportError
from ._errors import UnknownRequest as UnknownRequest
from ._layout import KVLayout as KVLayout
from ._layout import KVSlice as KVSlice
from ._layout import dtype_from_name as dtype_from_name
from ._layout import dtype_name as dtype_name
from ._layout import gather as gather
from ._layout import scatter as scatter
from ._layout import whole_run_view as whole_run_view
from ._protocol import Transport as Transport
from ._store import Checkout as Checkout
from ._store import KVStore as KVStore
from ._store import KVStoreStatistics as KVStoreStatistics

__all__ = [
    "AuthenticationFailed",
    "Checkout",
    "KVLayout",
    "KVSlice",
    "KVStore",
    "KVStoreStatistics",
    "PeerClosed",
    "PeerUnreachable",
    "ProtocolViolation",
    "Transport",
    "TransportError",
    "UnknownRequest",
    "dtype_from_name",
    "dtype_name",
    "gather",
    "scatter",
    "whole_run_view",
]
