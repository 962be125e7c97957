"""A node's tensor-parallel group of rank processes (GEN or CTX): forming it, watching it, healing it.

    rank 0 (the node the user starts)                    generation g = 0, 1, 2, ...
      form():  spawn ranks 1..N-1 (same flags + --tp-rank r --tp-init URL); every rank joins, then
               step group   gloo, --tp-step-timeout-s: the step exchange / the CTX's lockstep operations
               model group  NCCL when CUDA is present, else gloo, --tp-model-timeout-s: the model's
                            all-reduces (a stall shorter than the step timeout never fails them)
               each rank on CUDA: torch.cuda.set_device(rank_device(rank))
      serve    Healer.run() watches every 0.1 s:  a rank exited or was killed         (RankWatch)
                                                 a rank stopped past the step timeout
                                                 rank 0 inside a collective past the step timeout
                                                 the node's own detector (a failed exchange or step)
      break    RankWatch.cause(): ONE sentence, whichever detector fired first
               -> node.fail(cause): fail every client, release at every CTX what it holds
               -> kill_ranks(): SIGKILL (reaches a stopped rank), reaped
               -> node.stop(): its execution thread ends (its collectives now fail at once)
               -> leave the old group, form generation g + 1 on the same control port
               -> node.start(group); restarts += 1 (ping / stats: "tp": {"restarts", "last_cause"})

Ranks 1..N-1 never heal: when their group breaks they exit, and rank 0 starts new ones.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from examples import _proc
from examples.two_node.sigterms import STOP_SIGNALS
from orchestrator import GroupBroken as _StepGroupBroken

log = structlog.get_logger("examples.tp_group")

RANK0_ENV = "KVO_TP_RANK0_PID"  # rank 0's pid, in its ranks' environment: a rank whose parent is another is orphaned
JOIN_TIMEOUT_S = 120.0  # every rank joining the group (a rank's start imports torch: slow on a busy host)
WATCH_PERIOD_S = 0.1
LOST_CONNECTION_SETTLE_S = 3.0  # RankWatch.cause: how long a lost connection waits for a rank to be seen leaving
JOIN_GRACE_S = 10.0  # beyond 3 step timeouts, for a healed group's ranks to reach their first collective


def add_timeout_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--tp-step-timeout-s", "--tp-timeout-s", dest="tp_step_timeout_s", type=float, default=10.0,
                   help="a rank that does not join a step exchange within this (dead, stopped, stuck) breaks the "
                        "group: rank 0 fails what it holds, kills the ranks and forms a new group")
    g.add_argument("--tp-reform-backoff-max-s", type=float, default=30.0,
                   help="rank 0 retries forming a new group after a failed attempt, waiting 1 s, then twice as long "
                        "each time, at most this long")
    g.add_argument("--tp-reform-attempts", type=int, default=0,
                   help="failed attempts in a row after which rank 0 gives up and exits with an error, for a "
                        "supervisor to restart the node (0: retry without limit)")
    g.add_argument("--tp-model-timeout-s", type=float, default=None,
                   help="the model's collectives (their own group); default: 3 x --tp-step-timeout-s, so a stall "
                        "shorter than the step timeout never fails them (rank 0 heals a longer one itself)")


def model_timeout_s(args: argparse.Namespace) -> float:
    return args.tp_model_timeout_s or 3 * args.tp_step_timeout_s


def idle_period_s(args: argparse.Namespace) -> float:
    """How often an idle group's rank 0 runs a collective (the CTX's heartbeat, the GEN's idle step):
    once a second, or a quarter of the step timeout if that is shorter (the other ranks wait in
    that collective, which must come well within their timeout: at 1 s or less an idle group broke
    and healed over and over)."""
    return min(1.0, getattr(args, "tp_step_timeout_s", 10.0) / 4)


# -- devices ----------------------------------------------------------------------------------------

def model_backend(cuda_available: bool | None = None) -> str:
    """The model group's backend: NCCL when CUDA is present, gloo otherwise (the step group is always gloo)."""
    import torch

    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return "nccl" if cuda_available else "gloo"


def rank_device(rank: int, cuda_devices: int | None = None) -> str:
    """Where rank ``rank`` runs its model and KV pool: ``cuda:<rank mod devices>``, or ``cpu``."""
    import torch

    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"cuda:{rank % cuda_devices}" if cuda_devices else "cpu"


