"""What both nodes share: model flags, the UCX config from the environment, checksums, READY."""

from __future__ import annotations

import argparse
import json
import sys
import zlib

import structlog
import torch

from examples.tiny_model import ModelConfig, TinyModel
from transports._auth import SECRET_ENV, load_secret
from transports.ucx import UCXConfig

log = structlog.get_logger("examples.two_node")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (both nodes must agree)")
    g.add_argument("--layers", type=int, default=ModelConfig.num_layers)
    g.add_argument("--heads", type=int, default=ModelConfig.num_heads)
    g.add_argument("--kv-heads", type=int, default=ModelConfig.num_kv_heads)
    g.add_argument("--head-dim", type=int, default=ModelConfig.head_dim)
    g.add_argument("--max-seq-len", type=int, default=ModelConfig.max_seq_len)
    g.add_argument("--seed", type=int, default=ModelConfig.seed)
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")


def add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--secret-file", help=f"file holding the shared secret (default: env {SECRET_ENV})")
    g.add_argument("--insecure", action="store_true", help="run without peer authentication (logs a warning)")


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
    )


def build_model(args: argparse.Namespace) -> TinyModel:
    torch.set_num_threads(1)  # two cores: one for the execution thread, one for the event loop
    return TinyModel(model_config(args))


def ucx_config(args: argparse.Namespace) -> UCXConfig:
    secret = load_secret(path=args.secret_file)
    if secret is None and not args.insecure:
        raise SystemExit(f"no shared secret: set {SECRET_ENV} or --secret-file (or pass --insecure)")
    return UCXConfig(secret=secret, allow_insecure=args.insecure)


def block_checksums(pool: torch.Tensor, block_ids: torch.Tensor) -> list[int]:
    """CRC32 of each block's bytes, in block-table order (compared end to end CTX -> GEN)."""
    out = []
    for i in block_ids.tolist():
        block = pool[i]
        out.append(zlib.crc32(block.contiguous().view(torch.uint8).numpy().data))
    return out


def announce_ready(**fields: object) -> None:
    """The one line a parent process waits for."""
    sys.stdout.write("READY " + json.dumps(fields) + "\n")
    sys.stdout.flush()
