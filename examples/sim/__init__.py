"""A replay in virtual time of a disaggregated run, made of the project's own engines (``python -m examples.sim``).

See ``docs/sim.md``: ``_virtual`` (virtual time and the execution thread), ``_model`` (the parameters,
the link as a Transport, presets), ``_replay`` (one run), ``__main__`` (table, sweep, check).
"""

from ._model import PRESETS, SEED, SOURCES, ModelledLink, ModelledTransport, SimParams
from ._replay import ModeResult, replay
from ._virtual import ExecutionThread, VirtualClock, VirtualEvent

__all__ = ["PRESETS", "SEED", "SOURCES", "ExecutionThread", "ModeResult", "ModelledLink", "ModelledTransport",
           "SimParams", "VirtualClock", "VirtualEvent", "replay"]


def quiet_logs() -> None:
    """Warnings and errors only (the engine logs every receive at debug level)."""
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
