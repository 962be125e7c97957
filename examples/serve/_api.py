"""The OpenAI-compatible surface: request validation, the chat template, detokenizing with stop
strings, and the shapes of responses, chunks and errors. No I/O here (``_app`` does it).

    JSON body ──parse_completion / parse_chat──> Generation (prompt ids, limits checked)   or ApiError
    tokens ──TextStream.feed──> text safe to emit (stop strings held back until decided), finish_reason
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import Sequence
from typing import Any

import structlog

from examples.serve.config import Limits
from examples.tiny_model import ByteTokenizer
from orchestrator._sampling import GREEDY_BELOW, SEED_MASK

log = structlog.get_logger("examples.serve")
TOKENIZER = ByteTokenizer()
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An answer in the OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        out = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        if self.status == 408:  # the body never came whole: the connection goes with it (RFC 9110 15.5.9)
            out["Connection"] = "close"
        return out


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable"}


NO_OPS: dict[str, tuple[Any, ...]] = {"tools": ([],), "response_format": ({"type": "text"},), "modalities": (["text"],)}
"""Values of refused fields that ask for nothing (some clients send them by default): accepted."""
REFUSED = {
    "tools": "no tool calling: the tiny model has no tool-call format",
    "tool_choice": "no tool calling",
    "functions": "no function calling",
    "function_call": "no function calling",
    "parallel_tool_calls": "no tool calling",
    "response_format": "no structured output (json_object / json_schema)",
    "guided_json": "no guided decoding",
    "guided_regex": "no guided decoding",
    "guided_choice": "no guided decoding",
    "guided_grammar": "no guided decoding",
    "structured_outputs": "no guided decoding",
    "logit_bias": "no logit bias",
    "audio": "text only",
    "modalities": "text only",
    "prediction": "no predicted outputs",
}
"""Fields refused with a 400 naming them whenever they are given (not null): accepting them silently
would return something other than what the client asked for."""


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass(frozen=True)
class Generation:
    """One validated request, whichever endpoint it came from."""

    kind: str
    """``completion`` or ``chat``."""
    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    sampling: dict[str, Any] | None = None
    """Sampling parameters for the nodes (``orchestrator._sampling.SamplingParams`` on the wire; None: greedy)."""
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    """Top log-probabilities per output token (0: the chosen token's only); None: none."""

    def choice(self, i: int) -> Generation:
        """The ``i``-th of ``n`` choices: its own request id on the nodes, its own seed."""
        if self.n == 1:
            return self
        sampling = None if self.sampling is None else {**self.sampling,
                                                       "seed": (self.sampling["seed"] + i) & SEED_MASK}
        return dataclasses.replace(self, request_id=f"{self.request_id}-{i}", sampling=sampling)


# -- parsing --------------------------------------------------------------------------------------

def parse_completion(body: dict[str, Any], *, model: str, limits: Limits, max_model_len: int) -> Generation:
    prompt_ids = _prompt_ids(body.get("prompt"))
    if body.get("echo"):
        raise invalid("echo is not supported", "echo", "unsupported_parameter")
    if body.get("suffix") is not None:
        raise invalid("suffix is not supported", "suffix", "unsupported_parameter")
    return _common(body, "completion", prompt_ids, model=model, limits=limits, max_model_len=max_model_len,
                   max_tokens_fields=("max_tokens",))


def parse_chat(body: dict[str, Any], *, model: str, limits: Limits, max_model_len: int) -> Generation:
    prompt_ids = _encode(render_chat(body.get("messages")), "messages")
    return _common(body, "chat", prompt_ids, model=model, limits=limits, max_model_len=max_model_len,
                   max_tokens_fields=("max_completion_tokens", "max_tokens"))


def render_chat(messages: Any) -> str:
    """The chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n`` (BOS first,
    added by the tokenizer). Content is a string or a list of ``{"type": "text", "text": ...}`` parts."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{i}] must be an object with a role in {', '.join(CHAT_ROLES)}", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        out.append(f"<|{m['role']}|>\n{content}\n")
    out.append("<|assistant|>\n")
    return "".join(out)


def _encode(text: str, param: str) -> list[int]:
    try:
        return TOKENIZER.encode(text)
    except UnicodeEncodeError as exc:  # JSON may carry a lone surrogate ("\ud800"): not text
        raise invalid(f"{param} is not valid Unicode text: {exc.reason} at character {exc.start}", param) from None


def _prompt_ids(prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _encode(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < TOKENIZER.vocab_size for t in prompt):
            raise invalid(f"prompt token ids must be in [0, {TOKENIZER.vocab_size})", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, (int, float)) for t in prompt):
        raise invalid("prompt token ids must be integers", "prompt")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("only one prompt per request is supported", "prompt", "unsupported_parameter")
    raise invalid("prompt must be a string, a list of token ids, or a list of one of those", "prompt")


def _common(body: dict[str, Any], kind: str, prompt_ids: list[int], *, model: str, limits: Limits,
            max_model_len: int, max_tokens_fields: Sequence[str]) -> Generation:
    name = body.get("model")
    if not isinstance(name, str):
        raise invalid("model is required (a string)", "model", "missing_required_parameter")
    if name != model:
        raise invalid(f"the model {name!r} does not exist; this server serves {model!r}", "model", "model_not_found")
    for f in REFUSED:
        if body.get(f) is not None and body[f] not in NO_OPS.get(f, ()):
            raise invalid(f"{f} is not supported by this server ({REFUSED[f]})", f, "unsupported_parameter")
    max_tokens, max_field = limits.default_max_tokens, "max_tokens"
    for f in reversed(max_tokens_fields):  # each one given is checked; the first listed wins
        if body.get(f) is not None:
            max_tokens, max_field = _int(body, f, lo=1), f  # errors name the field the client sent
    if max_tokens > limits.max_tokens:
        raise invalid(f"{max_field}={max_tokens} exceeds this server's limit of {limits.max_tokens}", max_field)
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise invalid(f"the prompt has {len(prompt_ids)} tokens, more than this server's limit of "
                      f"{limits.max_prompt_tokens}", "prompt" if kind == "completion" else "messages",
                      "context_length_exceeded")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise invalid(f"this model's maximum context length is {max_model_len} tokens; the request asks for "
                      f"{len(prompt_ids)} prompt + {max_tokens} completion tokens", max_field, "context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, lo=0.0, hi=2.0)  # OpenAI's and vLLM's default: 1
    if temperature < GREEDY_BELOW:  # logits / 5e-324 overflow to inf: greedy, as vLLM reads it (the nodes too)
        temperature = 0.0
    top_p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = body.get("top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise invalid("top_k must be an integer >= 0 (-1 or 0: every token)", "top_k")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid("seed must be an integer", "seed")
    if seed is not None and not -(1 << 63) <= seed < 1 << 63:  # as vLLM's: a 64-bit signed integer
        raise invalid(f"seed must be an integer in [-2^63, 2^63 - 1], not {str(seed)[:30]}", "seed")
    min_tokens = _int(body, "min_tokens", lo=0) if body.get("min_tokens") is not None else 0
    if min_tokens > max_tokens:
        raise invalid(f"min_tokens={min_tokens} exceeds {max_field}={max_tokens}", "min_tokens")
    stop_ids = body.get("stop_token_ids") or []
    if (not isinstance(stop_ids, list) or len(stop_ids) > 16
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < TOKENIZER.vocab_size for t in stop_ids)):
        raise invalid(f"stop_token_ids must be a list of at most 16 token ids in [0, {TOKENIZER.vocab_size})",
                      "stop_token_ids")
    n = _int(body, "n", lo=1) if body.get("n") is not None else 1
    if n > limits.max_n:
        raise invalid(f"n={n} exceeds this server's limit of {limits.max_n}", "n")
    if n > limits.max_concurrent_requests:  # its n choices run at once: more could never be admitted
        raise invalid(f"n={n} exceeds this server's max_concurrent_requests of {limits.max_concurrent_requests}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise invalid("best_of must equal n (or be omitted)", "best_of", "unsupported_value")
    _only(body, "presence_penalty", (0,), "presence_penalty is not supported (0 only)")
    _only(body, "frequency_penalty", (0,), "frequency_penalty is not supported (0 only)")
    _only(body, "repetition_penalty", (1,), "repetition_penalty is not supported (1 only)")
    _only(body, "min_p", (0,), "min_p is not supported (0 only)")
    top_logprobs = _logprobs(body, kind)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise invalid("stream_options needs stream: true and must be an object", "stream_options")
    if options and options.get("continuous_usage_stats"):
        raise invalid("stream_options.continuous_usage_stats is not supported", "stream_options.continuous_usage_stats",
                      "unsupported_parameter")
    if options:
        _known_or_refuse(options, {"include_usage", "continuous_usage_stats"}, "stream_options.")
    include_usage = bool(options) and _bool(options, "include_usage", param="stream_options.include_usage")
    _log_ignored(body, kind)
    ignore_eos = _bool(body, "ignore_eos")
    sampling = None
    if temperature > 0 or min_tokens or top_logprobs is not None:  # else greedy: the nodes' argmax path (and TP)
        suppress = [*stop_ids, *([] if ignore_eos else [TOKENIZER.eos_id])]
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                    "seed": secrets.randbits(63) if seed is None else seed & SEED_MASK,
                    "min_tokens": min_tokens, "suppress": suppress}
    return Generation(
        kind=kind, request_id=f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()), model=model, prompt_ids=prompt_ids, max_tokens=max_tokens,
        stop=_stop(body.get("stop"), limits), ignore_eos=ignore_eos, stream=stream,
        include_usage=include_usage, return_token_ids=_bool(body, "return_token_ids"), sampling=sampling,
        n=n, stop_token_ids=tuple(stop_ids), include_stop_str=_bool(body, "include_stop_str_in_output"),
        min_tokens=min_tokens, logprobs=top_logprobs,
    )


def _logprobs(body: dict[str, Any], kind: str) -> int | None:
    """How many top log-probabilities per token (None: no logprobs). Completions: ``logprobs`` an
    integer 0..5; chat: ``logprobs`` true and ``top_logprobs`` 0..20."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "completion":
        if top is not None:
            raise invalid("top_logprobs belongs to chat completions; use logprobs: N", "top_logprobs")
        if lp is None:
            return None
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5:
            raise invalid("logprobs must be an integer in [0, 5]", "logprobs")
        return lp
    if lp is not None and not isinstance(lp, bool):
        raise invalid("logprobs must be a boolean", "logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise invalid("top_logprobs must be an integer in [0, 20]", "top_logprobs")
    if top is not None and not lp:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if lp else None


KNOWN = {
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "stop",
    "temperature", "top_p", "top_k", "min_p", "n", "best_of", "seed", "min_tokens", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "return_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logprobs", "top_logprobs", "echo", "suffix", "user", *REFUSED,
}
"""Fields this server reads (implemented, or refused with a 400 naming them when they ask for
something it cannot do). ``user`` is OpenAI's end-user tag: accepted, used for nothing."""
_IGNORED_LOGGED: set[str] = set()
MAX_IGNORED_LOGGED = 256
"""Distinct unknown field names remembered (each logged once): a client that sends new names with
every request made the set grow without end, ~1 MiB and 900 log lines per request (an outside
review of bounded memory); past this many, new names are not logged one by one."""


def _log_ignored(body: dict[str, Any], kind: str) -> None:
    """Unknown fields are ignored, as vLLM does, and each is logged once (``ignored_request_field``),
    for the first ``MAX_IGNORED_LOGGED`` names; after that a request with names not seen before is
    one line (``ignored_request_fields``, how many, the first name cut short)."""
    new = set(body) - KNOWN - _IGNORED_LOGGED
    if not new:
        return
    if len(_IGNORED_LOGGED) + len(new) <= MAX_IGNORED_LOGGED:
        for name in sorted(new):
            _IGNORED_LOGGED.add(name)
            log.warning("ignored_request_field", field=name[:64], endpoint=kind,
                        note="not a field this server knows: ignored (logged once per field)")
        return
    log.warning("ignored_request_fields", count=len(new), first=min(new)[:64], endpoint=kind,
                note="fields this server does not know: ignored (too many distinct names to log each once)")


def _known_or_refuse(obj: dict[str, Any], known: set[str], where: str) -> None:
    for name in obj:
        if name not in known:
            raise invalid(f"{where}{name} is not supported", f"{where}{name}", "unsupported_parameter")


def _number(body: dict[str, Any], name: str, default: float, *, lo: float, hi: float, lo_open: bool = False) -> float:
    """``body[name]``, a number in [lo, hi] (``lo_open``: in (lo, hi]); NaN, bools and strings are not."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise invalid(f"{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", name)
    return float(v)


def _int(body: dict[str, Any], name: str, *, lo: int) -> int:
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise invalid(f"{name} must be an integer >= {lo}", name)
    return v


def _bool(body: dict[str, Any], name: str, *, param: str | None = None) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"{param or name} must be a boolean", param or name)
    return v


def _only(body: dict[str, Any], name: str, allowed: tuple[float, ...], message: str) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v not in allowed:
        raise invalid(message, name, "unsupported_value")


def _stop(stop: Any, limits: Limits) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if (not isinstance(items, list) or len(items) > limits.max_stop_strings
            or not all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_chars for s in items)):
        raise invalid(f"stop must be a string or a list of at most {limits.max_stop_strings} strings of "
                      f"1..{limits.max_stop_chars} characters", "stop")
    return tuple(items)


# -- detokenizing ---------------------------------------------------------------------------------

class TextStream:
    """Output tokens in, text out, with EOS, ``stop`` strings and ``max_tokens`` applied.

    Text that might be the start of a stop string is held back until the next token decides; a stop
    string ends the output and is not part of it (nor is EOS). ``finish_reason`` is None until the
    output ended (``stop`` or ``length``); tokens fed after that are ignored. As in vLLM, no stop
    string ends the output before ``min_tokens`` tokens (EOS and stop tokens cannot be drawn then)."""

    def __init__(self, *, max_tokens: int, stop: tuple[str, ...] = (), ignore_eos: bool = False,
                 stop_token_ids: tuple[int, ...] = (), include_stop_str: bool = False, min_tokens: int = 0) -> None:
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop = stop
        self.ignore_eos = ignore_eos
        self.stop_token_ids = frozenset(stop_token_ids)
        self.include_stop_str = include_stop_str
        """vLLM's ``include_stop_str_in_output``: the stop string (or stop token) ends the output and is part of it."""
        self.token_ids: list[int] = []
        self.offsets: list[int] = []
        """Per token (aligned with ``token_ids``): where its text starts in the output (completions'
        ``logprobs.text_offset``): the characters decoded before it, so a byte that is only part of a
        character points at that character, and every offset is the same streamed or not."""
        self.finish_reason: str | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._emitted = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text[: self._emitted]

    def feed(self, tokens: Sequence[int]) -> str:
        """Text that may be sent now."""
        for t in tokens:
            if self.finish_reason is not None:
                break
            self.token_ids.append(t)
            self.offsets.append(len(self._text))
            if t == TOKENIZER.eos_id and not self.ignore_eos:
                self._finish("stop")
                break
            start = max(0, len(self._text) - self._hold)
            if t in self.stop_token_ids:
                if self.include_stop_str and 0 <= t < 256:
                    self._text += self._decoder.decode(bytes((t,)))
                self._finish("stop")
                break
            if 0 <= t < 256:
                self._text += self._decoder.decode(bytes((t,)))
            if len(self.token_ids) >= self.min_tokens and self._find_stop(start):
                break
            if len(self.token_ids) >= self.max_tokens:
                self._finish("length")
        end = len(self._text) if self.finish_reason else max(self._emitted, len(self._text) - self._hold)
        out, self._emitted = self._text[self._emitted:end], end
        return out

    def end(self, reason: str) -> str:
        """End the output now (if it has not ended); the text still held back."""
        if self.finish_reason is None:
            self._finish(reason)
        out, self._emitted = self._text[self._emitted:], len(self._text)
        return out

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        start = max(0, len(self._text) - self._hold)
        self._text += self._decoder.decode(b"", final=True)  # a dangling partial character: U+FFFD
        if reason == "length":
            self._find_stop(start)

    def _find_stop(self, start: int) -> bool:
        hits = [(i, len(s)) for s in self.stop if (i := self._text.find(s, start)) >= 0]
        if not hits:
            return False
        at, length = min(hits)
        self._text = self._text[: at + length] if self.include_stop_str else self._text[:at]
        self.finish_reason = "stop"
        return True


# -- response shapes ------------------------------------------------------------------------------

def usage(g: Generation, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": len(g.prompt_ids), "completion_tokens": completion_tokens,
            "total_tokens": len(g.prompt_ids) + completion_tokens}


def token_str(t: int) -> str:
    """A token as text in logprobs: its character for ASCII bytes; ``bytes:\\xNN`` for a byte that is only
    part of a character (vLLM's notation), so that top_logprobs keys stay distinct; ``<eos>``."""
    if 0 <= t < 128:
        return chr(t)
    if t < 256:
        return f"bytes:\\x{t:02x}"
    return "<eos>" if t == TOKENIZER.eos_id else f"<{t}>"


def logprobs_obj(g: Generation, ids: Sequence[int], lps: Sequence[Any], offsets: Sequence[int]) -> dict[str, Any] | None:
    """The ``logprobs`` of a choice (or of a chunk: its tokens), OpenAI's shape for each endpoint.
    ``lps[i]``: ``[logprob, [[id, logprob], ...]]`` as the nodes send it; ``offsets[i]``: where token
    i's text starts in the choice's text (``TextStream.offsets``: not the lengths of the token strings,
    which are 10 characters for a ``bytes:\\xNN`` token that is one character or less of the text)."""
    if g.logprobs is None:
        return None
    kept = [(t, lp, at) for t, lp, at in zip(ids, lps, offsets) if lp is not None]
    pairs = [(t, lp) for t, lp, _ in kept]
    if g.kind == "completion":
        return {"tokens": [token_str(t) for t, _ in pairs], "token_logprobs": [lp[0] for _, lp in pairs],
                "top_logprobs": [{token_str(i): v for i, v in lp[1]} for _, lp in pairs] if g.logprobs else None,
                "text_offset": [at for _, _, at in kept]}
    return {"content": [{"token": token_str(t), "logprob": lp[0], "bytes": [t] if t < 256 else [],
                         "top_logprobs": [{"token": token_str(i), "logprob": v, "bytes": [i] if i < 256 else []}
                                          for i, v in lp[1]]} for t, lp in pairs]}


def response(g: Generation, texts: TextStream | Sequence[TextStream],
             lps: Sequence[Sequence[Any]] | None = None) -> dict[str, Any]:
    """The non-streaming answer (one choice per TextStream: ``n``)."""
    texts = [texts] if isinstance(texts, TextStream) else list(texts)
    choices = []
    for i, text in enumerate(texts):
        lp = logprobs_obj(g, text.token_ids, lps[i], text.offsets) if lps is not None else None
        if g.kind == "completion":
            choice: dict[str, Any] = {"index": i, "text": text.text, "logprobs": lp, "finish_reason": text.finish_reason}
        else:
            choice = {"index": i, "message": {"role": "assistant", "content": text.text}, "logprobs": lp,
                      "finish_reason": text.finish_reason}
        if g.return_token_ids:
            choice["prompt_token_ids"] = g.prompt_ids
            choice["token_ids"] = text.token_ids
        choices.append(choice)
    obj = "text_completion" if g.kind == "completion" else "chat.completion"
    return {"id": g.request_id, "object": obj, "created": g.created, "model": g.model, "choices": choices,
            "usage": usage(g, sum(len(t.token_ids) for t in texts))}


def chunk(g: Generation, piece: str, *, finish_reason: str | None = None, role: bool = False,
          token_ids: list[int] | None = None, logprobs: dict[str, Any] | None = None, index: int = 0) -> bytes:
    """One SSE event of a stream: a piece of text (``role``: the chat stream's first delta) of choice ``index``."""
    if g.kind == "completion":
        choice: dict[str, Any] = {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant", "content": piece} if role else ({"content": piece} if piece else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    if g.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    body: dict[str, Any] = {"id": g.request_id, "object": obj, "created": g.created, "model": g.model, "choices": [choice]}
    if g.include_usage:
        body["usage"] = None
    return sse(body)


def usage_chunk(g: Generation, completion_tokens: int) -> bytes:
    obj = "text_completion" if g.kind == "completion" else "chat.completion.chunk"
    return sse({"id": g.request_id, "object": obj, "created": g.created, "model": g.model, "choices": [],
                "usage": usage(g, completion_tokens)})


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
