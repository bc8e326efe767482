"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status code.

Every refusal names the bad value and a way forward. FastAPI would answer a body that
does not validate with 422 and its own shape; OpenAI (and the issue) want 400 with
the error body above, so the request models are validated here, not by FastAPI.
"""

from __future__ import annotations

import json
from types import UnionType
from typing import Any, Union, get_args, get_origin

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
}
EXAMPLES = {
    "messages": '[{"role": "user", "content": "Hello"}]',
    "prompt": '"Once upon a time"',
    "max_tokens": "64",
    "max_completion_tokens": "64",
    "temperature": "0.7",
    "top_p": "0.9",
    "top_k": "50",
    "stop": '["\\n"]',
    "stop_token_ids": "[2]",
    "seed": "42",
    "n": "1",
    "stream": "true",
    "model": '"smollm2"',
    "stream_options": '{"include_usage": true}',
}
_UNION_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


class APIError(Exception):
    """A request the server refuses: HTTP status, message, and the offending field."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation(err: ValidationError, model: type[BaseModel]) -> APIError:
    """The first problem of a request body, said as OpenAI would: which field, what it got."""
    first = err.errors()[0]
    if first["type"] == "json_invalid":
        return bad_request(
            f"the request body is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')}); "
            f'send a JSON object such as {{"model": ..., "messages": [...]}}',
            code="invalid_json",
        )
    if not first["loc"]:
        return bad_request(
            f"the request body must be a JSON object, not {_short(first.get('input'))}", code="invalid_type"
        )
    param = _param(first["loc"])
    field = model.model_fields.get(str(first["loc"][0]))
    got = _short(first.get("input"))
    if first["type"] == "missing":
        example = EXAMPLES.get(param)
        return bad_request(
            f"'{param}' is required" + (f', e.g. "{param}": {example}' if example else ""),
            param=param,
            code="missing_field",
        )
    expected = _type_name(field.annotation) if field is not None and param == first["loc"][0] else None
    msg = f"'{param}' must be {expected}, not {got}" if expected else f"'{param}': {first['msg']} (got {got})"
    if param in EXAMPLES:
        msg += f'; e.g. "{param}": {EXAMPLES[param]}'
    return bad_request(msg, param=param, code="invalid_type")


def _param(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union branch names dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part.lower() not in _UNION_BRANCHES:
            out += f".{part}" if out else part
    return out


def _type_name(annotation: Any) -> str:
    """int | None -> 'an integer'; str | list[str] | None -> 'a string or an array of strings'."""
    args = (
        [a for a in get_args(annotation) if a is not type(None)]
        if get_origin(annotation) in (Union, UnionType)
        else [annotation]
    )
    return " or ".join(_one_type(a) for a in args)


def _one_type(t: Any) -> str:
    if get_origin(t) is list:
        words = (_one_type(get_args(t)[0]) if get_args(t) else "a value").split(" ", 2)[1:]
        return "an array of " + " ".join([words[0] + "s", *words[1:]])  # 'an array of integers'
    if t is dict or get_origin(t) is dict or (isinstance(t, type) and issubclass(t, BaseModel)):
        return "an object"
    return {str: "a string", int: "an integer", float: "a finite number", bool: "true or false"}.get(t, "a value")


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, (bytes, bytearray)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- handlers for what FastAPI/Starlette raise themselves (unknown routes, wrong methods) -------
async def http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = (
            f"no route {request.url.path}; the server offers /v1/chat/completions, /v1/completions, "
            f"/v1/models, /health and /metrics"
        )
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}; use POST for completions, GET otherwise"
    else:
        message = str(exc.detail)
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)
