"""Load generator and report for a CTX/GEN pair: ``python -m examples.two_node client``.

For every prompt (round-robin over the CTX nodes) a request

1. sends ``prefill`` to its CTX node; the reply carries the first token and the KV handle. **TTFT**
   is the time from sending the prefill to receiving that reply;
2. opens a ``generate`` connection to the GEN node (passing the KV handle on) and reads the streamed
   tokens to ``done``, recording the arrival time of every token message.

Every control connection authenticates with the nodes' shared secret (``KVO_SHARED_SECRET`` or
``--secret-file``, as the nodes read it).

At most ``concurrency`` requests are in flight (a closed loop: ``concurrency`` workers, each starts
its next request when its last one ends, as the serving benchmarks of the field do). A failure of
one request (a control error, a ``failed``/``aborted`` state, a timeout, a refused connection) is
recorded on that request with its reason; the run goes on.

Definitions used by ``summarize``:

- a request **succeeded** when GEN said ``done`` with state ``finished``;
- **output tokens** of a request = ``first_token`` (from CTX) + every streamed token; the output
  throughput counts the output tokens of succeeded requests over the **duration** of the run (first
  request sent to last request ended);
- **TPOT** of one request with ``n >= 2`` output tokens = ``(t_last - t_first) / (n - 1)``, where
  ``t_first`` is the arrival of the first token (the prefill reply) and ``t_last`` that of the last
  token: the usual "time per output token excluding the first". It includes the KV transfer and
  any wait for admission at GEN. TPOT statistics are over requests (each request counts once);
- **ITL** = gaps between consecutive streamed token messages of a request, after the first streamed
  one (pure decode cadence, no transfer): statistics over all gaps of all succeeded requests. A
  message that carries several tokens (GEN coalesces what one decode loop pass produced) is one
  arrival: its tokens share one timestamp, and no 0-ms gap is counted between them;
- **KV checksums**: GEN reports the checksums of the KV blocks it received (per block, and per block
  and KV head, assembled from every tensor-parallel rank's heads), CTX those of the blocks
  it computed; a request whose GEN list is empty (no transfer, e.g. the ``ideal`` mode) is not
  compared. ``kv_checksum_mismatches`` counts compared requests whose lists differ.
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

from examples import _report
from examples.two_node import cli, control
from examples.two_node.common import add_security_args, node_secret
from examples.two_node.control import ControlError

BOS_ID = 256  # the byte tokenizer's BOS (examples.tiny_model.ByteTokenizer.bos_id)


@dataclasses.dataclass
class RequestRecord:
    request_id: str
    index: int
    """Index of the prompt in the workload."""
    ctx: str
    prompt_len: int
    max_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    """Output tokens: the CTX's first token, then every token GEN streamed."""
    token_times: array.array = dataclasses.field(default_factory=lambda: array.array("d"))
    """Arrival time of each output token, seconds since the run started (one entry per token)."""
    t_start: float = 0.0
    """When the prefill was sent, seconds since the run started."""
    t_end: float = 0.0
    ttft_s: float | None = None
    state: str = "pending"
    """``finished`` | ``failed`` | ``aborted`` as GEN reported it, or ``error`` for a client-side failure."""
    failure: str | None = None
    message: str = ""
    ctx_checksums: list[int] | None = None
    gen_checksums: list[int] | None = None
    ctx_head_checksums: list[list[int]] | None = None
    gen_head_checksums: list[list[int]] | None = None
    """Per block, per KV head: what a GEN of any tensor-parallel size reports (each rank its heads)."""

    @property
    def ok(self) -> bool:
        return self.state == "finished" and self.failure is None

    @property
    def checksum_ok(self) -> bool | None:
        """None when GEN received no KV (nothing to compare), else whether both lists are equal."""
        if self.gen_head_checksums:  # whole-block checksums too where the CTX has whole blocks (TP1)
            return self.gen_head_checksums == self.ctx_head_checksums and (
                not self.gen_checksums or not self.ctx_checksums or self.gen_checksums == self.ctx_checksums)
        if not self.gen_checksums:
            return None
        return self.gen_checksums == self.ctx_checksums

    def tpot_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def to_json(self, *, with_tokens: bool = False) -> dict[str, Any]:
        out = {
            "request_id": self.request_id, "index": self.index, "ctx": self.ctx, "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens, "n_tokens": len(self.tokens), "state": self.state,
            "failure": self.failure, "message": self.message, "t_start": self.t_start, "t_end": self.t_end,
            "ttft_s": self.ttft_s, "tpot_s": self.tpot_s(), "checksum_ok": self.checksum_ok,
        }
        if with_tokens:
            out["tokens"] = list(self.tokens)
        return out


