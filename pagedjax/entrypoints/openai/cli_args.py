"""`pagedjax serve`'s own flags, with vllm serve's spellings (the engine's come from
EngineArgs.add_cli_args). Kept free of heavy imports: every `pagedjax` command builds them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


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
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='parse tool calls from the model\'s text (tool_choice "auto"); '
                             "needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None,
                        help="the model's tool-call format: hermes, llama3_json, pythonic")
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
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds open requests get to finish after SIGTERM/SIGINT; then "
                             "streams end with an error event and the server exits")
    parser.add_argument("--max-request-body-bytes", type=_positive(int), default=None,
                        help="413 for a larger request body (default: 256 bytes per token of "
                             "--max-model-len, at least 8 MiB)")
    parser.add_argument("--request-read-timeout", type=_positive(float), default=30.0,
                        help="seconds a request has to arrive whole (headers and body); then "
                             "408 and the connection closes")
    parser.add_argument("--max-connections", type=_positive(int), default=None,
                        help="503 for requests past this many open connections (default: "
                             "4096, or fewer under a lower open-files limit)")
    return parser


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` above 0."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0; give a positive number")
        return value

    return parse
