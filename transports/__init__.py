"""Transports that move a request's KV from a CTX node to a GEN node.

The orchestrator depends only on the ``Transport`` protocol; ``inproc`` serves tests, ``ucx``
(imported explicitly, ``transports.ucx``) is the real data plane, the default; ``nixl``
(``transports.nixl``, needs ``nixl-cu12``) is the one-sided READ one. A node picks one with
``--kv-transport ucx|nixl`` (``examples.two_node.common.kv_transport`` / ``kv_server``).
"""

from ._errors import AuthenticationFailed as AuthenticationFailed
from ._errors import IncompatiblePeer as IncompatiblePeer
from ._errors import PeerBusy as PeerBusy
from ._errors import PeerClosed as PeerClosed
from ._errors import PeerUnreachable as PeerUnreachable
from ._errors import ProtocolViolation as ProtocolViolation
from ._errors import TransportError as TransportError
from ._errors import UnknownRequest as UnknownRequest
from ._ids import MAX_REQUEST_ID_LEN as MAX_REQUEST_ID_LEN
from ._ids import InvalidRequestId as InvalidRequestId
from ._ids import check_handle as check_handle
from ._ids import check_request_id as check_request_id
from ._ids import new_handle as new_handle
from ._layout import KVLayout as KVLayout
from ._layout import KVSlice as KVSlice
from ._layout import dtype_from_name as dtype_from_name
from ._layout import dtype_name as dtype_name
from ._layout import gather as gather
from ._layout import scatter as scatter
from ._layout import whole_run_view as whole_run_view
from ._protocol import Landing as Landing
from ._protocol import Transport as Transport
from ._protocol import parse_peer as parse_peer
from ._store import Checkout as Checkout
from ._store import KVStore as KVStore
from ._store import KVStoreStatistics as KVStoreStatistics

__all__ = [
    "AuthenticationFailed",
    "Checkout",
    "IncompatiblePeer",
    "InvalidRequestId",
    "MAX_REQUEST_ID_LEN",
    "KVLayout",
    "KVSlice",
    "KVStore",
    "KVStoreStatistics",
    "Landing",
    "PeerBusy",
    "PeerClosed",
    "PeerUnreachable",
    "ProtocolViolation",
    "Transport",
    "TransportError",
    "UnknownRequest",
    "check_handle",
    "check_request_id",
    "dtype_from_name",
    "dtype_name",
    "gather",
    "new_handle",
    "parse_peer",
    "scatter",
    "whole_run_view",
]