def use_device(device: str) -> None:
    """``torch.cuda.set_device`` for a CUDA rank (NCCL and every default-device allocation follow it)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


# -- the group ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Group:
    """One generation of a tensor-parallel group, as one rank sees it."""

    rank: int
    size: int
    step_group: Any
    model_group: Any
    device: str
    generation: int = 0
    children: list[subprocess.Popen[bytes]] = dataclasses.field(default_factory=list)
    """Rank 0: the processes of ranks 1..N-1 (index r - 1)."""

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_groups(args: argparse.Namespace, rank: int) -> tuple[Any, Any]:
    import torch.distributed as dist

    ranks = list(range(args.tp))
    step = dist.new_group(ranks, timeout=datetime.timedelta(seconds=args.tp_step_timeout_s), backend="gloo")
    model = dist.new_group(ranks, timeout=datetime.timedelta(seconds=model_timeout_s(args)), backend=model_backend())
    return step, model


def form(args: argparse.Namespace, argv: list[str], generation: int = 0, *, extra_env: dict[str, str] | None = None,
         extra_argv: list[str] | None = None) -> Group:
    """Rank 0 (blocking: run it in a worker thread once the node serves): start ranks 1..N-1 and
    join a fresh group with them. On any failure the children are killed and the error raised."""
    import torch.distributed as dist

    leave()  # the last generation's groups, if any
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, **(extra_env or {}), RANK0_ENV: str(os.getpid())}
    children = []
    try:
        for rank in range(1, args.tp):
            cmd = [sys.executable, "-m", "examples.two_node", *argv, *(extra_argv or []),
                   "--tp-rank", str(rank), "--tp-init", init]
            child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=env)
            children.append(child)
            StderrTail.attach(child)
        device = rank_device(0)
        use_device(device)

        def rendezvous() -> tuple[Any, Any]:
            use_device(device)  # a CUDA device is per thread: the groups (NCCL's) are made in this one
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=args.tp,
                                    timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
            return _make_groups(args, 0)

        step, model = join_watching(watch_ranks(children), rendezvous)
    except BaseException:
        kill_ranks(children)
        leave()
        raise
    log.info("tp_group_ready", world_size=args.tp, generation=generation, ranks=[os.getpid(), *(c.pid for c in children)])
    return Group(0, args.tp, step, model, device, generation, children)


def watch_ranks(children: list[Any]) -> Callable[[], None]:
    """Rank 0's check while its group forms: a rank that exited fails the attempt (``RuntimeError``)."""
    def check() -> None:
        for rank, child in enumerate(children, start=1):
            if (code := child.poll()) is not None:
                raise RuntimeError(f"rank {rank} (pid {child.pid}) exited with code {code} before the group formed"
                                   + exit_reason(child, code))
    return check


def join_watching(check: Callable[[], None], rendezvous: Callable[[], Any], period_s: float = 0.2) -> Any:
    """Run ``rendezvous`` in a thread while this one calls ``check()`` every ``period_s`` (it raises,
    or ends the process, when the group cannot form): rank 0 watches the ranks it started, so that
    one that exits before the group formed fails the attempt at once, not at the join timeout (120 s:
    a new rank killed before it joined kept a heal "regrouping" that long); a rank watches rank 0.
    The waiting thread also runs the process's signal handlers (a thread blocked in the rendezvous'
    C++ never returns to Python to run them). The rendezvous cannot be interrupted: its thread is
    left to end at its own timeout, its outcome dropped (the next attempt uses another address)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = rendezvous()
        except BaseException as exc:  # noqa: BLE001 (raised below, in the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=run, name="tp-rendezvous", daemon=True)
    thread.start()
    while True:
        thread.join(period_s)
        if not thread.is_alive():
            break
        check()
    if "error" in box:
        raise box["error"]
    return box["result"]


class StderrTail:
    """Rank 0's copy of a rank's stderr: every line goes on to rank 0's own stderr (the operator sees
    the ranks' logs where they always were) and the last few are kept, so that a rank that exits
    says why where the group's cause is read (``ping`` / ``stats``, ``last_form_error``, the log),
    not only in the node's stderr ("exited with code 1" told an operator nothing)."""

    KEEP = 20

    def __init__(self, pipe: Any, out_fd: int = 2) -> None:
        import collections

        self.lines: collections.deque[bytes] = collections.deque(maxlen=self.KEEP)
        self._out_fd = out_fd
        self._thread = threading.Thread(target=self._copy, args=(pipe,), name="tp-rank-stderr", daemon=True)
        self._thread.start()

    @classmethod
    def attach(cls, child: subprocess.Popen[bytes], out_fd: int = 2) -> None:
        child.stderr_tail = cls(child.stderr, out_fd)  # type: ignore[attr-defined]

    def _copy(self, pipe: Any) -> None:
        forward = True
        with contextlib.suppress(OSError, ValueError):
            for line in iter(pipe.readline, b""):
                self.lines.append(line)
                try:
                    view = memoryview(line)
                    while forward and view:
                        view = view[os.write(self._out_fd, view):]
                except OSError:  # rank 0's stderr is gone: keep reading (a rank blocked on a full pipe would hang)
                    forward = False
        with contextlib.suppress(OSError):
            pipe.close()

    def reason(self, wait_s: float = 0.2) -> str | None:
        """The rank's last word: its last line that is not a log record (a traceback's last line, a
        one-line "cannot start"), else its last error record's event and error; None if none.
        Waits up to ``wait_s`` for the rest of a rank that just exited to be read."""
        import json

        self._thread.join(wait_s)
        for raw in reversed(list(self.lines)):
            line = raw.decode(errors="replace").strip()
            if not line:
                continue
            if not line.startswith("{"):
                return line
            try:
                rec = json.loads(line)
            except ValueError:
                return line
            if isinstance(rec, dict) and rec.get("level") in ("error", "critical"):
                detail = rec.get("error") or rec.get("cause") or str(rec.get("exception") or "").strip().rsplit("\n", 1)[-1]
                return f"{rec.get('event')}: {detail}" if detail else str(rec.get("event"))
        return None