@dataclasses.dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    """First request sent to last request ended."""
    concurrency: int
    started_at: float = 0.0
    """Unix time of the start."""


def make_prompts(n: int, isl: int, seed: int = 0, vocab_size: int = 256, *, bos: bool = True) -> list[list[int]]:
    """``n`` deterministic prompts of exactly ``isl`` token ids.

    Ids are printable ASCII bytes (32..126, so a prompt decodes to text with the byte tokenizer),
    limited to ``range(vocab_size)`` when the vocabulary is smaller; with ``bos`` the first id is
    BOS (256). The same ``(n, isl, seed, vocab_size)`` always gives the same prompts, and prompt
    ``i`` does not depend on ``n``.
    """
    if n < 0 or isl < 1:
        raise ValueError("n must be >= 0 and isl >= 1")
    lo, hi = (32, 127) if vocab_size >= 127 else (0, vocab_size)
    prompts = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        body = rng.integers(lo, hi, size=isl - (1 if bos else 0)).tolist()
        prompts.append([BOS_ID, *body] if bos else body)
    return prompts


def prompts_from_text(texts: Sequence[str], *, bos: bool = True) -> list[list[int]]:
    """Byte-tokenizer ids of each text (UTF-8 bytes, BOS first)."""
    return [([BOS_ID] if bos else []) + list(t.encode("utf-8")) for t in texts]


