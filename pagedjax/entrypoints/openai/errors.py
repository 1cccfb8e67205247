"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

A client's mistake is a 4xx with a message that names the value and the fix; the engine keeps
serving. A 5xx means a bug or a dead engine: its body says so in a few words and never carries
a traceback or the engine's own error (file paths, native build paths); the log has those.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedjax.engine.async_llm import EngineDeadError
from pagedjax.entrypoints.openai.protocol import request_field_names

logger = logging.getLogger("pagedjax")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error",
          503: "server_error", 500: "server_error"}
# what clients read when the engine is gone: a 503 for a new request (and /health), a 500 for
# one the engine was serving when it failed
ENGINE_DEAD = "the engine is not running; see the server log."
ENGINE_FAILED = "the engine failed while serving this request; see the server log."


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code),
                            status_code=self.status)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def bad_request(e: Exception) -> OpenAIError:
    """A ValueError/TypeError from the engine, SamplingParams or the chat template → 400, naming
    the parameter its message starts with (`SamplingParams.top_p=...`, `prompt token ids ...`,
    `messages[0]=...`) when that is a request field; `StructuredOutputsParams.json ...` (an
    invalid schema, regex or grammar) names structured_outputs."""
    message = str(e)
    if message.startswith("StructuredOutputsParams"):
        return OpenAIError(400, message, param="structured_outputs")
    match = re.match(r"(?:SamplingParams\.)?([a-z_]+)", message)
    param = match.group(1) if match and match.group(1) in request_field_names() else None
    return OpenAIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        return _validation_error(e).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return OpenAIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return OpenAIError(503, ENGINE_DEAD).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error serving %s", request.url.path)
        return OpenAIError(500, f"internal server error ({type(e).__name__}); see the server "
                                "log").response()


def _validation_error(e: RequestValidationError) -> OpenAIError:
    """pydantic's first complaint, as one readable line."""
    errors = e.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # pydantic reports a union field's failure once per member type: keep the field itself
    param = loc[0] if loc else None
    if not loc:
        return OpenAIError(400, f"the request body must be a JSON object: {first.get('msg')}")
    value = first.get("input")
    shown = json.dumps(value, default=str)[:100] if "input" in first else "(missing)"
    return OpenAIError(400, f"{'.'.join(loc)}={shown} is invalid: {first.get('msg')}",
                       param=param)