def exit_reason(child: Any, code: int | None) -> str:
    """``": <why>"`` for a rank that exited with an error and said why on stderr, else ``""``."""
    from examples import _report

    tail = getattr(child, "stderr_tail", None)
    why = tail.reason() if tail is not None and code else None
    return f": {_report.short(why, 300)}" if why else ""


def join(args: argparse.Namespace) -> Group:
    """Ranks 1..N-1: join the group rank 0 made."""
    import torch.distributed as dist

    device = rank_device(args.tp_rank)
    use_device(device)
    rank0 = int(os.environ.get(RANK0_ENV) or os.getppid())  # rank 0 may have died before this rank got here

    def rendezvous() -> tuple[Any, Any]:
        use_device(device)  # a CUDA device is per thread: the groups (NCCL's) are made in this one
        dist.init_process_group("gloo", init_method=args.tp_init, rank=args.tp_rank, world_size=args.tp,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        return _make_groups(args, args.tp_rank)

    def check() -> None:  # rank 0 gone (its parent changed): nobody will form this group
        if os.getppid() != rank0:
            log.error("tp_rank_orphaned", rank=args.tp_rank, rank0_pid=rank0,
                      cause="rank 0 exited before the group formed")
            sys.stderr.flush()
            os._exit(1)  # the rendezvous' thread is blocked in C++: no interpreter shutdown to wait on it

    step, model = join_watching(check, rendezvous)
    return Group(args.tp_rank, args.tp, step, model, device)


def leave() -> None:
    """Leave this process's group, if any, so that the next ``init_process_group`` starts afresh.

    torch names the default group from a process-wide counter that each ``init_process_group``
    raises *before* its rendezvous and only ``destroy_process_group`` of a formed group resets:
    after one failed attempt (a rank that died before it joined) rank 0's next group was
    ``default_pg/1`` while every fresh rank's was ``default_pg/0``, their rendezvous keys never
    met, and the node never healed (every later attempt waited out the 120 s join timeout; an
    outside drill). Without a formed group, the counter is reset here."""
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    else:
        from torch.distributed import distributed_c10d

        distributed_c10d._world.group_count = 0  # what destroy_process_group does for a formed group


def wait_for_rank0_on_sigterm(wait_s: float) -> None:
    """Ranks 1..N-1 (their main thread, before they join): a SIGTERM does not end the rank at once.
    The ranks share rank 0's process group, so a stop meant for the node (a supervisor's or the
    launcher's ``killpg``, systemd's cgroup kill) reaches every rank: had they left at once, the group
    would break and rank 0's graceful stop (or its drain) would fail every live request. The rank
    goes on stepping until rank 0 stops the group (then it exits 0), for at most ``wait_s``, then
    exits 143; a second SIGTERM exits at once. Rank 0 gone: the step timeout ends the rank (before
    the group formed, ``join`` does). SIGINT (a Ctrl-C to the process group) is the same stop."""
    first: list[float] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        if first:
            sys.exit(128 + signum)
        first.append(time.monotonic())
        log.info("sigterm_rank_waits_for_rank0", pid=os.getpid(), wait_s=wait_s)
        timer = threading.Timer(wait_s, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_sigterm)


def kill_ranks(children: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every rank process still there (a stopped one too: SIGKILL needs no scheduling) and reap it."""
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(10)


def stop_ranks(children: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """Rank 0 stopping: the ranks leave when told (the group's stop); any still there are killed."""
    deadline = time.monotonic() + grace_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(max(0.0, deadline - time.monotonic()))
    kill_ranks(children)


# -- watching the ranks and naming the cause ----------------------------------------------------------

class RankWatch:
    """Rank 0: the state of every other rank of one generation, and THE cause of its end.

    Every detector (this watch, a failed step exchange, a failed model step) asks ``cause()``; the
    first answer is kept, so the text a client, ``ping`` and the log show does not depend on which
    detector fired first. A rank killed by a signal or stopped outranks one that merely exited
    (the others exit *because* the group broke)."""

    def __init__(self, role: str, children: list[subprocess.Popen[bytes]], step_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.role = role
        self.children = children
        self.step_timeout_s = step_timeout_s
        self._clock = clock
        self._stopped_since: dict[int, float] = {}
        self._lock = threading.Lock()
        self._cause: str | None = None
        self._last_poll: float | None = None  # the watchdog's last look (a gap: rank 0 itself was frozen)
        self._stall: tuple[float, float] | None = None  # (how long, when it ended) of rank 0's own last stall
        self.busy_since: float | None = None
        """When rank 0's execution thread entered a collective it has not left (None: not in one)."""

    @property
    def decided(self) -> str | None:
        return self._cause

    def _stopped_text(self, rank: int, pid: int) -> str:
        return (f"{self.role} rank {rank} (pid {pid}) stopped answering: no step exchange for "
                f"{self.step_timeout_s:g} s (the process is stopped)")

    def _own_stall(self) -> float | None:
        """How long rank 0 itself made no progress (its watchdog did not look), if longer than the step
        timeout and within a step timeout ago: stopped (SIGSTOP), or starved of CPU. Its other ranks
        then gave up on it (their exits may show a moment later)."""
        now = self._clock()
        if self._last_poll is not None and now - self._last_poll > self.step_timeout_s:
            self._stall = (now - self._last_poll, now)
        if self._stall is not None and now - self._stall[1] > self.step_timeout_s:
            self._stall = None  # long past: a later break has another cause
        return None if self._stall is None else self._stall[0]

    def _evidence(self) -> tuple[int, str] | None:
        """(strength, sentence) of the strongest sign of a broken rank now, or None. Rank 0's own
        stall past the step timeout explains whatever its other ranks did meanwhile (they leave
        cleanly when rank 0 stops answering)."""
        best = self._ranks_evidence()
        stall = self._own_stall()
        if best is not None and stall is not None:
            return (4, self._own_stall_text(stall))
        return best

    def _own_stall_text(self, stall: float) -> str:
        return (f"{self.role} rank 0 (pid {os.getpid()}) itself made no progress for {stall:.1f} s (stopped, or "
                f"starved of CPU), longer than the step timeout ({self.step_timeout_s:g} s): its ranks gave up on it")

    def _ranks_evidence(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        now = self._clock()
        for rank, child in enumerate(self.children, start=1):
            code = child.poll()
            if code is None:
                if _proc.state(child.pid) in ("T", "t"):
                    self._stopped_since.setdefault(rank, now)
                    found = (2, self._stopped_text(rank, child.pid))
                else:
                    self._stopped_since.pop(rank, None)
                    continue
            elif code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"signal {-code}"
                found = (3, f"{self.role} rank {rank} (pid {child.pid}) was killed by {name}")
            else:
                found = (1 if code else 0,
                         f"{self.role} rank {rank} (pid {child.pid}) exited with code {code}" + exit_reason(child, code))
            if best is None or found[0] > best[0]:
                best = found
        return best

    @staticmethod
    def _timed_out(exc: BaseException) -> bool:
        text = f"{type(exc).__name__} {exc}".lower()
        return "timeout" in text or "timed out" in text

    def _no_evidence_text(self, exc: BaseException | None) -> str:
        if exc is None or self._timed_out(exc):
            return f"a {self.role} rank stopped answering: no step exchange for {self.step_timeout_s:g} s"
        return f"the {self.role} group lost a connection between its ranks (no rank had exited or stopped yet)"

    def cause(self, exc: BaseException | None = None, settle_s: float = 1.0) -> str:
        """THE cause of this generation's end (decided once). With no sign on any rank yet, waits up to
        ``settle_s`` for one (a killed rank's sockets close a moment before it can be reaped)."""
        with self._lock:
            if self._cause is not None:
                return self._cause
            if exc is not None and settle_s and not self._timed_out(exc):
                # a lost connection is nearly always a rank on its way out: seen leaving (its exit
                # code, its last words) up to LOST_CONNECTION_SETTLE_S later on a busy host (a rank
                # that could not start took 1.2 s from its "cannot start" to its exit, measured)
                settle_s = max(settle_s, LOST_CONNECTION_SETTLE_S)
            deadline = self._clock() + settle_s
            while (found := self._evidence()) is None and self._clock() < deadline:
                time.sleep(0.02)
            stall = self._own_stall()
            self._cause = (found[1] if found is not None else self._own_stall_text(stall) if stall is not None
                           else self._no_evidence_text(exc))
            log.error("tp_group_broken", role=self.role, cause=self._cause)
            return self._cause

    def poll(self) -> str | None:
        """The cause, once a rank exited, was killed, stopped past the step timeout, or rank 0 sat in
        one collective past it; None while the group looks healthy (a shorter stop fails nothing)."""
        if self._cause is not None:
            return self._cause
        found = self._evidence()
        now = self._last_poll = self._clock()
        if found is not None and found[0] != 2:
            return self.cause()
        if any(now - t >= self.step_timeout_s for t in self._stopped_since.values()):
            return self.cause()
        busy = self.busy_since
        if busy is not None and now - busy >= self.step_timeout_s:
            return self.cause(settle_s=0.0)
        return None

    def collective(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a collective on rank 0's execution thread) with ``busy_since`` set; a failure
        becomes ``GroupBroken(cause)`` when it is the group's (a rank is gone, or the cause is known)."""
        self.busy_since = self._clock()
        try:
            return fn()
        except Exception as exc:
            if self._cause is None and self._evidence() is None and not _looks_like_the_group(exc):
                raise  # a model bug, not a broken group: the node reports it as it is
            raise GroupBroken(self.cause(exc)) from exc
        finally:
            self.busy_since = None


class GaveUp(RuntimeError):
    """Rank 0 could not form a group in ``--tp-reform-attempts`` attempts: the node exits 1 with this
    one line (``str()``) for its supervisor, not a traceback."""


class GroupBroken(_StepGroupBroken, RuntimeError):
    """A collective failed because the group broke; ``str()`` (and ``cause``) is the readable cause.
    An ``orchestrator.GroupBroken``, so that the decode loop marks the engine with the cause alone
    when the model's collective meets the break first, as when the step exchange does."""


def _looks_like_the_group(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in ("gloo", "Gloo", "NCCL", "Connection", "timed out", "Timed out"))


# -- rank 0's healing loop ------------------------------------------------------------------------------

def reform_backoff_s(failed: int, most_s: float) -> float:
    """The wait after the ``failed``-th failed attempt in a row to form a group: 1, 2, 4 ... s, at most ``most_s``."""
    return min(most_s, 2.0 ** (failed - 1))


class GroupNode(Protocol):
    """What a node's rank 0 gives the healer (``Healer.run``)."""

    def broken(self) -> str | None:
        """The node's own detectors: why this generation cannot serve (None while it can)."""

    async def fail(self, cause: str) -> None:
        """The group broke: refuse new work, fail every client, release what the node holds elsewhere."""

    async def stop(self) -> None:
        """After the ranks were killed: end this generation's execution thread and engine."""

    async def start(self, group: Group) -> None:
        """Serve on ``group`` (a new generation)."""

    def serving(self) -> bool:
        """Every rank of the current generation took part in a first collective: each one serves
        (a CTX rank listens for pulls before it follows rank 0's operations)."""


class Healer:
    """Rank 0: keep the node's group serving; re-form it each time it breaks (see the module docstring)."""

    def __init__(self, role: str, args: argparse.Namespace, group: Group, *,
                 extra_env: dict[str, str] | None = None, extra_argv: list[str] | None = None) -> None:
        self.role = role
        self.args = args
        self.group = group
        self.watch = RankWatch(role, group.children, args.tp_step_timeout_s)
        self.restarts = 0
        self.last_cause: str | None = None
        self.regrouping = False
        self.last_heal_s: float | None = None
        self.form_failures = 0
        """Failed attempts to form a new group, all heals together."""
        self.last_form_error: str | None = None
        self._extra_env = extra_env
        self._extra_argv = extra_argv

    def statistics(self) -> dict[str, Any]:
        return {"restarts": self.restarts, "last_cause": self.last_cause, "regrouping": self.regrouping,
                "generation": self.group.generation, "last_heal_s": self.last_heal_s,
                "form_failures": self.form_failures, "last_form_error": self.last_form_error}

    async def run(self, node: GroupNode) -> None:
        import anyio

        try:
            while True:
                while (cause := self._broken(node)) is None:
                    await anyio.sleep(WATCH_PERIOD_S)
                await self._heal(node, cause)
        finally:
            # a node stopping tells its ranks to leave, and run_in_group reaps them (stop_ranks: a
            # grace, then SIGKILL); this task is cancelled before that stop is sent, so killing them
            # here made every stop of a CTX group a break (tp_group_broken, a rank SIGKILLed). Only
            # a generation run_in_group does not know of (cancelled mid-heal) is killed here
            if self.group is not getattr(self.args, "tp_state", None):
                kill_ranks(self.group.children)

    def _broken(self, node: GroupNode) -> str | None:
        """Why the current generation cannot serve (the watch's cause, else the node's own
        detectors', read as the watch decided it), None while it can."""
        cause = self.watch.poll()
        if cause is None and (why := node.broken()) is not None:
            cause = self.watch.decided or why
        return cause

    async def _first_collective(self, node: GroupNode) -> str | None:
        """None once every rank of the new generation took part in a collective (the group serves:
        only then is it healthy again); else why it broke first, or that none came in time."""
        import anyio

        limit_s = 3 * self.args.tp_step_timeout_s + JOIN_GRACE_S
        deadline = time.monotonic() + limit_s
        while not node.serving():
            if (why := self._broken(node)) is not None:
                return why
            if time.monotonic() > deadline:
                return f"no first collective of every rank within {limit_s:g} s"
            await anyio.sleep(WATCH_PERIOD_S)
        return None

    async def _heal(self, node: GroupNode, cause: str) -> None:
        import anyio

        t0 = time.monotonic()
        self.last_cause, self.regrouping = cause, True
        log.warning("tp_group_healing", role=self.role, cause=cause, generation=self.group.generation)
        children = self.group.children  # first: rank 0's pending collectives now fail at once
        await anyio.to_thread.run_sync(kill_ranks, children)
        await node.fail(cause)
        await node.stop()
        generation = self.group.generation + 1
        limit = self.args.tp_reform_attempts
        failed = 0
        while True:
            try:
                group = await anyio.to_thread.run_sync(
                    lambda: form(self.args, self.args.argv, generation, extra_env=self._extra_env,
                                 extra_argv=self._extra_argv))
                error = None
            except Exception as exc:  # e.g. a rank could not start: try again, still refusing work
                error = f"{type(exc).__name__}: {exc}"
            if error is None:
                self.group = group
                self.watch = RankWatch(self.role, group.children, self.args.tp_step_timeout_s)
                await node.start(group)
                why = await self._first_collective(node)
                if why is None:
                    break
                # a rank that joined broke before the group's first collective (it died starting, e.g.
                # its port was taken): a failed attempt too, not a heal (before: healed, "healthy" for a
                # moment, broke again, for ever, with no backoff and no limit)
                error = f"a rank broke before the group's first collective: {why}"
                await anyio.to_thread.run_sync(kill_ranks, group.children)
                await node.fail(why)
                await node.stop()
            failed += 1
            self.form_failures += 1
            self.last_form_error = error
            wait = reform_backoff_s(failed, self.args.tp_reform_backoff_max_s)
            give_up = bool(limit) and failed >= limit
            log.error("tp_group_form_failed", role=self.role, error=self.last_form_error, attempt=failed,
                      retry_in_s=None if give_up else wait)
            if give_up:
                raise GaveUp(f"{self.role} could not form a tensor-parallel group in {failed} attempts; "
                             f"last error: {self.last_form_error}")
            await anyio.sleep(wait)
        self.restarts += 1
        self.regrouping = False
        self.last_heal_s = round(time.monotonic() - t0, 3)
        log.warning("tp_group_healed", role=self.role, generation=generation, seconds=self.last_heal_s)