class Progress:
    """A rich progress bar (requests done / failures / tok/s) on a terminal; elsewhere (a log, a
    pipe) a plain line every ``every_s``; nothing when not wanted."""

    def __init__(self, total: int, enabled: bool, label: str, every_s: float = 5.0) -> None:
        self.enabled = enabled and _report.interactive()
        self.plain = enabled and not self.enabled
        self.label, self.every_s = label, every_s
        self._next_line = time.perf_counter() + every_s
        self.total = total
        self.done = self.failures = self.tokens = 0
        self.t0 = time.perf_counter()
        if self.enabled:
            from rich import progress as rp

            self._bar = rp.Progress(
                rp.TextColumn("[bold]{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
                rp.TextColumn("{task.fields[stats]}"), rp.TimeElapsedColumn(), transient=True,
            )
            self._task = self._bar.add_task(label, total=total, stats="")

    def __enter__(self) -> Progress:
        if self.enabled:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._bar.stop()

    def update(self, rec: RequestRecord | None = None) -> None:
        """One more done: ``rec`` (its tokens, or a failure), or an item that is not a request."""
        self.done += 1
        if rec is None:
            pass
        elif rec.ok:
            self.tokens += len(rec.tokens)
        else:
            self.failures += 1
        now = time.perf_counter()
        rate = self.tokens / max(1e-9, now - self.t0)
        if self.enabled:
            self._bar.update(self._task, completed=self.done,
                             stats=f"failures {self.failures}  {rate:,.0f} tok/s" if rec is not None else "")
        elif self.plain and (now >= self._next_line or self.done == self.total):
            self._next_line = now + self.every_s
            figures = f", failures {self.failures:,}, {rate:,.0f} tok/s" if rec is not None else ""
            print(f"{self.label}: {self.done:,}/{self.total:,} done{figures}, {now - self.t0:.0f} s",
                  file=sys.stderr, flush=True)


async def run_load(
    *,
    ctx: list[str],
    gen: str,
    secret: bytes | None,
    prompts: list[list[int]],
    max_tokens: int | list[int],
    concurrency: int,
    progress: bool = True,
    timeout_s: float = 300,
    release: bool = False,
    id_prefix: str | None = None,
    label: str = "requests",
) -> LoadResult:
    """Run every prompt once through CTX then GEN, at most ``concurrency`` at a time.

    ``secret`` is the nodes' shared secret (every control connection authenticates with it; None
    only for ``--insecure`` nodes). ``max_tokens`` is one value for all prompts or one per prompt.
    ``timeout_s`` bounds each request
    (prefill + generate). With ``release`` the client also tells the CTX node to release the
    request's KV once the request ended (only needed when GEN never pulls, e.g. an ``ideal`` GEN
    on a CTX without a lease). Request ids are ``{id_prefix}-{index}`` (a random prefix by default).
    Must run on the asyncio backend (anyio).
    """
    if not ctx:
        raise ValueError("at least one CTX address is needed")
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    n = len(prompts)
    mts = [max_tokens] * n if isinstance(max_tokens, int) else list(max_tokens)
    if len(mts) != n:
        raise ValueError("max_tokens must be an int or one value per prompt")
    prefix = id_prefix or uuid.uuid4().hex[:8]
    records: list[RequestRecord | None] = [None] * n
    t_run = time.perf_counter()
    started_at = time.time()
    indices = iter(range(n))

    async def one(i: int) -> RequestRecord:
        ctx_addr = ctx[i % len(ctx)]
        rec = RequestRecord(f"{prefix}-{i}", i, ctx_addr, len(prompts[i]), mts[i])
        rec.t_start = time.perf_counter() - t_run
        phase = "prefill"
        handle: str | None = None
        try:
            with anyio.fail_after(timeout_s):
                reply = await control.call(
                    ctx_addr,
                    {"op": "prefill", "request_id": rec.request_id, "prompt_ids": prompts[i], "max_tokens": mts[i]},
                    secret=secret, timeout=timeout_s,
                )
                handle = reply.get("kv_handle")
                now = time.perf_counter() - t_run
                rec.ttft_s = now - rec.t_start
                rec.tokens.append(int(reply["first_token"]))
                rec.token_times.append(now)
                rec.ctx_checksums = list(reply.get("block_checksums") or [])
                rec.ctx_head_checksums = list(reply.get("head_checksums") or [])
                phase = "generate"
                stream = await control.connect(gen, secret=secret)
                try:
                    await stream.send({
                        "op": "generate", "request_id": rec.request_id, "prompt_len": int(reply["prompt_len"]),
                        "first_token": int(reply["first_token"]), "max_tokens": mts[i], "kv_peer": reply["kv_peer"],
                        "kv_handle": handle, **({"kv_sources": reply["kv_sources"]} if reply.get("kv_sources") else {}),
                    })
                    while True:
                        msg = await stream.receive()
                        if msg.get("ok") is False:
                            raise ControlError(str(msg.get("error")))
                        toks = msg.get("tokens")
                        if toks:
                            now = time.perf_counter() - t_run
                            rec.tokens.extend(int(t) for t in toks)
                            rec.token_times.extend([now] * len(toks))
                        if msg.get("done"):
                            rec.state = str(msg.get("state"))
                            rec.failure = msg.get("failure")
                            rec.message = str(msg.get("message") or "")
                            rec.gen_checksums = list(msg.get("kv_checksums") or [])
                            rec.gen_head_checksums = list(msg.get("kv_head_checksums") or [])
                            if rec.state != "finished" and rec.failure is None:
                                rec.failure = rec.state
                            break
                finally:
                    with anyio.CancelScope(shield=True):
                        await stream.aclose()
        except TimeoutError:
            rec.state, rec.failure, rec.message = "error", "timeout", f"no answer within {timeout_s} s ({phase})"
        except ControlError as exc:
            rec.state, rec.failure, rec.message = "error", f"{phase}_rejected", str(exc)
        except anyio.EndOfStream:  # the node went away mid-request (stopped, killed): which one, as a reset says
            where = ctx_addr if phase == "prefill" else gen
            rec.state, rec.failure, rec.message = "error", f"{phase}_closed", f"{where}: the node closed the connection"
        except OSError as exc:  # which node could not be reached (a wrong --ctx or --gen), not only why
            where = ctx_addr if phase == "prefill" else gen
            rec.state, rec.failure, rec.message = "error", f"{phase}_error", f"{where}: {type(exc).__name__}: {exc}"
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:  # reset mid-request: a node killed
            where, why = (ctx_addr if phase == "prefill" else gen), exc.__cause__  # (its own text is empty)
            rec.state, rec.failure = "error", f"{phase}_error"
            rec.message = f"{where}: the connection broke" + (f" ({type(why).__name__}: {why})" if why else "")
        except (KeyError, ValueError, TypeError) as exc:
            rec.state, rec.failure, rec.message = "error", f"{phase}_error", f"{type(exc).__name__}: {exc}"
        if handle is not None and (release or not rec.ok):
            # asked for, or the request failed after its prefill: the CTX need not hold the KV
            # until its lease ends (best effort, bounded; a GEN that pulled has freed it already)
            with anyio.move_on_after(5, shield=True):
                try:
                    await control.call(ctx_addr, {"op": "release", "request_id": rec.request_id, "kv_handle": handle},
                                       secret=secret, timeout=5)
                except Exception:  # noqa: BLE001 - unknown request, node gone: nothing more to free
                    pass
        rec.t_end = time.perf_counter() - t_run
        return rec

    with Progress(n, progress, label) as bar:

        async def worker() -> None:
            for i in indices:  # shared iterator: each worker takes the next prompt when free
                rec = await one(i)
                records[i] = rec
                bar.update(rec)

        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, n)):
                tg.start_soon(worker)
    duration = time.perf_counter() - t_run
    return LoadResult([r for r in records if r is not None], duration, concurrency, started_at)


