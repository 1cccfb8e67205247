"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncLLM: `pagedjax serve`.

Endpoints: POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /detokenize;
GET /v1/models, /health, /metrics (Prometheus), /version.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

import pagedjax
from pagedjax.engine.async_llm import AsyncEngineArgs, AsyncLLM
from pagedjax.engine.stat_loggers import PrometheusStatLogger
from pagedjax.entrypoints.chat_utils import load_chat_template
from pagedjax.entrypoints.openai.body_limit import BodyLimitMiddleware
from pagedjax.entrypoints.openai.connection_limits import guarded_h11
from pagedjax.entrypoints.openai.errors import error_body, install_error_handlers
from pagedjax.entrypoints.openai.prompt_limits import default_max_request_body_bytes
from pagedjax.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from pagedjax.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedjax.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedjax.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedjax.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedjax.entrypoints.openai.shutdown import DrainingServer, OpenResponses
from pagedjax.entrypoints.openai.tool_parsers import ToolParserManager

logger = logging.getLogger("pagedjax")

_PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


@dataclasses.dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None  # overrides the tokenizer's
    trust_request_chat_template: bool = False
    # a 413 past it; None: default_max_request_body_bytes(max_model_len)
    max_request_body_bytes: int | None = dataclasses.field(default=None, kw_only=True)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model's calls are parsed
    tool_call_parser: str | None = None  # with which ToolParser (tool_parsers/)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: one of "
                             f"{ToolParserManager.names()}.")
        if self.tool_call_parser is not None:
            ToolParserManager.get_tool_parser(self.tool_call_parser)  # names the known ones


class APIKeyMiddleware:
    """401 for /v1, /tokenize and /detokenize without `Authorization: Bearer <api key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"].startswith(_PROTECTED_PREFIXES)):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = error_body(401, "Incorrect API key provided; send 'Authorization: "
                                       "Bearer <the server's --api-key>'.",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The ASGI app; the caller runs it (uvicorn) and shuts the engine down afterwards."""
    app = FastAPI(title="pagedjax", version=pagedjax.__version__)
    install_error_handlers(app)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes
                       or default_max_request_body_bytes(engine.config.max_model_len))
    app.state.open_responses = OpenResponses()  # what a shutdown ends (shutdown.py)
    app.add_middleware(app.state.open_responses.middleware)
    _add_info_routes(app, engine, config.served_model_names)
    _add_generation_routes(app, engine, config)
    return app


def _add_info_routes(app: FastAPI, engine: AsyncLLM, names: list[str]) -> None:
    prometheus = next((s for s in engine.stat_loggers if isinstance(s, PrometheusStatLogger)),
                      None)

    @app.get("/health")
    async def health() -> Response:
        await engine.check_health()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedjax.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        model_config = engine.config
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "pagedjax",
                 "root": model_config.model, "parent": None,
                 "max_model_len": model_config.max_model_len, "permission": []}
                for name in names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = generate_latest(prometheus.registry) if prometheus is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)


def _add_generation_routes(app: FastAPI, engine: AsyncLLM, config: ServerConfig) -> None:
    names = config.served_model_names
    completions = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names, config.chat_template,
                             config.trust_request_chat_template,
                             config.enable_auto_tool_choice, config.tool_call_parser)
    tokenization = OpenAIServingTokenization(chat)
    responses = OpenAIServingResponses(chat)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        return tokenization.detokenize(request)


def engine_args_from_cli(args: argparse.Namespace) -> AsyncEngineArgs:
    from pagedjax.model_loader.demo import SMOLLM2_INSTRUCT, smollm2_instruct_dir

    args.model = args.model or args.model_tag
    if args.model == SMOLLM2_INSTRUCT:  # the shipped chat model, as `generate` takes it
        args.model = smollm2_instruct_dir()
        args.served_model_name = args.served_model_name or [SMOLLM2_INSTRUCT]
    if not args.model:
        raise ValueError("no model: pass a checkpoint directory, `pagedjax serve MODEL_DIR`.")
    if args.speculative_model:
        if args.speculative_config:
            raise ValueError("give --speculative-model or --speculative-config, not both.")
        args.speculative_config = {"model": args.speculative_model,
                                   "num_speculative_tokens": args.num_speculative_tokens}
    return AsyncEngineArgs.from_cli_args(args)


def make_engine(engine_args: AsyncEngineArgs, served_model_names: list[str], *,
                log_stats: bool = True, log_stats_interval: float = 10.0) -> AsyncLLM:
    """An AsyncLLM with the Prometheus stat logger that /metrics serves."""
    return AsyncLLM.from_engine_args(
        engine_args, log_stats=log_stats, log_stats_interval=log_stats_interval,
        stat_loggers=[lambda config: PrometheusStatLogger(served_model_names[0],
                                                          config.max_model_len)])


def run_server(args: argparse.Namespace) -> None:
    """Load the model, serve until interrupted, then free the engine."""
    import uvicorn

    engine_args = engine_args_from_cli(args)
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    names = args.served_model_name or [engine_args.model]
    config = ServerConfig(names, args.api_key, load_chat_template(args.chat_template),
                          args.trust_request_chat_template, args.enable_auto_tool_choice,
                          args.tool_call_parser)
    config.max_request_body_bytes = args.max_request_body_bytes
    engine = make_engine(engine_args, names, log_stats=not args.disable_log_stats,
                         log_stats_interval=args.log_stats_interval)
    try:
        app = build_app(engine, config)
        logger.info("Serving %s as %s on http://%s:%d", engine_args.model, names, args.host,
                    args.port)
        uvicorn_config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
            timeout_keep_alive=5, http=guarded_h11(args.request_read_timeout,
                                                   args.max_connections))
        DrainingServer(uvicorn_config, app.state.open_responses, args.shutdown_timeout).run()
    finally:
        engine.shutdown()
        logger.info("The engine is shut down.")
