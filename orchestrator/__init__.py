"""GEN-side KV-receive orchestration: the decode loop never waits for a receive.

See ``_engine`` for a step's anatomy, ``_budget`` for the transfer budget, ``_receiver`` for the
receive task group, ``_loop`` for the threads a node runs.
"""

from transports import KVLayout as KVLayout
from transports import KVSlice as KVSlice

from ._budget import BudgetStatistics as BudgetStatistics
from ._budget import Grant as Grant
from ._budget import TransferBudget as TransferBudget
from ._config import Mode as Mode
from ._config import OrchestratorConfig as OrchestratorConfig
from ._engine import DecodeBatch as DecodeBatch
from ._engine import EngineStatistics as EngineStatistics
from ._engine import GenEngine as GenEngine
from ._engine import StepReport as StepReport
from ._errors import ContextTooLong as ContextTooLong
from ._errors import InvalidRequest as InvalidRequest
from ._errors import KVExhausted as KVExhausted
from ._errors import NotRunning as NotRunning
from ._errors import OrchestratorError as OrchestratorError
from ._errors import Unavailable as Unavailable
from ._errors import WouldBlock as WouldBlock
from ._kvpool import KVBlockPool as KVBlockPool
from ._kvpool import PoolStatistics as PoolStatistics
from ._loop import DecodeLoop as DecodeLoop
from ._loop import EngineThreads as EngineThreads
from ._loop import LoopStatistics as LoopStatistics
from ._loop import Percentiles as Percentiles
from ._receiver import ReceiveGroup as ReceiveGroup
from ._receiver import ReceiveJob as ReceiveJob
from ._receiver import plan_chunks as plan_chunks
from ._requests import DeferReason as DeferReason
from ._requests import FailureReason as FailureReason
from ._requests import GenRequest as GenRequest
from ._requests import KVSource as KVSource
from ._requests import ReceiveResult as ReceiveResult
from ._requests import RequestOutput as RequestOutput
from ._requests import RequestState as RequestState
from ._threads import loop_caller as loop_caller
from ._step import Agreement as Agreement
from ._step import Agreement as StepSync
from ._step import GroupBroken as GroupBroken
from ._step import LocalGroup as LocalGroup
from ._step import SoloAgreement as SoloAgreement
from ._step import StepMessage as StepMessage
from ._step import TorchStepSync as TorchStepSync
from ._tp import TPGenEngine as TPGenEngine

__all__ = [
    "Agreement", "GroupBroken", "SoloAgreement", "BudgetStatistics", "ContextTooLong", "DecodeBatch", "DecodeLoop", "DeferReason", "EngineStatistics", "EngineThreads",
    "FailureReason", "GenEngine", "GenRequest", "Grant", "InvalidRequest", "KVBlockPool", "KVExhausted", "KVSource",
    "KVLayout", "KVSlice", "LocalGroup", "LoopStatistics", "Mode", "NotRunning", "OrchestratorConfig", "OrchestratorError",
    "Percentiles", "PoolStatistics", "ReceiveGroup", "ReceiveJob", "ReceiveResult", "RequestOutput",
    "RequestState", "StepMessage", "StepReport", "StepSync", "TPGenEngine", "TorchStepSync", "TransferBudget", "Unavailable", "WouldBlock", "loop_caller", "plan_chunks",
]
