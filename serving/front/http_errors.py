"""Error bodies of the front: `{"error": {"message", "type", "param", "code"}}`.

Parameter errors carry vLLM's own message and parameter name (its request
models, renderer and `SamplingParams` raise them); raypd's own refusals
(auth, limits, routing) carry an OpenAI-style code.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.exceptions import VLLMClientError

logger = logging.getLogger("raypd.api")

MAX_REPORTED_ERRORS = 5
# What vLLM raises for a client's mistake (its own class, or the plain errors its checks still raise).
CLIENT_ERRORS = (VLLMClientError, ValueError, TypeError, OverflowError)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def invalid_value(exc: Exception) -> ApiError:
    """vLLM refusing a value (VLLMValidationError, or the ValueError its checks raise): 400."""
    param = getattr(exc, "parameter", None)
    return ApiError(400, str(exc), param=param, code="invalid_value")


def _is_branch(part: Any) -> bool:
    """Union branch names pydantic puts in error locations ("str", "list[int]", "function-after[...]")."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def invalid_request(exc: ValidationError) -> ApiError:
    """A body that vLLM's request model refuses: its own message when one of its validators spoke."""
    errors = exc.errors()
    for e in errors:
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, CLIENT_ERRORS):
            return invalid_value(cause)
    where = [".".join(str(p) for p in e["loc"] if not _is_branch(p)) or "(body)" for e in errors]
    problems = "; ".join(f"{w}: {e['msg']}" for w, e in list(zip(where, errors))[:MAX_REPORTED_ERRORS])
    return ApiError(400, f"invalid request: {problems}", param=where[0], code="invalid_type")


async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, code), status_code=exc.status_code)


async def api_error(_: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc)


async def internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None, None),
                        status_code=500)
