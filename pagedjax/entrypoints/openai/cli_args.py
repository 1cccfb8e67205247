"""`pagedjax serve`'s own flags, with vllm serve's spellings (the engine's come from
EngineArgs.add_cli_args). Kept free of heavy imports: every `pagedjax` command builds them."""

from __future__ import annotations

import argparse


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`pagedjax serve`'s own flags (vllm serve's spellings); the engine's come from
    EngineArgs.add_cli_args."""
    parser.add_argument("model_tag", nargs="?", help="HF checkpoint directory (or --model)")
    parser.add_argument("--model", help="HF checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) the API answers to (default: the model path)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (file or inline) over the tokenizer's")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat_template")
    parser.add_argument("--speculative-model", default=None,
                        help="draft checkpoint (short for --speculative-config)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help="with --speculative-model: the most drafts per step")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic throughput / KV usage log line")
    parser.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between periodic log lines")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
    return parser
