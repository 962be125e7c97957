"""Sampling: ``orchestrator._sampling`` on its own, then through the front with the real ``openai``
client against real CTX and GEN nodes: a sampled disaggregated run equals a single-process run of
``examples.tiny_model`` with the same parameters and seed (parity holds for sampled runs), and the
vLLM/OpenAI fields (temperature's default of 1, top_p, top_k, seed, min_tokens, stop_token_ids,
include_stop_str_in_output, n) do what they say."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from examples.tiny_model import ByteTokenizer, ModelConfig, TinyModel
from orchestrator._sampling import SamplingParams, sample
from tests.test_serve import CLUSTER_YAML, running_front

TOK = ByteTokenizer()
EOS = TOK.eos_id


# -- the sampler ----------------------------------------------------------------------------------

def test_sample_is_a_function_of_seed_position_and_logits() -> None:
    logits = torch.linspace(-2, 2, 300, dtype=torch.float64)
    p = SamplingParams(temperature=1.0, seed=5)
    assert [sample(logits, p, position=i, index=i) for i in range(50)] == \
        [sample(logits.clone(), p, position=i, index=i) for i in range(50)]
    draws = {sample(logits, p, position=i, index=i) for i in range(50)}
    assert len(draws) > 10  # it does draw
    assert sample(logits, SamplingParams(temperature=0), position=0, index=0) == 299
    assert sample(logits, SamplingParams(top_k=1, seed=9), position=3, index=3) == 299
    assert {sample(logits, SamplingParams(top_k=3, seed=9), position=i, index=i) for i in range(60)} == {297, 298, 299}
    assert {sample(logits, SamplingParams(top_p=1e-9, seed=9), position=i, index=i) for i in range(20)} == {299}


def test_sample_follows_the_distribution() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -30.0], dtype=torch.float64)
    probs = torch.softmax(logits / 0.8, 0)
    n = 4000
    counts = collections.Counter(sample(logits, SamplingParams(temperature=0.8, seed=1), position=i, index=0)
                                 for i in range(n))
    assert counts[3] == 0
    for t in range(3):  # within 4 standard deviations of the binomial
        sd = (n * probs[t] * (1 - probs[t])) ** 0.5
        assert abs(counts[t] - n * probs[t]) < 4 * sd, (t, counts, probs)


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    logits = torch.zeros(300, dtype=torch.float64)
    logits[EOS] = 50.0
    logits[7] = 49.0
    p = SamplingParams(temperature=0, min_tokens=2, suppress=(EOS, 7))
    assert sample(logits, p, position=10, index=0) not in (EOS, 7)
    assert sample(logits, p, position=11, index=1) not in (EOS, 7)
    assert sample(logits, p, position=12, index=2) == EOS
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    assert SamplingParams.from_wire(p.to_wire()) == p
    with pytest.raises(ValueError):
        SamplingParams.from_wire({"temperature": "hot"})
    logits = torch.zeros(300, dtype=torch.float32)
    logits[59] = 3.0
    for tiny in (5e-324, 1e-300, 1e-6):  # logits / 5e-324 were infinities: the last token (EOS) always drawn
        assert all(sample(logits, SamplingParams(temperature=tiny, seed=s), position=s, index=0) == 59 for s in range(20))
    for field in ("top_k", "seed", "min_tokens"):  # JSON's 1e400 is an infinity: int() raised OverflowError,
        with pytest.raises(ValueError, match="sampling"):  # which the CTX's prefill did not catch (no answer)
            SamplingParams.from_wire({field: float("inf")})
    with pytest.raises(ValueError, match="sampling"):
        SamplingParams.from_wire({"suppress": [float("inf")]})


# -- through the front ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel(ModelConfig())


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("sampling")
    with running_front(folder, CLUSTER_YAML) as info:
        info["folder"] = folder
        yield info


@pytest.fixture(scope="module")
def client(front: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=front["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def ref(model: TinyModel, prompt: str, n: int, **params: Any) -> list[int]:
    return model.generate_reference(TOK.encode(prompt), n, SamplingParams(**params))


@pytest.mark.integration
def test_sampled_run_equals_single_process(client: openai.OpenAI, model: TinyModel) -> None:
    prompt, n = "Sampling, disaggregated", 14
    extra = {"top_k": 40, "ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0.9, top_p=0.95, seed=1234,
                                  extra_body=extra)
    got = r.choices[0].model_extra["token_ids"]
    assert got == ref(model, prompt, n, temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    assert got != model.generate_reference(TOK.encode(prompt), n)  # it did sample
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0.9, top_p=0.95,
                                      seed=1234, extra_body=extra)
    assert again.choices[0].model_extra["token_ids"] == got  # the same seed, the same tokens
    other = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0.9, top_p=0.95,
                                      seed=99, extra_body=extra)
    assert other.choices[0].model_extra["token_ids"] != got
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0.9, top_p=0.95,
                                       seed=1234, stream=True, extra_body=extra)
    assert [t for c in stream for t in (c.choices[0].model_extra.get("token_ids") or [])] == got


@pytest.mark.integration
def test_temperature_defaults_to_one(client: openai.OpenAI, model: TinyModel) -> None:
    """An omitted temperature samples at 1.0, as OpenAI and vLLM do (it was greedy)."""
    messages = [{"role": "user", "content": "Hi"}]
    from examples.serve._api import render_chat

    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=3,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids = TOK.encode(render_chat(messages))
    assert r.choices[0].model_extra["token_ids"] == model.generate_reference(prompt_ids, 12,
                                                                             SamplingParams(temperature=1.0, seed=3))


@pytest.mark.integration
def test_min_tokens_and_n(client: openai.OpenAI, model: TinyModel) -> None:
    prompt = "several choices"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=1.2, seed=50, n=3,
                                  extra_body={"min_tokens": 10, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):  # choice i: seed + i; EOS cannot end it before min_tokens
        assert c.model_extra["token_ids"] == ref(model, prompt, 10, temperature=1.2, seed=50 + i, min_tokens=10,
                                                 suppress=(EOS,))
        assert len(c.model_extra["token_ids"]) == 10
    assert r.usage.completion_tokens == 30
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) == 3


@pytest.mark.integration
def test_stop_token_ids_and_include_stop_str(client: openai.OpenAI, model: TinyModel) -> None:
    prompt = "stop tokens here"
    greedy = model.generate_reference(TOK.encode(prompt), 24)
    i = next((k for k in range(2, 20) if greedy[k] < 256 and greedy[k] not in greedy[:k]), None)
    if i is None:
        pytest.skip("no usable stop token in the reference output")
    base = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    r = client.completions.create(**base, extra_body={"stop_token_ids": [greedy[i]], "ignore_eos": True,
                                                      "return_token_ids": True})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["token_ids"] == greedy[: i + 1]
    assert c.text == TOK.decode(greedy[:i])
    r = client.completions.create(**base, extra_body={"stop_token_ids": [greedy[i]], "ignore_eos": True,
                                                      "include_stop_str_in_output": True})
    assert r.choices[0].text == TOK.decode(greedy[: i + 1])
    text = TOK.decode(greedy)
    cut = next((k for k in range(2, len(text) - 2) if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k),
               None)
    if cut is not None:
        stop = text[cut:cut + 2]
        for stream in (False, True):
            out = client.completions.create(**base, stop=[stop], stream=stream,
                                            extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
            chunks = list(out) if stream else [out]
            assert "".join(ch.choices[0].text for ch in chunks) == text[: cut + 2]


@pytest.mark.integration
def test_refused_and_ignored_fields(front: Any, client: openai.OpenAI) -> None:
    for kwargs, param in [(dict(logprobs=6), "logprobs"), (dict(extra_body={"repetition_penalty": 1.3}), "repetition_penalty"),
                          (dict(extra_body={"min_p": 0.1}), "min_p"), (dict(logit_bias={"65": 5}), "logit_bias"),
                          (dict(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
                           "stream_options.continuous_usage_stats")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, **kwargs)
        assert err.value.body["param"] == param, err.value.body
    for _ in range(2):  # an unknown field: served, logged once as ignored
        r = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0,
                                      extra_body={"frobnicate": True})
        assert r.choices[0].finish_reason in ("length", "stop")
    log = Path(front["folder"], "front.log").read_text()
    assert log.count('"field": "frobnicate"') == 1, log[-2000:]


@pytest.mark.integration
def test_logprobs(client: openai.OpenAI, model: TinyModel) -> None:
    """The chosen token's log-probability (and the top ones) under the model, from CTX (the first
    token) and GEN (the rest): equal to log_softmax of the single-process logits."""
    prompt, n = "log probabilities", 6
    params = SamplingParams(temperature=0.7, seed=11)
    ids, logits = model.reference_logits(TOK.encode(prompt), n, params)
    want = torch.log_softmax(logits.to(torch.float64), dim=-1)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0.7, seed=11, logprobs=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    assert c.model_extra["token_ids"] == ids
    assert c.logprobs.token_logprobs == pytest.approx([float(want[i, t]) for i, t in enumerate(ids)], abs=1e-9)
    assert all(len(top) == 3 for top in c.logprobs.top_logprobs)
    assert c.logprobs.tokens == [chr(t) if t < 128 else f"bytes:\\x{t:02x}" if t < 256 else "<eos>" for t in ids]
    messages = [{"role": "user", "content": "lp"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 extra_body={"ignore_eos": True}))
    content = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(content) == n and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)  # greedy: the top one
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


@pytest.mark.integration
def test_n_choices_streamed(client: openai.OpenAI, model: TinyModel) -> None:
    prompt = "streamed choices"
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.8, seed=70, n=2,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    got: dict[int, list[int]] = {0: [], 1: []}
    finished = {}
    for ch in chunks:
        for c in ch.choices:
            got[c.index] += c.model_extra.get("token_ids") or []
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    for i in (0, 1):
        assert got[i] == ref(model, prompt, 8, temperature=0.8, seed=70 + i)
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


@pytest.mark.integration
def test_n_choices_stream_left_early_aborts_both(front: Any) -> None:
    import httpx

    from tests.test_serve import node_stats

    body = {"model": "tiny", "prompt": "leave early", "max_tokens": 500, "n": 2, "stream": True, "ignore_eos": True,
            "temperature": 1.0}
    aborted = node_stats(front, "gen")["engine"]["aborted"]
    with httpx.stream("POST", front["url"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert [next(lines) for _ in range(6)]
    deadline = time.monotonic() + 20
    while True:
        gen, ctx = node_stats(front, "gen"), node_stats(front, "ctx")
        if gen["engine"]["aborted"] >= aborted + 2 and not gen["rest_problems"] and ctx["store"]["held_requests"] == 0:
            break
        assert time.monotonic() < deadline, (gen["engine"], ctx["store"])
        time.sleep(0.1)
    health = httpx.get(front["url"] + "/health").json()  # closing the choices is not a GEN failure
    assert health["status"] == "ok" and all(n["up"] for n in health["nodes"])