async def run_load_http(
    *,
    endpoint: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    progress: bool = True,
    timeout_s: float = 300,
    model: str = "tiny",
    label: str = "requests",
) -> LoadResult:
    """The same closed-loop load through an OpenAI-compatible front (``python -m examples.serve``):
    ``POST {endpoint}/v1/completions`` with the prompt's token ids, streaming, read as the field's
    benchmark clients read SSE (``data:`` chunks to ``data: [DONE]``). Token ids come from the
    chunks' ``token_ids`` (vLLM's ``return_token_ids``); TTFT is the arrival of the first token.
    Records have the shape of ``run_load``'s, so ``summarize`` and the report apply unchanged."""
    import httpx

    n = len(prompts)
    records: list[RequestRecord | None] = [None] * n
    t_run = time.perf_counter()
    started_at = time.time()
    indices = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(http: httpx.AsyncClient, i: int) -> RequestRecord:
        rec = RequestRecord(f"http-{i}", i, endpoint, len(prompts[i]), max_tokens)
        rec.t_start = time.perf_counter() - t_run
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        try:
            with anyio.fail_after(timeout_s):
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        text = (await r.aread()).decode(errors="replace")
                        rec.state, rec.failure, rec.message = "error", f"http_{r.status_code}", text[:200]
                    else:
                        finish = None
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                            ids = choice.get("token_ids") or []
                            if ids:
                                now = time.perf_counter() - t_run
                                if rec.ttft_s is None:
                                    rec.ttft_s = now - rec.t_start
                                rec.tokens.extend(int(t) for t in ids)
                                rec.token_times.extend([now] * len(ids))
                            finish = choice.get("finish_reason") or finish
                        rec.state = "finished" if finish in ("length", "stop") else "error"
                        if rec.state != "finished":
                            rec.failure, rec.message = "incomplete", f"stream ended with finish_reason {finish!r}"
        except TimeoutError:
            rec.state, rec.failure, rec.message = "error", "timeout", f"no answer within {timeout_s} s"
        except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
            rec.state, rec.failure, rec.message = "error", "http_error", f"{type(exc).__name__}: {exc}"
        rec.t_end = time.perf_counter() - t_run
        return rec

    with Progress(n, progress, label) as bar:
        async with httpx.AsyncClient(base_url=endpoint.rstrip("/"), timeout=timeout_s, limits=limits) as http:

            async def worker() -> None:
                for i in indices:
                    rec = await one(http, i)
                    records[i] = rec
                    bar.update(rec)

            async with anyio.create_task_group() as tg:
                for _ in range(min(concurrency, n)):
                    tg.start_soon(worker)
    return LoadResult([r for r in records if r is not None], time.perf_counter() - t_run, concurrency, started_at)


