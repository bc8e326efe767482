"""``build_app``: the FastAPI app around one engine (an ``AsyncLLM`` or anything shaped like it)."""

from __future__ import annotations

import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

import shardlm
from shardlm.server import errors
from shardlm.server.metrics import Metrics
from shardlm.server.routes import chat_completions, completions, detokenize_route, tokenize_route

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/version",
)


def build_app(engine, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """``engine`` needs generate, tokenizer, checkpoint, config, kv_blocks, max_model_len, max_queue,
    stats, healthy and error (see ``shardlm.engine.async_llm.AsyncLLM``)."""
    app = FastAPI(title="shardlm", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.model_name = model_name
    app.state.metrics = metrics = Metrics(engine, model_name)
    app.state.created = int(time.time())
    # Starlette types a handler as taking any Exception; each of these takes the class it is registered for
    app.add_exception_handler(errors.APIError, errors.api_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, errors.http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, errors.unexpected)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", scrape, methods=["GET"])
    app.add_api_route("/tokenize", tokenize_route, methods=["POST"])  # vLLM's
    app.add_api_route("/detokenize", detokenize_route, methods=["POST"])
    app.add_api_route("/version", version, methods=["GET"])
    if api_key:
        app.add_middleware(RequireKey, key=api_key)
    app.add_middleware(CountRequests, metrics=metrics)  # added last: the outermost, so it counts the 401s too
    return app


async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": shardlm.__version__})


async def models(request: Request) -> JSONResponse:
    s = request.app.state
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": s.model_name,
                    "object": "model",
                    "created": s.created,
                    "owned_by": "shardlm",
                    "max_model_len": s.engine.max_model_len,
                }
            ],
        }
    )


async def health(request: Request) -> JSONResponse:
    engine = request.app.state.engine
    if engine.healthy:
        return JSONResponse({"status": "ok"})
    return JSONResponse(errors.error_body(503, f"unhealthy: {engine.error}", code="engine_dead"), status_code=503)


async def scrape(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    return errors.bad_request(f"invalid request: {exc.errors()[0].get('msg')}").response()


class RequireKey:
    """ASGI middleware (``serve --api-key``, vLLM's flag): /v1 requests must carry
    ``Authorization: Bearer KEY``; others get a 401 in OpenAI's error shape. /health, /metrics,
    /version, /tokenize and /detokenize stay open, as in vLLM."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = errors.APIError(
                    401, "missing or wrong API key; send the header 'Authorization: Bearer KEY'", code="invalid_api_key"
                )
                return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)


class CountRequests:
    """ASGI middleware: count every HTTP answer by endpoint and status (streams count when they start)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, counting_send)
