"""The front starting a tensor-parallel GEN node (``launch.tensor_parallel_size``): tokens through
the OpenAI endpoint equal the single-process reference. Apart from tests/test_serve.py because a TP
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
    with running_front(tmp_path, tp_yaml) as info:
        body = {"model": "tiny", "prompt": "two ranks", "max_tokens": 10, "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(info["url"] + "/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["token_ids"] == model.generate_reference(TOK.encode("two ranks"), 10)
        time.sleep(1.5)  # the other rank reports its loop statistics every second; the front polls stats
        text = httpx.get(info["url"] + "/metrics", timeout=10).text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        gen = info["gen"][0]
        assert samples[("kvo_gen_tp_ranks", (("node", gen),))] == 2
        for rank in ("0", "1"):  # each rank's execution-thread figures
            assert ("kvo_gen_rank_exec_blocked_seconds", (("node", gen), ("quantile", "0.99"), ("rank", rank))) in samples
