"""What a step agrees on, and how: one rank's events, their compact wire form, and the agreements.

Every ``GenEngine.step()`` is prepare -> agree -> apply, for every tensor-parallel size::

    prepare   this rank's local events since its last step, in the order they happened:
              (rank 0) submissions and aborts, commands; (every rank) receive outcomes, blocks
              that went quiet, the tokens its last decode sampled (as a digest; rank 0 sends the
              tokens and finish decisions themselves), its rolling admission digest
    agree     SoloAgreement: identity (a group of one).  A group: one collective, every rank's
              ``StepMessage`` in rank order (TorchStepSync over torch.distributed; LocalGroup for
              ranks in one process)
    apply     GenEngine: the one path (tokens, events, outcomes, admission, decode)

The wire form (``encode``/``decode``) is a fixed little-endian header per rank and flat arrays, no
pickle: request ids are replaced by the group sequence number each request gets at arrival, so an
outcome is 5 bytes and a token 4. A submission carries its request once, at arrival.
``TorchStepSync`` moves it in one all-gather of a fixed slot; a step whose largest message
overflows the slot (many arrivals at once) adds a second all-gather of the overflow only.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import threading
import zlib
from collections.abc import Callable, Sequence as Seq
from typing import Any, NamedTuple, Protocol

import numpy as np

from ._errors import OrchestratorError
from ._requests import FailureReason, GenRequest, KVSource
from ._sampling import SamplingParams


class GroupBroken(OrchestratorError):
    """The step's agreement could not be reached (a rank died, stopped answering, or the ranks
    disagree). ``cause`` is a sentence a person can act on."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


@dataclasses.dataclass(frozen=True, slots=True)
class Submit:
    seq: int
    request: GenRequest


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    seq: int


class Outcome(NamedTuple):
    """One rank's receive of request ``seq`` ended: ok (``failure`` None) or failed; ``quiet``:
    nothing may write into its blocks any more (else a later step's ``quiet`` list says so)."""

    seq: int
    failure: FailureReason | None = None
    message: str = ""
    quiet: bool = True


FINISH = 1 << 31
"""Set on a token in ``StepMessage.tokens``: rank 0 decided the request ends with this token."""


@dataclasses.dataclass
class StepMessage:
    """One rank's contribution to a step."""

    events: list[Submit | Abort] = dataclasses.field(default_factory=list)
    """Rank 0: submissions and aborts in the order they arrived."""
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    quiet: list[int] = dataclasses.field(default_factory=list)
    """Requests whose blocks went quiet here since they were reported (a late landing ended)."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    """Rank 0: the tokens its last decode sampled, in batch order, each with ``FINISH`` when the
    request ends with it. The group's tokens and finish decisions are these."""
    batch_digest: int = 0
    """CRC32 over the last decoded batch on this rank: sequence numbers, input and sampled tokens."""
    admitted: tuple[int, int] = (0, 0)
    """(count, CRC32 chained over sequence numbers) of every admission on this rank so far."""
    config: int = 0
    """CRC32 of the settings every rank must share to admit alike (``config_digest``)."""
    commands: list[Any] = dataclasses.field(default_factory=list)
    """Rank 0: JSON-able payloads every rank's ``on_command`` runs at this step (``broadcast``)."""
    stop: bool = False
    broken: str = ""
    """Why this rank cannot go on (its receive group died, its decode step raised): the group breaks."""


class Agreement(Protocol):
    """How a step's messages are agreed: every rank's message, in rank order."""

    rank: int
    world_size: int

    def agree(self, message: StepMessage) -> list[StepMessage]: ...


class SoloAgreement:
    """A group of one: the agreement is the rank's own message."""

    rank = 0
    world_size = 1

    def agree(self, message: StepMessage) -> list[StepMessage]:
        return [message]


# -- wire form -------------------------------------------------------------------------------------
_HEADER = struct.Struct("<IHBBIIIIIIIIIII")
# total length, version, flags, pad, admitted count, admitted crc, batch digest, config digest,
# n outcomes, n quiet, n tokens, events bytes, n events, commands bytes, broken bytes
_VERSION = 2
_STOP, _BROKEN = 1, 2
_REASONS = list(FailureReason)
_CODE = {r: i + 1 for i, r in enumerate(_REASONS)}
_BUSY = 0x80
_MSG_MAX = 240  # bytes of a failure message kept (the client's text; the full one is in the rank's log)
# aborts as (position, sequence number) pairs; one fixed record per submission, then its strings
_EVENT = np.dtype([("flags", "u1"), ("peer", "u1"), ("id_len", "u1"), ("seq", "<u4"),
                   ("prompt_len", "<u4"), ("first_token", "<u4"), ("max_tokens", "<u4"), ("eos", "<u4"),
                   ("handle", "V16")])