def summarize(result: LoadResult) -> dict[str, Any]:
    """Figures of one run (see the module docstring for the definitions).

    ``ttft_ms``/``tpot_ms``/``e2e_ms``: {mean, p50, p95, p99, max, n} over succeeded requests;
    ``itl_ms`` the same over all inter-token gaps; ``failure_reasons``: {reason: count}.
    """
    recs = result.records
    ok = [r for r in recs if r.ok]
    out_tokens = sum(len(r.tokens) for r in ok)
    tpots = [t for r in ok if (t := r.tpot_s()) is not None]
    itl: list[float] = []
    for r in ok:
        arrivals = message_times(r)
        if arrivals.size >= 2:
            itl.extend(np.diff(arrivals).tolist())
    compared = [r for r in recs if r.checksum_ok is not None]
    duration = result.duration_s
    messages: dict[str, str] = {}  # the first message of each failure reason: what to tell a person
    for r in recs:
        if not r.ok:
            messages.setdefault(r.failure or r.state, r.message)
    measured = bool(ok) and duration > 0  # no succeeded request: no throughput figure, not a 0
    return {
        "requests": len(recs),
        "succeeded": len(ok),
        "failures": len(recs) - len(ok),
        "failure_reasons": dict(Counter(r.failure or r.state for r in recs if not r.ok)),
        "failure_messages": messages,
        "output_tokens": out_tokens,
        "duration_s": duration,
        "output_tok_s": out_tokens / duration if measured else None,
        "request_s": len(ok) / duration if measured else None,
        "concurrency": result.concurrency,
        "ttft_ms": _report.dist((r.ttft_s for r in ok if r.ttft_s is not None), scale=1e3),
        "tpot_ms": _report.dist(tpots, scale=1e3),
        "itl_ms": _report.dist(itl, scale=1e3),
        "e2e_ms": _report.dist((r.t_end - r.t_start for r in ok), scale=1e3),
        "kv_checksum_compared": len(compared),
        "kv_checksum_mismatches": sum(1 for r in compared if not r.checksum_ok),
    }


def message_times(rec: RequestRecord) -> np.ndarray:
    """Arrival time of each streamed token message of ``rec`` (after the CTX's first token): its
    tokens share their message's timestamp, so one entry per distinct consecutive time."""
    tt = np.frombuffer(rec.token_times, dtype=np.float64)[1:]
    return tt[np.r_[True, np.diff(tt) != 0]] if tt.size else tt


