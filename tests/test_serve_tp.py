"""The front starting tensor-parallel CTX and GEN nodes (``launch.tensor_parallel_size``): tokens
through the OpenAI endpoint equal the single-process reference (CTX TP2 -> GEN TP2: the prefill's
``kv_sources`` pass through the front). Apart from tests/test_serve.py because a TP
group takes ~30 s to start on this machine."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.tiny_model import ModelConfig, TinyModel
from tests.test_serve import CLUSTER_YAML, TOK, running_front

pytestmark = pytest.mark.integration


def test_front_starts_a_tensor_parallel_gen(tmp_path: Path) -> None:
    model = TinyModel(ModelConfig())
    tp_yaml = CLUSTER_YAML.replace("mode: orchestrated,", "mode: orchestrated, tensor_parallel_size: 2,")
    tp_yaml = tp_yaml.replace("- launch: {metrics_port: 0,", "- launch: {metrics_port: 0, tensor_parallel_size: 2,")
    assert tp_yaml.count("tensor_parallel_size: 2") == 2
    with running_front(tmp_path, tp_yaml) as info:
        body = {"model": "tiny", "prompt": "two ranks", "max_tokens": 10, "ignore_eos": True, "return_token_ids": True,
                "temperature": 0}
        r = httpx.post(info["url"] + "/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["token_ids"] == model.generate_reference(TOK.encode("two ranks"), 10)
        gen = info["gen"][0]
        wanted = [("kvo_gen_rank_exec_blocked_seconds", (("node", gen), ("quantile", "0.99"), ("rank", rank)))
                  for rank in ("0", "1")]  # each rank's execution-thread figures
        deadline = time.monotonic() + 20  # rank 1 reports every second, through rank 0's next step (an idle
        while True:                        # group steps once a second); the front polls the stats
            text = httpx.get(info["url"] + "/metrics", timeout=10).text
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for fam in text_string_to_metric_families(text) for s in fam.samples}
            if all(w in samples for w in wanted) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert samples[("kvo_gen_tp_ranks", (("node", gen),))] == 2
        for w in wanted:
            assert w in samples, w


TWO_OF_EACH = """
model: tiny
listen: {host: 127.0.0.1, port: 0}
transfer: {backend: ucx, max_tokens_in_buffer: 256, kv_transfer_timeout_ms: 20000}
limits: {max_body_bytes: 65536, max_prompt_tokens: 512, max_tokens: 600, default_max_tokens: 8}
routing: {stats_interval_s: 0.25, retry_after_s: 2}
ctx:
  - launch: {args: ["--num-blocks", "256"]}
  - launch: {args: ["--num-blocks", "256"]}
gen:
  - launch: {mode: orchestrated, step: device, args: ["--num-blocks", "256", "--device-step-ms", "40"]}
  - launch: {mode: orchestrated, step: device, args: ["--num-blocks", "256", "--device-step-ms", "40"]}
"""


def test_two_of_each_a_gen_killed_mid_stream_ends_its_streams_and_new_requests_go_to_the_other(tmp_path: Path) -> None:
    import json
    import os
    import signal
    import threading

    with running_front(tmp_path, TWO_OF_EACH) as info:
        url = info["url"]
        body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        streams: list[dict] = [{} for _ in range(4)]

        def stream(i: int) -> None:
            out = streams[i]
            out["tokens"], out["errors"], out["done"] = 0, [], False
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out["errors"].append(chunk["error"])
                        else:
                            out["tokens"] += len(chunk["choices"][0].get("token_ids") or [])

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(3)  # every stream is decoding (200 tokens x 40 ms: ~8 s each)
        victim = info["started"][-1]
        assert victim["role"] == "gen"
        os.kill(victim["pid"], signal.SIGKILL)
        for t in threads:
            t.join(60)
        cut = [s for s in streams if s["errors"]]
        assert cut, streams  # the streams on the killed GEN ended with an error event
        assert all(s["tokens"] < 200 for s in cut)
        assert all(s["tokens"] == 200 for s in streams if not s["errors"])  # the others finished
        deadline = time.monotonic() + 15
        ok = 0
        while ok < 4 and time.monotonic() < deadline:  # new requests go to the surviving GEN
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "still here?", "max_tokens": 4},
                           timeout=30)
            ok = ok + 1 if r.status_code == 200 else 0
            if r.status_code != 200:
                time.sleep(0.3)  # until the front has seen the node go
        assert ok == 4