_HAS_EOS, _HEX_HANDLE, _EXTRA = 1, 2, 4
_NO_PEER = 255


def _put_str(out: bytearray, s: str | None, wide: bool = False) -> None:
    b = b"" if s is None else s.encode()
    out += struct.pack("<I" if wide else "<B", len(b) + (s is not None))  # wide: a step's ids, peers, extras
    out += b


def _get_str(buf: memoryview, at: int, wide: bool = False) -> tuple[str | None, int]:
    if wide:
        (n,) = struct.unpack_from("<I", buf, at)
        at += 4
    else:
        n = buf[at]
        at += 1
    if n == 0:
        return None, at
    return bytes(buf[at : at + n - 1]).decode(), at + n - 1


def _hex16(handle: str) -> bytes | None:
    """The 16 raw bytes of a 32-hex-character handle (the form a CTX issues), else None."""
    if len(handle) != 32:
        return None
    try:
        raw = bytes.fromhex(handle)
    except ValueError:
        return None
    return raw if raw.hex() == handle else None


def _encode_events(events: Seq[Submit | Abort]) -> bytes:
    """Aborts as (position, sequence number) pairs; submissions as fixed records (ints; a handle as
    16 raw bytes), then the peers (each once), the ids, and one JSON line for what is rare (fan-in
    sources, another handle form, added fields)."""
    if not events:
        return b""
    rows: list[tuple[Any, ...]] = []
    peers: dict[str, int] = {}
    ids: list[str] = []
    extras: list[Any] = []
    none = bytes(16)
    aborts: list[tuple[int, int]] = []  # (position in the event list, sequence number)
    for position, ev in enumerate(events):
        if isinstance(ev, Abort):
            aborts.append((position, ev.seq))
            continue
        r = ev.request
        if r.local_kv is not None or r.kv_slice is not None:
            raise ValueError(f"{r.request_id}: local_kv and kv_slice do not cross a tensor-parallel group")
        flags = _HAS_EOS if r.eos_token is not None else 0
        extra = _request_extra(r)
        raw = _hex16(r.kv_handle) if r.kv_handle is not None else None
        if raw is not None:
            flags |= _HEX_HANDLE
        elif r.kv_handle is not None:
            extra["kv_handle"] = r.kv_handle
        if r.kv_sources:
            extra["kv_sources"] = [[s.peer, s.head_start, s.head_end, s.kv_handle, _runs(s.kv_blocks), s.kv_epoch]
                                   for s in r.kv_sources]
        if r.kv_blocks is not None:
            extra["kv_blocks"] = _runs(r.kv_blocks)
        if extra:
            flags |= _EXTRA
            extras.append(extra)
        peer = _NO_PEER if r.peer is None else peers.setdefault(r.peer, len(peers))
        rows.append((flags, peer, len(r.request_id), ev.seq, r.prompt_len, r.first_token,
                     r.max_tokens, r.eos_token or 0, raw or none))
        ids.append(r.request_id)
    recs = np.array(rows, dtype=_EVENT)
    if len(peers) >= _NO_PEER:
        raise ValueError("more than 254 CTX peers in one step's arrivals")
    tail = bytearray()
    _put_str(tail, "\n".join(peers) if peers else None, wide=True)
    _put_str(tail, "".join(ids) if ids else None, wide=True)
    _put_str(tail, json.dumps(extras, separators=(",", ":")) if extras else None, wide=True)
    return (struct.pack("<I", len(aborts)) + np.asarray(aborts, dtype="<u4").tobytes() + recs.tobytes()
            + bytes(tail))


_BASE_FIELDS = {"request_id", "prompt_len", "first_token", "max_tokens", "peer", "kv_handle", "kv_slice",
                "eos_token", "local_kv", "kv_sources", "kv_blocks"}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenRequest)}
_EXTRA_FIELDS = tuple(f.name for f in dataclasses.fields(GenRequest) if f.name not in _BASE_FIELDS)


