"""How an engine embeds the orchestrator: submit GEN requests, let the threads step, poll results.

Run it: ``python -m examples.embed``. A CTX peer is simulated in-process here; a real GEN node uses
``transports.ucx.UCXTransport`` and CTX addresses instead (see ``examples/two_node``).
"""

from __future__ import annotations

import time

import torch

from orchestrator import DecodeBatch, EngineThreads, GenEngine, GenRequest, OrchestratorConfig
from transports import KVLayout, KVStore
from transports.inproc import InProcTransport


def main() -> dict[str, list[int]]:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)

    # The CTX side: KV computed by prefill, held until pulled (simulated in-process).
    ctx_pool = layout.new_pool(64)
    ctx_store = KVStore(layout, ctx_pool)
    for i in range(4):
        blocks = torch.arange(i * 4, i * 4 + 4)
        ctx_pool[blocks] = float(i)
        ctx_store.put(f"req-{i}", blocks, num_tokens=64, lease_s=30.0)
    transport = InProcTransport({"ctx-0:13337": ctx_store}, bandwidth_bytes_per_s=1e9)

    # The GEN side: your model's decode step, called on the execution thread with the running batch.
    def decode_step(batch: DecodeBatch) -> torch.Tensor:
        return batch.tokens + 1  # a real engine runs the model over batch.kv / batch.block_tables

    config = OrchestratorConfig(
        layout=layout,
        num_blocks=128,
        transfer_budget_bytes=OrchestratorConfig.transfer_budget_for_tokens(layout, max_tokens_in_buffer=128),
        kv_transfer_timeout_ms=60_000,
    )
    engine = GenEngine(config, transport, decode_step)
    tokens: dict[str, list[int]] = {}
    with EngineThreads(engine):  # an event-loop thread (receives) + an execution thread (decode loop)
        for i in range(4):
            engine.submit(GenRequest(f"req-{i}", prompt_len=64, first_token=100, max_tokens=5, peer="ctx-0:13337"))
        done = 0
        deadline = time.monotonic() + 30
        while done < 4 and time.monotonic() < deadline:
            for out in engine.poll():  # non-blocking
                tokens.setdefault(out.request_id, []).extend(out.new_tokens)
                done += out.finished
            time.sleep(0.01)
    assert not engine.rest_problems(), engine.rest_problems()
    return tokens


if __name__ == "__main__":
    for rid, toks in sorted(main().items()):
        print(rid, toks)