def print_summary(summary: dict[str, Any], title: str = "load") -> None:
    s = summary
    rows: list[list[Any]] = [
        ["requests (ok / failed)", f"{s['succeeded']:,} / {s['failures']:,}"],
        ["output tok/s", s["output_tok_s"]],
        ["duration s", s["duration_s"]],
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[name]
        rows.append([f"{name[:-3].upper()} ms mean / p50 / p95 / p99",
                     " / ".join(_report.fmt(d[k]) for k in ("mean", "p50", "p95", "p99"))])
    rows.append(["KV checksums compared / mismatched", f"{s['kv_checksum_compared']:,} / {s['kv_checksum_mismatches']:,}"])
    for reason, count in s["failure_reasons"].items():  # the first message of each: why, not only how many
        message = s.get("failure_messages", {}).get(reason) or "(no message)"
        rows.append([f"failed: {reason} x{count:,}", _report.short(message)])
    _report.print_table(title, ["metric", "value"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.two_node client",
                                description="Send a synthetic workload through CTX and GEN nodes and report.")
    p.add_argument("--ctx", action="append", default=[], metavar="HOST:PORT", type=cli.address,
                   help="a CTX node's control address (repeatable)")
    p.add_argument("--gen", metavar="HOST:PORT", type=cli.address, help="the GEN node's control address")
    p.add_argument("--endpoint", metavar="URL",
                   help="drive an OpenAI-compatible front instead (python -m examples.serve), e.g. http://127.0.0.1:8000")
    p.add_argument("--isl", type=cli.positive_int, default=256, help="input (prompt) length, tokens")
    p.add_argument("--osl", type=cli.positive_int, default=32, help="output length (max_tokens), tokens")
    p.add_argument("--concurrency", type=cli.positive_int, default=16)
    p.add_argument("--requests", type=cli.positive_int, default=64)
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--prompt", action="append", help="use this text as a prompt instead (repeatable; --requests cycles over them)")
    p.add_argument("--timeout", type=cli.positive_float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--release", action="store_true", help="tell CTX to release each request's KV at the end")
    p.add_argument("--json", metavar="PATH", type=cli.writable_file, help="write the summary and per-request records here")
    p.add_argument("--show", type=cli.non_negative_int, default=0, metavar="N", help="print the text of the first N answers")
    p.add_argument("--no-progress", action="store_true")
    add_security_args(p)
    a = p.parse_args(argv)
    if not a.endpoint and (not a.ctx or not a.gen):
        p.error("give --ctx and --gen (the nodes' control addresses), or --endpoint (a front's URL)")
    secret = None if a.endpoint else node_secret(a)  # like the nodes: KVO_SHARED_SECRET or --secret-file
    if a.prompt:
        base = prompts_from_text(a.prompt)
        prompts = [base[i % len(base)] for i in range(a.requests)]
    else:
        prompts = make_prompts(a.requests, a.isl, a.seed)
    with cli.unwinding():
        if a.endpoint:
            result = anyio.run(lambda: run_load_http(endpoint=a.endpoint, prompts=prompts, max_tokens=a.osl,
                                                     concurrency=a.concurrency, progress=not a.no_progress,
                                                     timeout_s=a.timeout), backend="asyncio")
        else:
            result = anyio.run(
                lambda: run_load(ctx=a.ctx, gen=a.gen, secret=secret, prompts=prompts, max_tokens=a.osl,
                                 concurrency=a.concurrency, progress=not a.no_progress, timeout_s=a.timeout,
                                 release=a.release),
                backend="asyncio",
            )
    summary = summarize(result)
    print_summary(summary, f"{len(prompts)} requests, concurrency {a.concurrency}")
    for rec in result.records[: a.show]:
        text = bytes(t for t in rec.tokens if 0 <= t < 256).decode("utf-8", errors="replace")
        print(f"[{rec.index}] {rec.state}: {text!r}")
    if a.json:
        _report.write_json(a.json, {
            "summary": summary,
            "config": {k: v for k, v in vars(a).items() if k != "json"},
            "records": [r.to_json(with_tokens=True) for r in result.records],
        })
    why = [m for m, bad in [(f"{summary['failures']:,} of {summary['requests']:,} requests failed", summary["failures"]),
                            (f"{summary['kv_checksum_mismatches']:,} KV checksum mismatches",
                             summary["kv_checksum_mismatches"])] if bad]
    if why:
        print("FAILED: " + ", ".join(why), file=sys.stderr)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