def _runs(blocks: tuple[int, ...] | None) -> list[int] | None:
    """Block ids as flat ``[start, length, ...]`` runs (a CTX allocates mostly in runs)."""
    if blocks is None:
        return None
    out: list[int] = []
    for b in blocks:
        if out and out[-2] + out[-1] == b:
            out[-1] += 1
        else:
            out += [b, 1]
    return out


def _blocks(runs: list[int] | None) -> tuple[int, ...] | None:
    if runs is None:
        return None
    return tuple(b for i in range(0, len(runs), 2) for b in range(runs[i], runs[i] + runs[i + 1]))


def _request_extra(r: GenRequest) -> dict[str, Any]:
    """Fields of ``GenRequest`` beyond the fixed ones (JSON-able values), so that a field added to
    the request reaches every rank without a wire change."""
    extra = {}
    for name in _EXTRA_FIELDS:
        value = getattr(r, name)
        if value is not None:
            extra[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return extra


def _new_request(fields: dict[str, Any]) -> GenRequest:
    """A ``GenRequest`` from decoded fields (rank 0 validated it at submit), built as unpickling
    builds one: without running ``__init__`` field by field."""
    r = object.__new__(GenRequest)
    r.__dict__.update(_DEFAULTS, **fields)
    return r


def _decode_events(buf: memoryview, n: int) -> list[Submit | Abort]:
    if n == 0:
        return []
    (n_abort,) = struct.unpack_from("<I", buf, 0)
    aborts = np.frombuffer(buf, dtype="<u4", count=2 * n_abort, offset=4).reshape(-1, 2).tolist()
    at = 4 + 8 * n_abort
    n_sub = n - n_abort
    recs = np.frombuffer(buf, dtype=_EVENT, count=n_sub, offset=at)
    at += recs.nbytes
    peer_s, at = _get_str(buf, at, wide=True)
    id_s, at = _get_str(buf, at, wide=True)
    extra_s, at = _get_str(buf, at, wide=True)
    peers = peer_s.split("\n") if peer_s is not None else []
    extras = iter(json.loads(extra_s)) if extra_s else iter(())
    ids = id_s or ""
    flags_a, peer_a, id_lens, seqs, prompt_a, first_a, max_a, eos_a = (
        recs[k].tolist() for k in ("flags", "peer", "id_len", "seq", "prompt_len", "first_token", "max_tokens", "eos"))
    handles = recs["handle"].tobytes()
    events: list[Submit | Abort] = []
    pos = 0
    for i in range(n_sub):
        flags = flags_a[i]
        fields: dict[str, Any] = {
            "request_id": ids[pos : pos + id_lens[i]], "prompt_len": prompt_a[i], "first_token": first_a[i],
            "max_tokens": max_a[i], "peer": None if peer_a[i] == _NO_PEER else peers[peer_a[i]],
            "eos_token": eos_a[i] if flags & _HAS_EOS else None,
        }
        pos += id_lens[i]
        if flags & _HEX_HANDLE:
            fields["kv_handle"] = handles[16 * i : 16 * i + 16].hex()
        if flags & _EXTRA:
            extra = next(extras)
            if "kv_sources" in extra:
                extra["kv_sources"] = tuple(KVSource(p, h0, h1, h, _blocks(b), e) for p, h0, h1, h, b, e in extra["kv_sources"])
            if "kv_blocks" in extra:
                extra["kv_blocks"] = _blocks(extra["kv_blocks"])
            fields.update(_restore_extra(extra))
        events.append(Submit(seqs[i], _new_request(fields)))
    for position, seq in aborts:  # in arrival order among the submissions
        events.insert(position, Abort(seq))
    return events


def _restore_extra(extra: dict[str, Any]) -> dict[str, Any]:
    return {name: _EXTRA_TYPES[name](value) if name in _EXTRA_TYPES and isinstance(value, dict) else value
            for name, value in extra.items()}


_EXTRA_TYPES: dict[str, Callable[[dict[str, Any]], Any]] = {"sampling": SamplingParams.from_wire}
"""Field name -> constructor from a dict, for dataclass-valued request fields."""


def encode(m: StepMessage) -> bytes:
    """The message's wire form (see the module docstring)."""
    events = _encode_events(m.events)
    commands = json.dumps(m.commands, separators=(",", ":")).encode() if m.commands else b""
    broken = m.broken.encode()
    seqs = np.fromiter((o.seq for o in m.outcomes), dtype="<u4", count=len(m.outcomes))
    codes = np.fromiter(((_CODE[o.failure] if o.failure else 0) | (0 if o.quiet else _BUSY) for o in m.outcomes),
                        dtype=np.uint8, count=len(m.outcomes))
    messages = bytearray()
    for o in m.outcomes:
        if o.failure is not None:
            _put_str(messages, o.message.encode()[:_MSG_MAX].decode(errors="ignore"))
    body = b"".join((seqs.tobytes(), codes.tobytes(), bytes(messages), np.asarray(m.quiet, dtype="<u4").tobytes(),
                     np.asarray(m.tokens, dtype="<u4").tobytes(), events, commands, broken))
    flags = (_STOP if m.stop else 0) | (_BROKEN if m.broken else 0)
    header = _HEADER.pack(_HEADER.size + len(body), _VERSION, flags, 0, m.admitted[0] & 0xFFFFFFFF, m.admitted[1],
                          m.batch_digest, m.config, len(m.outcomes), len(m.quiet), len(m.tokens), len(events), len(m.events),
                          len(commands), len(broken))
    return header + body


def decode(data: bytes | memoryview) -> StepMessage:
    buf = memoryview(data)
    if len(buf) < _HEADER.size:  # an older build's header was shorter: say so, not struct.error
        version = struct.unpack_from("<H", buf, 4)[0] if len(buf) >= 6 else None
        raise ValueError(f"step message version {version}, {len(buf)} bytes, shorter than this build's "
                         f"{_HEADER.size}-byte header: not this build's")
    (total, version, flags, _, count, crc, digest, config, n_out, n_quiet, n_tok, ev_len, n_ev, cmd_len,
     broken_len) = _HEADER.unpack_from(buf, 0)
    if version != _VERSION or total > len(buf):
        raise ValueError(f"step message version {version}, {total} bytes of {len(buf)}: not this build's")
    at = _HEADER.size
    seqs = np.frombuffer(buf, dtype="<u4", count=n_out, offset=at)
    at += 4 * n_out
    codes = np.frombuffer(buf, dtype=np.uint8, count=n_out, offset=at)
    at += n_out
    outcomes = []
    for seq, code in zip(seqs.tolist(), codes.tolist()):
        if code & ~_BUSY:
            text, at = _get_str(buf, at)
            outcomes.append(Outcome(seq, _REASONS[(code & ~_BUSY) - 1], text or "", not code & _BUSY))
        else:
            outcomes.append(Outcome(seq, None, "", not code & _BUSY))
    quiet = np.frombuffer(buf, dtype="<u4", count=n_quiet, offset=at).tolist()
    at += 4 * n_quiet
    tokens = np.frombuffer(buf, dtype="<u4", count=n_tok, offset=at).tolist()
    at += 4 * n_tok
    events = _decode_events(buf[at : at + ev_len], n_ev)
    at += ev_len
    commands = json.loads(bytes(buf[at : at + cmd_len])) if cmd_len else []
    at += cmd_len
    broken = bytes(buf[at : at + broken_len]).decode()
    return StepMessage(events, outcomes, quiet, tokens, digest, (count, crc), config, commands,
                       stop=bool(flags & _STOP), broken=broken)


CONFIG_FIELDS = ("mode", "num_blocks", "transfer_budget_bytes", "max_num_seqs", "prefetch_seqs", "max_model_len",
                 "total_kv_heads")
"""The settings every rank of a group must share (with its layout's but for the head offset): a
rank that differs in one admits, defers or refuses differently, and the group would break at the
first request where it shows (``config_digest``)."""


def config_digest(config: Any) -> int:
    """CRC32 over ``CONFIG_FIELDS`` of an ``OrchestratorConfig`` and its layout's shape and dtype."""
    lay = config.layout
    values = [getattr(config, name) for name in CONFIG_FIELDS]
    values += [lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, str(lay.dtype)]
    return zlib.crc32(repr(values).encode())


def chain_crc(crc: int, *values: int) -> int:
    """CRC32 of ``values`` (as u32) chained onto ``crc``: the digests' one function."""
    return zlib.crc32(np.asarray(values, dtype="<u4").tobytes(), crc)


def rows_crc(*columns: Seq[int]) -> int:
    """``chain_crc`` from 0 over every row of ``columns`` (one value from each, as u32), in one
    call: CRC32 chains, so that is the CRC32 of the rows laid end to end (a step's batch digest is
    one call per step, not one per request)."""
    return zlib.crc32(np.array(columns, dtype="<u4").T.tobytes())


# -- agreements for a group --------------------------------------------------------------------------
class TorchStepSync:
    """The step agreement of a group on ``torch.distributed`` (a gloo group of its own: the
    model's collectives run on another group, with their own timeout).

    One ``all_gather`` of a ``slot_bytes`` slot per step; a step whose largest message is longer adds
    one ``all_gather`` of the overflow. ``describe_failure(exc)`` turns a failed collective into
    the cause the engine reports (the node knows which rank died or stopped); without it the cause
    names the collective's error."""

    def __init__(self, group: Any = None, *, slot_bytes: int = 8192,
                 describe_failure: Callable[[BaseException], str] | None = None) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        self._torch = torch
        self._group = group
        self._slot = slot_bytes
        self._describe = describe_failure
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._out = [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(self.world_size)]
        self._mine = torch.empty(slot_bytes, dtype=torch.uint8)

    def agree(self, message: StepMessage) -> list[StepMessage]:
        slots = self.exchange_bytes(encode(message))
        out = []
        for rank, data in enumerate(slots):
            try:
                out.append(decode(data))
            except Exception as exc:  # another build's rank, or a corrupt slot: the group cannot go on
                raise GroupBroken(f"rank {rank}'s step message could not be read at rank {self.rank}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        return out

    def exchange_bytes(self, data: bytes) -> list[bytes]:
        torch = self._torch
        try:
            head = data[: self._slot]
            self._mine[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            self._dist.all_gather(self._out, self._mine, group=self._group)
            slots = [bytes(t.numpy()) for t in self._out]
            totals = [struct.unpack_from("<I", s, 0)[0] for s in slots]
            extra = max(totals) - self._slot
            if extra <= 0:
                return [s[:n] for s, n in zip(slots, totals)]
            rest = torch.zeros(extra, dtype=torch.uint8)
            tail = data[self._slot :]
            if tail:
                rest[: len(tail)] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
            rests = [torch.empty(extra, dtype=torch.uint8) for _ in range(self.world_size)]
            self._dist.all_gather(rests, rest, group=self._group)
            return [(s + bytes(r.numpy()))[:n] for s, r, n in zip(slots, rests, totals)]
        except Exception as exc:
            cause = self._describe(exc) if self._describe is not None else (
                f"tensor-parallel step exchange failed at rank {self.rank}: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}")
            raise GroupBroken(cause) from exc


class LocalGroup:
    """N ranks in one process (tests, the replay). Two ways to step them:

    - ``LocalGroup.step_all(engines)``: one thread prepares every rank, agrees and applies each;
    - each rank's ``step()`` on its own thread: ``sync(rank)`` meets the others at a barrier
      (``timeout_s``; a rank that does not come breaks the group).

    Either way every message goes through the wire form, as it would between processes."""

    class _Sync:
        def __init__(self, group: LocalGroup, rank: int) -> None:
            self._group = group
            self.rank = rank
            self.world_size = group.world_size

        def agree(self, message: StepMessage) -> list[StepMessage]:
            return self._group._meet(self.rank, encode(message))

    def __init__(self, world_size: int, timeout_s: float = 10.0) -> None:
        self.world_size = world_size
        self._timeout_s = timeout_s
        self._slots: list[bytes] = [b""] * world_size
        self._barrier = threading.Barrier(world_size)

    def sync(self, rank: int) -> Agreement:
        return self._Sync(self, rank)

    def _meet(self, rank: int, data: bytes) -> list[StepMessage]:
        try:
            self._slots[rank] = data
            self._barrier.wait(self._timeout_s)
            out = [decode(s) for s in self._slots]
            self._barrier.wait(self._timeout_s)  # nobody overwrites a slot before everyone read it
            return out
        except threading.BrokenBarrierError:
            self._barrier.abort()
            raise GroupBroken(f"a tensor-parallel rank did not join the step exchange within {self._timeout_s:g} s") from None

    @staticmethod
    def prepare_all(engines: Seq[Any]) -> tuple[list[Any], list[StepMessage]]:
        """Every rank's prepared step, and the messages they agree on (through the wire form): each
        rank then applies them (``apply_step``), here or on a thread of its own."""
        prepared = [e.prepare_step() for e in engines]
        return prepared, [decode(encode(p.message)) for p in prepared]

    @staticmethod
    def step_all(engines: Seq[Any]) -> list[Any]:
        """Step every rank once, in lockstep, from this thread."""
        prepared, messages = LocalGroup.prepare_all(engines)
        return [e.apply_step(p, messages) for e, p in zip(engines, prepared)]
